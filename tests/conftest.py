"""Session-wide fixtures: the real model, its tokenizer, the transformers reference and one
in-process SmolLM2 cluster, each built once per test run and shared by every module.

Oracles (the transformers model, the loaded weights) are never modified by a test: a test that
needs a variant builds its own copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from kvfleet_models.config import LlamaConfig
from tests.helpers.models import SMOLLM2, require_smollm2

_CACHE_KEY = pytest.StashKey[str]()

# Under pytest-xdist (`make test` runs three test processes) each process, and the servers it
# starts, gets one core's share of OpenMP threads: two processes of two threads each on two cores
# leave OpenMP's threads spinning for descheduled peers (a gateway test went 4 -> 37 s). Tests
# of the multi-threaded paths set their threads themselves.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")


def pytest_configure(config: pytest.Config) -> None:
    """A checkout without the package's build of the C libraries compiles them on first use
    (worker_svc/model/native.py): in these tests, and the servers they start, into a folder of
    this run's, never the user's cache (~/.cache/kvfleet)."""
    folder = tempfile.mkdtemp(prefix="kvfleet-test-cache-")
    config.stash[_CACHE_KEY] = folder
    os.environ["KVFLEET_CACHE_DIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_KEY, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The test with torch's intra-op pool at 2 threads. The C kernels share that pool and split
    their rows among its threads: a kernel test uses this so that the split is tested whatever
    the process's OMP_NUM_THREADS (1 under `make test`, see above; 1 on a 1-core machine)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def smollm2_model() -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """SmolLM2-135M's config and float32 weights (the engine copies what it keeps)."""
    require_smollm2()
    from kvfleet_models.registry import load_model

    return load_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer():  # type: ignore[no-untyped-def]
    require_smollm2()
    from kvfleet_models.tokenizer import Tokenizer

    return Tokenizer.for_model(SMOLLM2)


@pytest.fixture(scope="session")
def hf_smollm2():  # type: ignore[no-untyped-def]
    """transformers' own SmolLM2 from the same GGUF, float32, eval: the reference (built by
    transformers once per environment, tests/helpers/hf_reference.py)."""
    from tests.helpers.hf_reference import hf_reference

    return hf_reference(require_smollm2())


@pytest.fixture(scope="session")
def smollm2_cluster(smollm2_model) -> Iterator:  # type: ignore[no-untyped-def]
    """Two SmolLM2 workers and a scheduler on loopback ports, in this process (one load)."""
    from tests.integration.inproc import InProcessCluster

    with InProcessCluster(workers=2, model=SMOLLM2, num_blocks=256, loaded_model=smollm2_model) as c:
        yield c


@pytest.fixture(scope="session")
def smollm2_services() -> Iterator:  # type: ignore[no-untyped-def]
    """A SmolLM2 cluster as processes (scheduler, one worker, telemetry) and an HTTP gateway in
    front of it exporting its spans there: what the gateway's test modules share (one start)."""
    require_smollm2()
    from kvfleet.local_cluster import ClusterSpec, LocalCluster
    from tests.helpers.gateway import GatewayProcess

    # 256 blocks (4096 tokens, ~190 MB of KV) rather than the worker's default 4096 (~3 GB): more
    # than the scheduler's KV budget lets it use, and a loaded machine keeps its memory.
    with LocalCluster(ClusterSpec(workers=1, model=SMOLLM2, num_blocks=256)) as cluster:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{cluster.telemetry_address}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        gateway = GatewayProcess(cluster.scheduler_address, cluster.log_dir, env=env)
        try:
            yield cluster, gateway
        finally:
            gateway.stop()


SMOLLM2_FIXTURES = {"smollm2_model", "smollm2_tokenizer", "hf_smollm2", "smollm2_cluster", "smollm2_services"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the real model through these fixtures is `slow` (`-m "not slow"`
    runs the rest in a few minutes), whether or not its module says so."""
    for item in items:
        if SMOLLM2_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
