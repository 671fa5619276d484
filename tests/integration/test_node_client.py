"""A client of another gRPC stack (grpc-js under node) against `kvfleet up`: its streams are
served token-exact, and survive a worker SIGKILLed under them."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvfleet.client import SchedulerClient
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.helpers.up import Up, wait_live

CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"
NODE = shutil.which("node")
GRPC_JS = CLIENT / "node_modules" / "@grpc" / "grpc-js"


def _missing() -> str:
    """Why the grpc-js client cannot run here ("" when it can). `make test` installs its packages
    (npm ci in tests/clients/node) wherever npm is, so there it runs."""
    if NODE is None:
        return "node is not installed (the grpc-js client needs it)"
    if not GRPC_JS.is_dir():
        return (
            f"the grpc-js client's packages are not installed ({GRPC_JS.relative_to(CLIENT.parents[2])} is missing): "
            "`make test` installs them with npm, or run `npm ci --prefix tests/clients/node`"
        )
    return ""


pytestmark = pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")


def _node_client(address: str, max_new: int, prompts: list[list[int]]) -> subprocess.Popen:
    assert NODE is not None
    return subprocess.Popen(
        [NODE, str(CLIENT / "stream.js"), address, str(max_new), *(",".join(map(str, p)) for p in prompts)],
        stdout=subprocess.PIPE,
    )


def _read_events(proc: subprocess.Popen, until, timeout_s: float) -> list[dict]:
    events, buf, end = [], b"", time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while not until(events):
        assert time.monotonic() < end, f"node client: no end within {timeout_s}s: {events[-3:]}"
        if sel.select(0.5):
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            events += [json.loads(line) for line in lines if line.strip()]
    return events


def test_grpc_js_streams_survive_a_worker_killed_under_kvfleet_up(tmp_path: Path):
    cfg = tiny_config()
    weights = tiny_weights(cfg, seed=0)
    prompts = [[i + 2, (i * 7) % 48, 5] for i in range(6)]
    new_tokens = 200
    solo = [reference_generate(cfg, weights, p, new_tokens) for p in prompts]
    # --pack-step-ms 0: the six streams spread over both workers (packed, all would be on worker-0).
    up = Up(["--model", "tiny", "--workers", "2", "--pack-step-ms", "0"], tmp_path / "up.err", start_timeout_s=60)
    try:
        proc = _node_client(up.scheduler, new_tokens, prompts)
        first = _read_events(proc, lambda evs: len({e["i"] for e in evs}) == len(prompts), 30)
        on_victim = {e["i"] for e in first if e.get("worker") == "worker-1"}
        assert on_victim, f"no stream on worker-1; nothing tested: {first}"
        os.kill(up.pids["worker-1"], signal.SIGKILL)
        events = first + _read_events(proc, lambda evs: False, 60)
        assert proc.wait(10) == 0, [e for e in events if "error" in e]
        for i, expected in enumerate(solo):
            got = [t for e in events if e["i"] == i for t in e["tokens"]]
            assert got == expected, f"stream {i} (on worker-1 at first: {i in on_victim})"
            assert [e["reason"] for e in events if e["i"] == i and e["finished"]] == ["FINISH_LENGTH"]
        with SchedulerClient(up.scheduler) as client:
            wait_live(client, "worker-1", 30)
    finally:
        code = up.stop()
    assert code == 0, up.stderr()
