"""The image itself: its Python packages are compiled, and a rebuild of the image under test
removes the one it replaced (untagged images used to pile up, one per `make test-compose` run of
a changed checkout)."""

from __future__ import annotations

import io

import pytest

from tests.e2e.conftest import base_image, built_image, docker_client, replace_image

TAG = "kvfleet-e2e-rebuild:test"

# Run in the image as its services run (their user, PYTHONDONTWRITEBYTECODE): the modules a worker
# imports first come from .pyc files, not from source compiled again at each start.
COMPILED = """
import importlib.util, pathlib, sys
import grpc, numpy, torch, worker_svc.server
missing = [m.__name__ for m in (grpc, numpy, torch) if not pathlib.Path(importlib.util.cache_from_source(m.__file__)).exists()]
assert sys.flags.dont_write_bytecode and not missing, (sys.flags.dont_write_bytecode, missing)
print("compiled")
"""


def test_the_image_s_packages_are_compiled() -> None:
    client, image, _ = built_image()
    out = client.containers.run(image, entrypoint=["python", "-c", COMPILED], remove=True)
    assert out.decode().strip() == "compiled"


def test_a_rebuild_removes_the_image_it_replaced_and_keeps_an_unchanged_one() -> None:
    import docker.errors

    client = docker_client()
    base = base_image(client)

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
