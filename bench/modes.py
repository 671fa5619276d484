"""Decode step time per engine mode (float32, bfloat16, int8, gguf), measured A/B in one process.

    .venv/bin/python -m bench.modes                       # smollm2, batch 1 and 32, 2 threads
    .venv/bin/python -m bench.modes --modes float32,int8 --batches 1 --repeats 9 --threads 1
    .venv/bin/python -m bench.modes --modes float32,int8,gguf --batches 1,32   # the GGUF's own blocks
    .venv/bin/python -m bench.modes --device cuda --modes float32,bfloat16,float16   # bench/gpu_check.sh

Each mode gets its own engine with the same sessions (``--context`` tokens of seeded prompt
each, prefilled once). A round times ``--steps`` decode steps of every mode in turn, for each
batch size; rounds repeat ``--repeats`` times, so that the other tenants of a shared machine
hit every mode alike. Per mode and batch: the median step over all rounds, and the median of
the per-round ratios to the first mode; per mode, a ``--prefill``-token prompt's prefill time
(one per round). The 1-minute load average is printed with each round.
Nothing is asserted: this prints figures to quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import numpy as np

from bench.bench_modes import KV_VIEWS, KV_VIEWS_DEFAULT
from kvfleet_models.registry import load_model, load_model_blocks
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps

MODES: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "float16": {"dtype": "float16"},  # GPUs
    "int8": {"quant": "int8"},  # CPU only
    "gguf": {"quant": "gguf"},  # CPU only, a GGUF model: its own blocks (load_model_blocks)
    # The same modes with torch's ops in place of the fused C ones (worker_svc/model/fused.py).
    "float32-torchops": {"fused_ops": False},
    "bfloat16-torchops": {"dtype": "bfloat16", "fused_ops": False},
    "int8-torchops": {"quant": "int8", "fused_ops": False},
}
GREEDY = SamplingSpec()


class Sessions:
    """``batch`` decoding sessions on one engine, through its driver (which keeps the block
    tables of all its sessions); each ``step`` decodes all of them once."""

    def __init__(self, driver: LocalSteps, batch: int, context: int, tag: str) -> None:
        rng = np.random.default_rng(batch)
        self.driver, self.ids = driver, [f"{tag}-{batch}-{i}" for i in range(batch)]
        self.tokens, self.positions = [], []
        for sid in self.ids:
            prompt = tuple(int(t) for t in rng.integers(100, 10000, context))
            out = driver.step([PrefillItem(sid, prompt, 0, True, GREEDY)], [])
            token = out.results[0].token_id
            assert token is not None
            self.tokens.append(token)
            self.positions.append(context)

    def step(self) -> float:
        decode = [DecodeItem(s, t, p, GREEDY, 1) for s, t, p in zip(self.ids, self.tokens, self.positions)]
        t0 = time.perf_counter()
        out = self.driver.step([], decode)
        dt = time.perf_counter() - t0
        self.tokens = [r.token_id if r.token_id is not None else 0 for r in out.results]
        self.positions = [p + 1 for p in self.positions]
        return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="float32,bfloat16,int8", help=f"of {sorted(MODES)}")
    p.add_argument("--device", default="cpu", help="cpu | cuda | xpu (int8 runs on the CPU only)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128, help="prompt tokens per session")
    p.add_argument("--steps", type=int, default=6, help="decode steps per mode per round")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--kv-views", default=KV_VIEWS_DEFAULT, choices=KV_VIEWS, help="the engines' KV views (default: the workers')"
    )
    p.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill timed")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="give every layer a sliding window of this many keys (a Mistral-style config on these weights)",
    )
    a = p.parse_args(argv)
    modes, batches = a.modes.split(","), [int(b) for b in a.batches.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    cfg, weights = load_model(a.model)
    if a.sliding_window:
        cfg = dataclasses.replace(cfg, sliding_window=a.sliding_window)
    # gguf mode: the same file's weights kept in their blocks (a second load, ~100 MB)
    blocks_weights = load_model_blocks(a.model)[1] if any(MODES[m].get("quant") == "gguf" for m in modes) else {}
    blocks = (sum(batches) * (a.context + (a.steps + 1) * a.repeats + 16) + a.prefill) // 16 + 8
    drivers, sessions = {}, {}
    for m in modes:
        t0 = time.perf_counter()
        engine = Engine(
            cfg,
            blocks_weights if MODES[m].get("quant") == "gguf" else weights,
            EngineConfig(num_blocks=blocks, kv_views=a.kv_views, num_threads=a.threads, device=a.device, **MODES[m]),
        )
        engine.use_threads()
        # The block tables, kept as the scheduler would; no prefix cache, since every round
        # prefills the same prompt, which must be computed each time, not found cached.
        drivers[m] = LocalSteps(engine, prefix_caching=False)
        for b in batches:
            sessions[m, b] = Sessions(drivers[m], b, a.context, m)
        level = drivers[m].engine.model.kernel_level
        print(
            f"{m}: built and prefilled in {time.perf_counter() - t0:.1f} s, weights "
            f"{drivers[m].engine.weight_bytes / 1e6:.0f} MB" + (f", {level} kernels" if level else ""),
            flush=True,
        )
    times: dict[tuple[str, int], list[float]] = {k: [] for k in sessions}
    ratios: dict[tuple[str, int], list[float]] = {k: [] for k in sessions}
    prefill: dict[str, list[float]] = {m: [] for m in modes}
    prompt = tuple(int(t) for t in np.random.default_rng(7).integers(100, 10000, a.prefill))
    for r in range(a.repeats):
        load = os.getloadavg()[0]
        line = []
        for b in batches:
            medians = {}
            for m in modes:
                drivers[m].engine.use_threads()
                sessions[m, b].step()  # first step after a switch: warm-up
                steps = [sessions[m, b].step() for _ in range(a.steps)]
                times[m, b] += steps
                medians[m] = float(np.median(steps))
                ratios[m, b].append(medians[m] / medians[modes[0]])
            line.append(f"b{b} " + " ".join(f"{m} {v * 1e3:.1f}" for m, v in medians.items()))
        for m in modes:
            drivers[m].engine.use_threads()
            t0 = time.perf_counter()
            drivers[m].step([PrefillItem("prefill", prompt, 0, True, GREEDY)], [])
            prefill[m].append(time.perf_counter() - t0)
            drivers[m].release(["prefill"])
        print(f"round {r + 1} (load {load:.2f}): " + " | ".join(line) + " ms", flush=True)
    print(
        f"\nmedian decode step, {a.threads} threads, {a.context}-token contexts, "
        f"{a.repeats} rounds x {a.steps} steps (load now {os.getloadavg()[0]:.2f}):"
    )
    for b in batches:
        for m in modes:
            step = float(np.median(times[m, b]))
            print(
                f"  batch {b:>3}  {m:<9} {step * 1e3:7.1f} ms  {b / step:7.1f} tok/s  "
                f"x{float(np.median(ratios[m, b])):.2f} of {modes[0]}"
            )
    for m in modes:
        print(f"  prefill {a.prefill}  {m:<9} {a.prefill / float(np.median(prefill[m])):7.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
