"""Ratios, targets and the printed table of a benchmark run (all from the run's own figures)."""

from __future__ import annotations

TARGETS = {
    "batch1_decode_vs_bandwidth_bound": 0.70,
    "cluster_vs_llamacpp_at_1": 1.0,  # output tok/s at c=1 (batch-1 decode), same sessions
    "cluster_vs_peer_at_32": 4.0,
    "cluster_vs_llamacpp_at_32": 1.0,
    "scheduler_rpc_share_at_32": 0.05,
    "tiny_sweep_ticks_per_s": 500.0,
}
PEERS = ("peer", "llama.cpp")  # the systems the cluster is measured against


def _by_conc(rows: list[dict]) -> dict[int, dict]:
    return {r["concurrency"]: r for r in rows}


def ratios(doc: dict, breakdown_concurrency: int = 32) -> dict:
    out: dict = {}
    results = doc.get("results", {})
    peer = _by_conc(results.get("peer", []))
    llama = _by_conc(results.get("llama.cpp", []))
    for name, rows in results.items():
        if name in PEERS:
            continue
        for c, row in _by_conc(rows).items():
            if c in peer and peer[c]["output_tokens_per_s"]:
                out[f"{name}_vs_peer_c{c}"] = round(row["output_tokens_per_s"] / peer[c]["output_tokens_per_s"], 3)
            if c in llama and llama[c]["output_tokens_per_s"]:
                out[f"{name}_vs_llamacpp_c{c}"] = round(row["output_tokens_per_s"] / llama[c]["output_tokens_per_s"], 3)
            if c == breakdown_concurrency and "scheduler_rpc_share" in row.get("tick_breakdown", {}):
                out[f"{name}_scheduler_rpc_share_c{c}"] = row["tick_breakdown"]["scheduler_rpc_share"]
    bound = doc.get("limits", {}).get("batch1_decode_bound_tok_s")
    if bound:
        one = _by_conc(results.get("cluster-1w", [])).get(1)
        if one and one.get("itl_ms_p50"):
            out["cluster_batch1_decode_tok_s"] = round(1000.0 / one["itl_ms_p50"], 2)
            out["cluster_batch1_decode_vs_bound"] = round(out["cluster_batch1_decode_tok_s"] / bound, 3)
        if "engine_batch1" in doc:
            out["engine_batch1_decode_vs_bound"] = round(doc["engine_batch1"]["best_tok_s"] / bound, 3)
    if "tiny_sweep" in doc:
        out["tiny_sweep_ticks_per_s"] = doc["tiny_sweep"]["ticks_per_s_median"]
    return out


def targets(doc: dict) -> dict:
    r = doc.get("ratios", {})

    def best(prefix: str, suffix: str, low: bool = False) -> float | None:
        vals = [v for k, v in r.items() if k.startswith(prefix) and k.endswith(suffix)]
        return (min(vals) if low else max(vals)) if vals else None

    got = {
        "batch1_decode_vs_bandwidth_bound": r.get("cluster_batch1_decode_vs_bound"),
        "cluster_vs_llamacpp_at_1": best("cluster-", "_vs_llamacpp_c1"),
        "cluster_vs_peer_at_32": best("cluster-", "_vs_peer_c32"),
        "cluster_vs_llamacpp_at_32": best("cluster-", "_vs_llamacpp_c32"),
        "scheduler_rpc_share_at_32": best("cluster-", "_scheduler_rpc_share_c32", low=True),
        "tiny_sweep_ticks_per_s": r.get("tiny_sweep_ticks_per_s"),
    }
    out = {}
    for name, goal in TARGETS.items():
        value = got[name]
        lower_is_better = name == "scheduler_rpc_share_at_32"
        met = None if value is None else (value <= goal if lower_is_better else value >= goal)
        out[name] = {"value": value, "target": goal, "met": met, "direction": "<=" if lower_is_better else ">="}
    return out


