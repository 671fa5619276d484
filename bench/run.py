"""`python -m bench`: the cluster against its static-batching peer and the machine's limits,
measured in one run on the same prompts, model, dtype and machine. See bench/README.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench import report
from bench.bench_modes import CPU_MODES, KV_VIEWS, KV_VIEWS_DEFAULT, QUICK_HELP, pick_modes
from bench.cluster import BenchCluster, ClusterOptions, default_worker_threads
from bench.plot import plot_results
from bench.workload import Session, WorkloadSpec, mixed_sessions
from kvfleet.progress import for_terminal

DEFAULT_OUT = Path(__file__).with_name("results.json")


def _prefixed(say: Callable[[str], object], prefix: str) -> Callable[[str], None]:
    def progress(message: str) -> None:
        say(prefix + message)

    return progress


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (cluster, peer and limits)")
    p.add_argument(
        "--modes",
        default=None,
        help=f"engine modes measured side by side, of {','.join(CPU_MODES)} (default: all of them on a "
        "CPU, float32 elsewhere; --dtype / --quant name one mode instead)",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="one mode's dtype")
    p.add_argument("--quant", default=None, choices=["none", "int8", "gguf"], help="one mode's --quant")
    p.add_argument("--quick", action="store_true", help="a short run: " + QUICK_HELP)
    p.add_argument("--concurrency", type=_ints, default=(1, 8, 32))
    p.add_argument(
        "--sessions",
        type=_ints,
        default=(6, 16, 64),
        help="sessions per concurrency, in the same order (default: six at c=1, whose rate is the "
        "batch-1 target's, and two static batches' worth at 8 and 32, so that a freed slot has a "
        "session to take)",
    )
    p.add_argument(
        "--workers", type=_ints, default=None, help="cluster sizes to measure (default 1,2 for one mode, 1 for several)"
    )
    p.add_argument(
        "--worker-threads", default="auto", help="intra-op threads per worker process (auto: see bench/README.md)"
    )
    p.add_argument(
        "--peer-threads", type=_ints, default=None, help="thread counts the peer is calibrated over (default 1..cores)"
    )
    p.add_argument(
        "--kv-views", default=KV_VIEWS_DEFAULT, choices=KV_VIEWS, help="the engines' KV views (default: the workers')"
    )
    p.add_argument("--prefill-budget", type=int, default=256, help="scheduler prefill tokens per tick")
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "float32", "float16"],
        help="workers' KV cache element type (auto: float16 for the reduced-precision CPU modes)",
    )
    p.add_argument("--breakdown-concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=_ints, default=(16, 256), help="LOW,HIGH")
    p.add_argument("--output-tokens", type=_ints, default=(16, 128), help="LOW,HIGH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-repeats", type=int, default=3)
    p.add_argument(
        "--skip", default="", help="comma list of parts to skip: limits,engine,cluster,peer,llamacpp,sweep,quality"
    )
    p.add_argument("--llamacpp-threads", type=int, default=0, help="llama.cpp's threads (0 = every core)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    a = p.parse_args(argv)
    if a.quick:
        a.sessions, a.sweep_repeats = tuple(min(c, n) for c, n in zip(a.concurrency, a.sessions)), 1
    if len(a.sessions) != len(a.concurrency):
        p.error("--sessions needs one count per --concurrency value")
    a.skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    try:
        a.modes = pick_modes(a.modes, a.dtype, a.quant, a.device)
    except ValueError as e:
        p.error(str(e))
    a.workers = a.workers or ((1, 2) if len(a.modes) == 1 else (1,))
    # The transformers peer: float32 ("the transformers float32 peer") unless one mode names a dtype.
    a.peer_dtype = a.modes[0].dtype if len(a.modes) == 1 else "float32"
    return a


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # The bar counts the measured runs: each system at each concurrency.
    from bench import llamacpp_peer

    llamacpp_missing = None if "llamacpp" in a.skip else llamacpp_peer.available()
    if llamacpp_missing:
        print(f"bench: skipping the llama.cpp peer: {llamacpp_missing}", file=sys.stderr)
        a.skip.add("llamacpp")
    systems = (
        (0 if "cluster" in a.skip else len(a.modes) * len(a.workers))  # a cluster per mode and worker count
        + (0 if "peer" in a.skip else 1)
        + (0 if "llamacpp" in a.skip else 1)
    )
    say = for_terminal("bench", total=len(a.concurrency) * systems or None)
    from kvfleet_models.registry import load_model

    cores = _cores()
    threads = tuple(range(1, cores + 1)) if cores <= 4 else (1, cores // 2, cores)
    device = torch.device(a.device)
    say(f"loading {a.model}")
    cfg, weights = load_model(a.model)
    spec = WorkloadSpec(prompt_tokens=tuple(a.prompt_tokens), output_tokens=tuple(a.output_tokens), seed=a.seed)
    workload = mixed_sessions(max(a.sessions), cfg.vocab_size, spec)
    doc: dict = {
        "schema_version": 1,
        "machine": {
            "cores": cores,
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": a.device,
            "processor": platform.processor(),
        },
        "config": {
            "model": a.model,
            "modes": [m.name for m in a.modes],
            "dtype": a.peer_dtype,  # the transformers peer's
            "quant": a.modes[0].quant if len(a.modes) == 1 else "none",
            "kv_views": a.kv_views,
            "prefill_token_budget": a.prefill_budget,
            "kv_dtype": a.kv_dtype,
            "seed": a.seed,
            "prompt_tokens": list(spec.prompt_tokens),
            "output_tokens": list(spec.output_tokens),
            "sessions": dict(zip(map(str, a.concurrency), a.sessions)),
        },
    }
    # The machine's CPU and the kernel level our int8 / gguf products run at (the quality table
    # gives each level's figures).
    if a.device == "cpu":
        from bench.quality import cpu_info

        doc["machine"]["cpu"] = cpu_info()
    if "limits" not in a.skip:
        from bench.roofline import decode_bounds, matmul_gflops, memory_bandwidth_gbs

        say("machine limits: bandwidth (gemv) and sgemm")
        bw = memory_bandwidth_gbs(device, threads)
        fl = matmul_gflops(device, threads)
        doc["limits"] = {
            "bandwidth_gbs": bw,
            "matmul_gflops": fl,
            **decode_bounds(cfg, 4, bw["best"], fl["best"]),  # float32's; each mode's: report.roofline
        }
    if "engine" not in a.skip:
        from bench.engine_probe import batch1_decode
        from kvfleet_models.registry import load_model_blocks

        doc["engine_batch1"] = {}
        for m in a.modes:
            say(f"engine alone, {m.name}: batch-1 decode at each thread count")
            w = load_model_blocks(a.model)[1] if m.quant == "gguf" else weights
            doc["engine_batch1"][m.name] = batch1_decode(cfg, w, a.device, m.dtype, a.kv_views, threads, quant=m.quant)
            del w
    del weights

    clusters: list[BenchCluster] = []
    peer = None
    llama: llamacpp_peer.LlamaCppPeer | None = None
    results: dict[str, list[dict]] = {}
    try:
        if "cluster" not in a.skip:
            warm = [Session(s.prompt[:16], 4) for s in workload[:4]]
            for m, w in [(m, w) for m in a.modes for w in a.workers]:
                n = (
                    int(a.worker_threads)
                    if a.worker_threads != "auto"
                    else default_worker_threads(a.device, w, cores, doc.get("engine_batch1", {}).get(m.name))
                )
                opts = ClusterOptions(
                    workers=w,
                    worker_threads=n,
                    model=a.model,
                    device=a.device,
                    dtype=m.dtype,
                    quant=m.quant,
                    mode=m.name if len(a.modes) > 1 else "",
                    kv_views=a.kv_views,
                    prefill_token_budget=a.prefill_budget,
                    kv_dtype=a.kv_dtype,
                    max_concurrency=max(a.concurrency),
                    max_session_tokens=spec.prompt_tokens[1] + spec.output_tokens[1],
                )
                say(f"starting {opts.name} ({n} intra-op thread(s) per worker)")
                c = BenchCluster(opts, say)
                clusters.append(c)
                c.start(warm)
                doc.setdefault("clusters", {})[opts.name] = {
                    "mode": m.name,
                    "workers": w,
                    "worker_threads": n,
                    "num_blocks": opts.num_blocks,
                    "log_dir": str(c.cluster.log_dir),
                    "idle_memory": c.idle_memory,
                    "worker_memory_idle": c.worker_memory(),  # after the warm-up, before any load
                }
        if "peer" not in a.skip:
            from bench.peer import load_peer, pick_threads

            say("loading the peer (transformers, same GGUF)")
            peer = load_peer(a.model, a.device, a.peer_dtype)
            doc["peer_threads"] = pick_threads(peer, workload, a.device, a.peer_threads or threads)
            say(f"peer threads: {doc['peer_threads']}")
        if "llamacpp" not in a.skip:
            from bench.peer import gguf_path

            n = a.llamacpp_threads or cores
            say(f"loading llama.cpp on the same GGUF ({n} threads)")
            llama = llamacpp_peer.LlamaCppPeer(
                gguf_path(a.model), n, max(a.concurrency), spec.prompt_tokens[1] + spec.output_tokens[1]
            )
            doc["llamacpp"] = {"threads": n, "version": llamacpp_peer.version()}
        # Interleaved by concurrency, so that each comparison is made minutes apart, not ten.
        for conc, n in zip(a.concurrency, a.sessions):
            sessions = workload[:n]
            for c in clusters:
                say(f"{c.options.name}: concurrency {conc}, {n} sessions")
                load = os.getloadavg()[0]
                row = c.run(sessions, conc, breakdown=conc == a.breakdown_concurrency)
                results.setdefault(c.options.name, []).append({**row, "loadavg_1m_before": load})
                say.advance(message=f"{c.options.name} c={conc}: {row['output_tokens_per_s']:.1f} tok/s")
            if peer is not None:
                from bench.peer import run_static

                say(f"peer: static batches of {conc}, {n} sessions")
                load = os.getloadavg()[0]
                row = run_static(peer, sessions, conc, a.device, progress=_prefixed(say, f"peer c={conc}: "))
                results.setdefault("peer", []).append({**row, "loadavg_1m_before": load})
                say.advance(message=f"peer c={conc}: {row['output_tokens_per_s']:.1f} tok/s")
            if llama is not None:
                say(f"llama.cpp: continuous batching of {conc}, {n} sessions")
                load = os.getloadavg()[0]
                run, _ = llama.run(sessions, conc, a.prefill_budget, progress=_prefixed(say, f"llama.cpp c={conc}: "))
                results.setdefault("llama.cpp", []).append({**run.row(), "loadavg_1m_before": load})
                say.advance(message=f"llama.cpp c={conc}: {run.tok_per_s:.1f} tok/s")
        for c in clusters:
            doc["clusters"][c.options.name]["worker_memory_after"] = c.worker_memory()
    finally:
        for c in clusters:
            c.stop()
        if llama is not None:
            llama.close()
    doc["results"] = results
    del peer

    if "sweep" not in a.skip:
        from bench.sweep_rate import sweep_ticks_per_s

        say("tiny-model sweep through a LocalCluster")
        doc["tiny_sweep"] = sweep_ticks_per_s(
            repeats=a.sweep_repeats, extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, progress=say
        )
    if "quality" not in a.skip and a.device == "cpu" and a.model == "smollm2-135m":
        from bench import quality
        from bench.peer import gguf_path
        from worker_svc.model.gguf_quant import runnable_levels

        # The whole text at every level takes ~10 minutes on 2 busy cores: the bench takes the
        # best level and, with --quick, a slice (python -m bench.quality runs all of it).
        tokens = quality.QUICK_TOKENS if a.quick else 0
        say(f"quality: teacher-forced, {tokens or 'all'} tokens, level {runnable_levels()[-1]} (int8: its best)")
        path = gguf_path(a.model)
        levels = runnable_levels()[-1:]
        bar = quality.progress_for(levels, True)
        doc["quality"] = quality.measure(path, path, levels, tokens, cores, True, bar)
        bar.close()
    doc["ratios"] = report.ratios(doc, breakdown_concurrency=a.breakdown_concurrency)
    doc["targets"] = report.targets(doc)
    doc["total_s"] = round(say.elapsed_s, 1)
    say.close()
    print(report.table(doc))
    if "quality" in doc:
        from bench.quality_table import table as quality_table

        print("\n" + quality_table(doc["quality"]))
    Path(a.out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    png, svg = plot_results(doc, a.out)
    print(f"wrote {a.out}, {png} and {svg}", file=sys.stderr)
    return 0
