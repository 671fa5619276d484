"""A worker's resident memory against issue 25's bound (weights in their serving format + KV
pool + ``RSS_HEADROOM_BYTES``), held on the memory the worker alone holds (its RSS less the
libraries' shared file pages; both are shown), read over gRPC: from a running worker, or from one worker
process started per mode. ``python -m bench.memory`` prints and writes the table."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO

import grpc

from kvfleet.local_cluster import free_port
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from worker_svc.memory import RSS_HEADROOM_BYTES

# A mode's worker flags (the weights' serving format).
MODES = {
    "float32": ("--quant", "none"),
    "bfloat16": ("--dtype", "bfloat16"),
    "int8": ("--quant", "int8"),
    "gguf": ("--quant", "gguf"),
}


@dataclass(frozen=True)
class IdleMemory:
    worker: str
    weight_bytes: int
    kv_pool_bytes: int
    rss_bytes: int
    # Of the RSS, what the worker alone holds (its heap and anonymous memory): the bound is held
    # on this. The rest is the libraries' file pages, shared and droppable, and their count moves
    # with the page cache (worker_svc/memory.py).
    private_bytes: int = 0
    start_line: str = ""  # the worker's "... serving ..." log line (its device, formats, kernels, KV)

    @property
    def bound_bytes(self) -> int:
        return self.weight_bytes + self.kv_pool_bytes + RSS_HEADROOM_BYTES

    @property
    def within(self) -> bool:
        return 0 < self.private_bytes <= self.bound_bytes

    def row(self) -> dict:
        return {**asdict(self), "bound_bytes": self.bound_bytes, "within_bound": self.within}


def worker_memory(address: str, name: str = "", timeout: float = 10.0) -> IdleMemory:
    """The worker's memory now (GetInfo's weights and pool, GetStats' RSS)."""
    with grpc.insecure_channel(address) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        info = stub.GetInfo(wpb.GetInfoRequest(), timeout=timeout)
        stats = stub.GetStats(wpb.GetStatsRequest(), timeout=timeout)
    pool = info.kv_bytes_per_token * info.kv_capacity_tokens
    return IdleMemory(name or info.worker_id, info.weight_bytes, pool, stats.rss_bytes, stats.private_bytes)


def idle_memory(
    model: str, modes: list[str], num_blocks: int, timeout_s: float = 300.0, settle_s: float = 1.0
) -> dict[str, IdleMemory]:
    """Start ``python -m worker_svc`` once per mode (keys of MODES), all at once (each reads
    its own RSS; the loads share the cores), wait for each to serve, let them settle at idle
    (settle_s, once all serve), read their memory, stop them. RuntimeError with the log of one
    that does not start."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes must be among {sorted(MODES)}, got {bad}")
    with contextlib.ExitStack() as stack:
        started = {}
        for mode in modes:
            port, log = free_port(), stack.enter_context(tempfile.TemporaryFile())
            args = ["--model", model, "--port", str(port), "--metrics-port", "0", "--num-blocks", str(num_blocks)]
            cmd = [sys.executable, "-m", "worker_svc", *args, *MODES[mode]]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_stop, proc)
            started[mode] = (proc, f"127.0.0.1:{port}", log)
        deadline = time.monotonic() + timeout_s
        for mode, (proc, address, log) in started.items():
            _wait_serving(proc, address, log, deadline, mode)
        time.sleep(settle_s)  # all serving: each settles at idle meanwhile
        return {
            mode: replace(worker_memory(address, name=mode), start_line=_start_line(log))
            for mode, (_, address, log) in started.items()
        }


def _start_line(log: IO[bytes]) -> str:
    """The worker's start line, logged before its server answers anything. Read with pread: the
    worker writes through the same open file, whose offset a seek here would move."""
    fd = log.fileno()
    text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
    lines = [line for line in text.splitlines() if " serving " in line]
    return lines[-1] if lines else ""


def _wait_serving(proc: subprocess.Popen, address: str, log: IO[bytes], deadline: float, mode: str) -> None:
    while True:
        try:
            worker_memory(address, timeout=2.0)  # it answers: the load is over
            return
        except grpc.RpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"worker ({mode}) did not start:\n{log.read().decode()[-2000:]}") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of: " + ", ".join(MODES))
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks per worker (0 = the worker's default pool)")
    p.add_argument("--out", type=Path, help="write the rows here as JSON")
    a = p.parse_args(argv)
    rows = []
    print(
        "| mode | weights | KV pool | RSS at idle | of which its own | bound | within |\n|---|---|---|---|---|---|---|"
    )
    for m in idle_memory(a.model, [m.strip() for m in a.modes.split(",")], a.num_blocks).values():
        rows.append(m.row())
        print(
            f"| {m.worker} | {m.weight_bytes / 1e6:.0f} MB | {m.kv_pool_bytes / 1e6:.0f} MB | "
            f"{m.rss_bytes / 1e6:.0f} MB | {m.private_bytes / 1e6:.0f} MB | {m.bound_bytes / 1e6:.0f} MB | "
            f"{'yes' if m.within else 'NO'} |",
            flush=True,
        )
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "num_blocks": a.num_blocks, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