def _fmt(v: object, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _grid(heads: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return lines


def table(doc: dict) -> str:
    cfg = doc["config"]
    threads = {k: v["worker_threads"] for k, v in doc.get("clusters", {}).items()}
    lines = [
        f"== kvfleet benchmark: {cfg['model']} {cfg['dtype']} on {doc['machine']['device']} "
        f"({doc['machine']['cores']} cores), kv_views {cfg['kv_views']}, "
        f"prefill budget {cfg['prefill_token_budget']}, sessions per concurrency {cfg['sessions']}, "
        f"threads per worker {threads}, peer threads {doc.get('peer_threads', {}).get('threads')}"
        + (
            f", llama.cpp {doc['llamacpp']['version']} on {doc['llamacpp']['threads']} threads"
            if "llamacpp" in doc
            else ""
        )
        + (f", quant {cfg['quant']}" if cfg.get("quant", "none") != "none" else "")
    ]
    lim = doc.get("limits")
    if lim:
        lines.append(
            f"limits: bandwidth {lim['bandwidth_gbs']['best']:.1f} GB/s "
            f"(by threads {lim['bandwidth_gbs']['by_threads']}), "
            f"sgemm {lim['matmul_gflops']['best']:.0f} GFLOP/s; "
            f"{lim['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token -> "
            f"batch-1 bound {lim['batch1_decode_bound_tok_s']:.1f} tok/s, "
            f"compute bound {lim['compute_bound_tok_s']:.0f} tok/s"
        )
    for name, c in doc.get("clusters", {}).items():
        for m in c.get("idle_memory", []):  # bench.memory's rows: issue 25's bound
            headroom = m["bound_bytes"] - m["weight_bytes"] - m["kv_pool_bytes"]
            lines.append(
                f"{name} {m['worker']} at idle: RSS {m['rss_bytes'] / 1e6:.0f} MB, bound {m['bound_bytes'] / 1e6:.0f} MB "
                f"(weights {m['weight_bytes'] / 1e6:.0f} + KV pool {m['kv_pool_bytes'] / 1e6:.0f} + {headroom / 1e6:.0f})"
                + ("" if m["within_bound"] else " OVER")
            )
    eng = doc.get("engine_batch1")
    if eng:
        lines.append(
            f"engine alone, batch-1 decode: {eng['tok_s_by_threads']} tok/s by threads; "
            f"{eng['prompt_len']}-token prefill: {eng.get('prefill_tok_s_by_threads', {})} tok/s"
        )
    rows = []
    ratios_ = doc.get("ratios", {})
    for name, res in doc.get("results", {}).items():
        for r in res:
            c = r["concurrency"]
            rows.append(
                [
                    name,
                    str(c),
                    str(r["sessions"]),
                    _fmt(r["output_tokens_per_s"]),
                    _fmt(r.get("ttft_ms_p50"), 0),
                    _fmt(r.get("ttft_ms_p99"), 0),
                    _fmt(r.get("itl_ms_p50")),
                    _fmt(r.get("itl_ms_p99")),
                    _fmt(r["wall_s"]),
                    _fmt(ratios_.get(f"{name}_vs_peer_c{c}"), 2) if name != "peer" else "1.00",
                    _fmt(ratios_.get(f"{name}_vs_llamacpp_c{c}"), 2) if name != "llama.cpp" else "1.00",
                ]
            )
    rows.sort(key=lambda r: (int(r[1]), r[0]))
    lines.append("")
    lines += _grid(
        [
            "system",
            "conc",
            "sessions",
            "out tok/s",
            "ttft p50",
            "ttft p99",
            "itl p50",
            "itl p99",
            "wall s",
            "vs peer",
            "vs llama.cpp",
        ],
        rows,
    )
    lines.append(
        "(latencies in ms, client-side; the peer's tok/s counts useful tokens only; "
        "llama.cpp runs the GGUF's own quantized weights)"
    )
    for name, res in doc.get("results", {}).items():
        for r in res:
            b = r.get("tick_breakdown")
            if b and "tick_period_ms" in b:
                lines.append(
                    f"{name} c={r['concurrency']} per tick ({b['ticks']} ticks): period "
                    f"{b['tick_period_ms']:.1f} ms = worker step {b['worker_step_ms']:.1f} "
                    f"(attention {b['attention_ms']:.1f}, kv views {b['kv_view_prepare_ms']:.1f}, "
                    f"kv write {b['kv_write_ms']:.1f}, sampling {b['sampling_ms']:.1f}, "
                    f"other {b['step_other_ms']:.1f}) + scheduler/RPC {b['scheduler_rpc_ms']:.1f} "
                    f"({100 * b['scheduler_rpc_share']:.1f} %: {b['rpc_in_tick_ms']:.1f} in the tick "
                    f"span, {b['between_ticks_ms']:.1f} between ticks)"
                )
    sweep = doc.get("tiny_sweep")
    if sweep:
        lines.append(
            f"tiny sweep: {sweep['ticks_per_s_median']:.0f} ticks/s median "
            f"(best {sweep['ticks_per_s_best']:.0f}, {sweep['ticks_per_sweep']} ticks per sweep, "
            f"{sweep['repeats']} repeats)"
        )
    lines.append("")
    lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in ratios_.items()))
    for name, t in doc.get("targets", {}).items():
        mark = {True: "MET", False: "not met", None: "not measured"}[t["met"]]
        lines.append(f"target {name}: {_fmt(t['value'], 3)} (want {t['direction']} {t['target']}) {mark}")
    return "\n".join(lines)
