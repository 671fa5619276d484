"""The compose deployment under test: build the image, `docker-compose up`, wait healthy, tear down.

These tests need a running Docker engine and docker-compose; `make test-compose`
(deploy/compose.mk) provides both and sets KVFLEET_E2E=1. Without that variable the directory is
collected only when named on the command line (`pytest tests/e2e`), so a plain `pytest` never
needs Docker.

They are skipped only when Docker itself is not there (no docker CLI or docker-compose, or no
engine answering `docker version`) and the run did not ask for them; with KVFLEET_E2E=1 that is
an error too. Anything else (the docker SDK missing, the image not building, the stack not coming
up or not getting healthy) is an error, never a skip.

Settings (environment):
  KVFLEET_IMAGE        image tag to build and run (kvfleet:e2e)
  KVFLEET_BASE_IMAGE   the Dockerfile's BASE; default kvfleet-base:bookworm when that image
                       exists (docker/make_base_image.sh), else python:3.11-slim
  KVFLEET_E2E_MODEL    model the workers serve (smollm2-135m)
  KVFLEET_E2E_BUILD    0 = use the image as it is, do not build it (default 1)
  KVFLEET_E2E_LOGS     folder for the stack's logs, kept after teardown (out/e2e)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest

from kvfleet.local_cluster import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROJECT = "kvfleet-e2e"  # fixed, so a run killed before teardown is cleaned up by the next one
SERVICES = ("telemetry", "worker-0", "worker-1", "scheduler", "gateway")
HEALTHY_TIMEOUT_S = 420.0  # two workers load the GGUF at once on 2 cores: ~40 s seen, slack for CI


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: drives the docker-compose deployment (needs Docker)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave tests/e2e out of a plain `pytest` unless KVFLEET_E2E=1 or it was named explicitly."""
    if HERE not in collection_path.parents and collection_path != HERE:
        return None
    if os.environ.get("KVFLEET_E2E") == "1":
        return None
    for arg in config.args:
        named = Path(arg.split("::")[0]).resolve()
        if named == HERE or HERE in named.parents:
            return None
    return True


def _compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


