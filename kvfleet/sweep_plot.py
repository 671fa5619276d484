"""The sweep's picture: tokens per tick, batch occupancy and peak KV against concurrency, drawn
from the sweep's JSON and written beside it (`sweep.json` -> `sweep.png` and `sweep.svg`)."""

from __future__ import annotations

from pathlib import Path

# Inches at DPI: the PNG is exactly WIDTH_IN * DPI by HEIGHT_IN * DPI pixels (no tight bbox,
# which would crop it to the drawing), the SVG WIDTH_IN * 72 by HEIGHT_IN * 72 points.
WIDTH_IN, HEIGHT_IN, DPI = 12.0, 4.0, 100


def figure_paths(json_path: str | Path) -> tuple[Path, Path]:
    p = Path(json_path)
    return p.with_suffix(".png"), p.with_suffix(".svg")


def _concurrency_axis(ax, xs: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (max running sessions)")
    ax.grid(True, alpha=0.3)


def plot_sweep(doc: dict, json_path: str | Path) -> tuple[Path, Path]:
    """Draw the sweep and write the PNG and SVG beside `json_path`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, whatever MPLBACKEND says
    import matplotlib.pyplot as plt

    sweep = doc["concurrency_sweep"]
    rows = sorted(sweep["results"], key=lambda r: r["concurrency"])
    xs = [r["concurrency"] for r in rows]
    fig, (tok, occ, kv) = plt.subplots(1, 3, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    tok.plot(xs, [r["tokens_per_tick"] for r in rows], "o-", color="tab:blue")
    sat = sweep.get("saturation_concurrency")
    if sat is not None:
        tok.axvline(sat, color="grey", ls="--", lw=1, label=f"saturation at {sat}")
        tok.legend(loc="lower right", fontsize="small")
    tok.set_ylabel("tokens per tick")
    tok.set_title("throughput")
    occ.plot(xs, [r["avg_batch_occupancy"] for r in rows], "o-", color="tab:green", label="average")
    occ.plot(xs, [r["max_batch_occupancy"] for r in rows], "s--", color="tab:olive", label="max")
    occ.plot(xs, xs, ":", color="grey", lw=1, label="= concurrency")
    occ.set_ylabel("sessions in the decode batch")
    occ.set_title("batch occupancy")
    occ.legend(fontsize="small")
    kv.plot(xs, [r["peak_kv_bytes"] / 1024 for r in rows], "o-", color="tab:red")
    kv.set_ylabel("peak KV (KiB)")
    kv.set_title("peak KV cache")
    for ax in (tok, occ, kv):
        _concurrency_axis(ax, xs)
        ax.set_ylim(bottom=0)
    model = doc.get("model", {}).get("name", "?")
    w = doc.get("workload", {})
    fig.suptitle(
        f"kvfleet sweep: model {model}, {w.get('sessions')} sessions, prompt {w.get('prompt_len')} "
        f"tokens, {w.get('max_new_tokens')} new, prefill budget {w.get('prefill_token_budget')}"
        f"  (corruption free: {sweep.get('corruption_free')})",
        fontsize="medium",
    )
    png, svg = figure_paths(json_path)
    fig.savefig(png, dpi=DPI)
    fig.savefig(svg)
    plt.close(fig)
    return png, svg
