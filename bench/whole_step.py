"""Whole steps against the per-op path: the worker's engine alone (``LocalSteps``, one thread),
decode steps of the tiny model and of wider synthetic ones of its shape, each arm on its own
engine with the same weights and steps, interleaved, best of a few rounds.

    python -m bench.whole_step [--widths 32,64,128] [--batches 1,8,64] [--steps 40] [--rounds 3]

A row per (width, batch): ms a decode step on each path (whole steps measured at every size,
past the worker's limit), their ratio (per-op / whole: above 1, whole steps are faster), and
which path the worker takes at that size (``LlamaModel.whole_step_fits``, under
``llama.WHOLE_STEP_MACS``). The greedy tokens of both arms are compared (they must agree).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence

from kvfleet_models.config import LlamaConfig, tiny_config
from kvfleet_models.tiny import tiny_weights
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemResult, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.model import llama

PROMPT = 16  # tokens of each session's prompt


def model_of_width(hidden: int) -> LlamaConfig:
    """The tiny model's shape (six layers, four heads, MLP twice the width) at ``hidden``."""
    base = tiny_config()
    return dataclasses.replace(base, hidden_size=hidden, intermediate_size=2 * hidden, head_dim=hidden // 4)


def _decode_ms(engine: Engine, batch: int, steps: int, rounds: int) -> tuple[float, list[int]]:
    """Best ms a decode step over ``rounds`` runs of ``steps`` steps of ``batch`` sessions,
    and the greedy tokens of the first round."""
    cfg, greedy = engine.cfg, SamplingSpec()
    local = LocalSteps(engine, prefix_caching=False)
    best, seen = float("inf"), []

    def tokens(results: Sequence[ItemResult]) -> list[int]:
        got = [x.token_id for x in results]
        if any(t is None for t in got):
            raise RuntimeError(f"a step failed: {[x.error for x in results if x.token_id is None]}")
        return [t for t in got if t is not None]

    for r in range(rounds):
        ids = [f"r{r}-{k}" for k in range(batch)]
        prompts = [tuple((7 * k + 3 * i + 1) % cfg.vocab_size for i in range(PROMPT)) for k in range(batch)]
        out = local.step([PrefillItem(s, p, 0, True, greedy) for s, p in zip(ids, prompts)], [])
        last = tokens(out.results)
        t0 = time.perf_counter()
        for i in range(steps):
            decode = [DecodeItem(s, last[k], PROMPT + i, greedy, i + 1) for k, s in enumerate(ids)]
            last = tokens(local.step([], decode).results)
            if r == 0:
                seen += last
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
        local.release(ids)
    return best, seen


@contextlib.contextmanager
def _any_size() -> Iterator[None]:
    """Whole steps at any size (``llama.WHOLE_STEP_MACS`` lifted), to measure past the limit."""
    limit = llama.WHOLE_STEP_MACS
    llama.WHOLE_STEP_MACS = 1 << 62
    try:
        yield
    finally:
        llama.WHOLE_STEP_MACS = limit


def compare(widths: Sequence[int], batches: Sequence[int], steps: int, rounds: int) -> list[dict]:
    rows = []
    for hidden in widths:
        cfg = model_of_width(hidden)
        weights = tiny_weights(cfg, seed=1)
        with _any_size():
            engines = {
                whole: Engine(cfg, weights, EngineConfig(num_blocks=4096, num_threads=1, whole_steps=whole))
                for whole in (True, False)
            }
        if engines[True].model.decode_stack is None:
            raise SystemExit(f"width {hidden}: no whole steps here (no C compiler to build them)")
        for batch in batches:
            ms, tokens = {}, {}
            for whole in (False, True):
                with _any_size():  # each arm on its own path at every size, past the worker's limit
                    ms[whole], tokens[whole] = _decode_ms(engines[whole], batch, steps, rounds)
            rows.append(
                {
                    "hidden": hidden,
                    "batch": batch,
                    "per_op_ms": round(ms[False], 3),
                    "whole_ms": round(ms[True], 3),
                    "per_op_over_whole": round(ms[False] / ms[True], 2),
                    "worker_takes": "whole" if engines[True].model.whole_step_fits(batch) else "per-op",  # its limit
                    "same_tokens": tokens[False] == tokens[True],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.whole_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="32,64,128", help="comma-separated hidden sizes (32: the tiny model)")
    p.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes")
    p.add_argument("--steps", type=int, default=40, help="decode steps a round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per arm; the best is shown")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = compare(
        [int(x) for x in args.widths.split(",")], [int(x) for x in args.batches.split(",")], args.steps, args.rounds
    )
    print("hidden | batch | per-op ms | whole ms | per-op / whole | the worker takes | same tokens")
    for r in rows:
        print(" | ".join(str(v) for v in r.values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