@dataclass
class Stack:
    """A running compose project and how to reach it from the host."""

    client: Any  # docker.DockerClient
    env: dict[str, str]
    scheduler_address: str
    telemetry_address: str
    gateway_url: str
    model: str
    project: str = PROJECT
    files: tuple[str, ...] = ("docker-compose.yml",)  # compose files, relative to the repository
    trace_api_port: int = 0  # telemetry's HTTP port (Jaeger query API, trace UI, /api/scheduler)

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        files = [arg for f in self.files for arg in ("-f", str(REPO / f))]
        cmd = [*_compose_command(), "-p", self.project, *files, *args]
        return subprocess.run(cmd, cwd=REPO, env=self.env, check=check, timeout=timeout, capture_output=True, text=True)

    def container(self, service: str) -> Any:
        found = self.client.containers.list(
            all=True,
            filters={"label": [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]},
        )
        assert len(found) == 1, f"expected one container for {service}, found {[c.name for c in found]}"
        return found[0]

    def health(self, service: str) -> str:
        c = self.container(service)
        c.reload()
        state = c.attrs["State"]
        return state.get("Health", {}).get("Status", state["Status"])

    def wait_healthy(self, services: tuple[str, ...] = SERVICES, timeout_s: float = HEALTHY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = {s: self.health(s) for s in services}
            if all(v == "healthy" for v in states.values()):
                return
            bad = {s: v for s, v in states.items() if v in ("unhealthy", "exited", "dead")}
            if bad or time.monotonic() > deadline:
                raise AssertionError(f"stack not healthy: {states}\n{self.logs(tail=40)}")
            time.sleep(2)

    def logs(self, tail: int | None = None) -> str:
        args = ["logs", "--no-color"] + ([f"--tail={tail}"] if tail else [])
        out = self.compose(*args, check=False, timeout=60)
        return out.stdout + out.stderr


def _asked() -> bool:
    """Whether the run asked for these tests (`make test-compose` sets KVFLEET_E2E=1)."""
    return os.environ.get("KVFLEET_E2E") == "1"


def _docker_missing(why: str) -> NoReturn:
    """Docker itself is not available: a skip, unless the run asked for these tests."""
    message = f"Docker is not available here: {why}; `make test-compose` installs and starts it"
    if _asked():
        pytest.fail(message + " (KVFLEET_E2E=1: not skipped)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(autouse=True)
def _docker_tools() -> None:
    """Every test here drives docker-compose (or `docker compose`)."""
    if shutil.which("docker-compose") is None and shutil.which("docker") is None:
        _docker_missing("neither docker-compose nor the docker CLI is installed")


_ENGINE: list[str] = []  # why no engine answers ("" when one does), asked once per session


def _engine_unreachable() -> str:
    """Why no Docker engine answers (the docker CLI's own `docker version`), "" when one does."""
    if not _ENGINE:
        docker = shutil.which("docker")
        if docker is None:
            _ENGINE.append("the docker CLI is not installed")
        else:
            try:
                out = subprocess.run(
                    [docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True, timeout=60
                )
                why = "" if out.returncode == 0 else f"no Docker engine answers ({out.stderr.strip()[-300:]})"
            except subprocess.TimeoutExpired:
                why = "no Docker engine answered `docker version` within 60 s"
            _ENGINE.append(why)
    return _ENGINE[0]


def docker_client() -> Any:
    """The docker SDK's client of the engine. Only an engine that is not there skips (see
    _docker_missing); with one there, any failure here is the test's error."""
    why = _engine_unreachable()
    if why:
        _docker_missing(why)
    try:
        import docker
    except ImportError:
        pytest.fail("the docker SDK is not installed in this environment: pip install docker", pytrace=False)
    if not hasattr(docker, "from_env"):  # the repository's docker/ folder, imported as a namespace package
        pytest.fail("the docker SDK is not installed in this environment: pip install docker", pytrace=False)
    client = docker.from_env()
    client.ping()
    return client


def base_image(client: Any) -> str:
    base = os.environ.get("KVFLEET_BASE_IMAGE")
    if base:
        return base
    import docker.errors

    try:
        client.images.get("kvfleet-base:bookworm")
        return "kvfleet-base:bookworm"
    except docker.errors.ImageNotFound:
        return "python:3.11-slim"


def _image_id(client: Any, tag: str) -> str | None:
    import docker.errors

    try:
        return client.images.get(tag).id
    except docker.errors.ImageNotFound:
        return None


def replace_image(client: Any, tag: str, build: Callable[[], None]) -> None:
    """Build ``tag`` anew with ``build``, then remove the image the tag named before, so that
    repeated `make test-compose` runs of a changed checkout do not each leave an untagged image
    behind (three such held 1.35 GB here). One still in use (a container of an old stack) or
    tagged elsewhere is kept."""
    import docker.errors

    before = _image_id(client, tag)
    build()
    if before is None or before == _image_id(client, tag):
        return
    try:
        if client.images.get(before).tags:  # named by another tag too (docker would untag it): keep it
            return
        client.images.remove(before)
    except docker.errors.APIError as e:  # ImageNotFound included
        print(f"kept the image {tag} named before ({before[:19]}): {e.explanation or e}")


def _build_image(client: Any, tag: str, base: str, log_dir: Path) -> None:
    """Build docker/Dockerfile through the SDK; layers are cached, so a rebuild takes seconds."""
    replace_image(client, tag, lambda: _build_dockerfile(client, tag, base, log_dir))


def _build_dockerfile(client: Any, tag: str, base: str, log_dir: Path) -> None:
    lines: list[str] = []
    started = time.monotonic()
    # network_mode=host: on machines whose only way out is the host's (PyPI at build time).
    for chunk in client.api.build(
        path=str(REPO),
        dockerfile="docker/Dockerfile",
        tag=tag,
        buildargs={"BASE": base},
        network_mode="host",
        rm=True,
        forcerm=True,
        decode=True,
    ):
        if "stream" in chunk:
            lines.append(chunk["stream"].rstrip("\n"))
        if "error" in chunk:
            (log_dir / "build.log").write_text("\n".join(lines) + "\n" + chunk["error"])
            raise AssertionError(f"image build failed: {chunk['error']}\n" + "\n".join(lines[-40:]))
    (log_dir / "build.log").write_text("\n".join(lines) + "\n")
    print(f"built {tag} on {base} in {time.monotonic() - started:.0f} s")


def logs_dir() -> Path:
    """Where the stacks' and the build's logs are kept (KVFLEET_E2E_LOGS)."""
    log_dir = Path(os.environ.get("KVFLEET_E2E_LOGS", REPO / "out" / "e2e"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def built_image() -> tuple[Any, str, str]:
    """(docker client, image tag, base image): the image built once per test session."""
    client = docker_client()
    image = os.environ.get("KVFLEET_IMAGE", "kvfleet:e2e")
    base = base_image(client)
    if os.environ.get("KVFLEET_E2E_BUILD", "1") != "0" and image not in _BUILT:
        _build_image(client, image, base, logs_dir())
        _BUILT.add(image)
    return client, image, base


@contextlib.contextmanager
def run_stack(
    project: str,
    files: tuple[str, ...] = ("docker-compose.yml",),
    extra_env: dict[str, str] | None = None,
    model: str | None = None,
) -> Iterator[Stack]:
    """Build the image (once per test session), bring a compose project up on free host ports,
    wait until every service is healthy, yield it; always tear it down and keep its logs."""
    client, image, base = built_image()
    log_dir = logs_dir()
    model = model or os.environ.get("KVFLEET_E2E_MODEL", "smollm2-135m")
    sched_port, tel_port, gw_port, trace_port = free_port(), free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "KVFLEET_IMAGE": image,
        "KVFLEET_BASE_IMAGE": base,
        "KVFLEET_MODEL": model,
        "KVFLEET_PUBLISH_SCHEDULER": str(sched_port),
        "KVFLEET_PUBLISH_TELEMETRY": str(tel_port),
        "KVFLEET_PUBLISH_GATEWAY": str(gw_port),
        "KVFLEET_PUBLISH_TRACE_API": str(trace_port),
        **(extra_env or {}),
    }
    s = Stack(
        client,
        env,
        f"127.0.0.1:{sched_port}",
        f"127.0.0.1:{tel_port}",
        f"http://127.0.0.1:{gw_port}",
        model,
        project,
        files,
        trace_port,
    )
    s.compose("down", "-v", "--remove-orphans", check=False, timeout=120)  # leftovers of a killed run
    try:
        up = s.compose("up", "-d", "--no-build", check=False, timeout=HEALTHY_TIMEOUT_S + 60)
        if up.returncode != 0:
            raise AssertionError(f"docker-compose up failed ({up.returncode}):\n{up.stderr}\n{s.logs(tail=60)}")
        s.wait_healthy()
        yield s
    finally:
        (log_dir / f"{project}.log").write_text(s.logs())
        down = s.compose("down", "-v", "--remove-orphans", "-t", "20", check=False, timeout=180)
        if down.returncode != 0:
            print(f"docker-compose down failed: {down.stderr}")


_BUILT: set[str] = set()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """The default stack (docker-compose.yml alone, the real model)."""
    with run_stack(PROJECT) as s:
        yield s
