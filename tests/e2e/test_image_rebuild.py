"""A rebuild of the image under test removes the one it replaced (untagged images used to pile
up, one per `make test-compose` run of a changed checkout)."""

from __future__ import annotations

import io

import pytest

from tests.e2e.conftest import _base_image, _docker_client, replace_image

TAG = "kvfleet-e2e-rebuild:test"


def test_a_rebuild_removes_the_image_it_replaced_and_keeps_an_unchanged_one() -> None:
    import docker.errors

    client = _docker_client()
    base = _base_image(client)

    def build(label: str):
        dockerfile = io.BytesIO(f"FROM {base}\nLABEL kvfleet.test.rebuild={label}\n".encode())
        return lambda: client.images.build(fileobj=dockerfile, tag=TAG, rm=True)

    try:
        replace_image(client, TAG, build("one"))
        first = client.images.get(TAG).id
        replace_image(client, TAG, build("two"))
        second = client.images.get(TAG).id
        assert second != first
        with pytest.raises(docker.errors.ImageNotFound):
            client.images.get(first)  # gone, not left untagged
        replace_image(client, TAG, build("two"))  # the same content: the same image, kept
        assert client.images.get(TAG).id == second
        # an image the tag named that another tag still names is kept
        client.images.get(TAG).tag("kvfleet-e2e-rebuild", "kept")
        replace_image(client, TAG, build("three"))
        assert client.images.get("kvfleet-e2e-rebuild:kept").id == second
    finally:
        for tag in (TAG, "kvfleet-e2e-rebuild:kept"):
            try:
                client.images.remove(tag, force=True)
            except docker.errors.ImageNotFound:
                pass
