"""The benchmark's picture: output throughput and client-side latency against concurrency, one
line per system (each cluster size, and the static-batching peer), from a run's results.json;
written beside it (`results.json` -> `results.png` and `results.svg`).

`python -m bench.plot [results.json]` redraws it from a saved run; given several runs (one per
engine mode: `--dtype`, `--quant`), `python -m bench.plot a.json b.json ...` draws them on one
figure, each system labelled with its run's mode, beside the first as `modes.png` / `modes.svg`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The PNG is exactly WIDTH_IN * DPI by HEIGHT_IN * DPI pixels; the SVG WIDTH_IN * 72 by HEIGHT_IN * 72 pt.
WIDTH_IN, HEIGHT_IN, DPI = 13.5, 4.5, 100
_MARKERS = "os^Dv<>p"


def figure_paths(json_path: str | Path) -> tuple[Path, Path]:
    p = Path(json_path)
    return p.with_suffix(".png"), p.with_suffix(".svg")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = sorted((r["concurrency"], r[key]) for r in rows if r.get(key) is not None)
    return [c for c, _ in pts], [v for _, v in pts]


def plot_results(doc: dict, json_path: str | Path) -> tuple[Path, Path]:
    """Draw a run's results and write the PNG and SVG beside `json_path`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, list[dict]] = doc.get("results", {})
    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    concurrencies: set[int] = set()
    for i, (system, rows) in enumerate(sorted(results.items())):
        style = {"marker": _MARKERS[i % len(_MARKERS)], "color": f"C{i}"}
        xs, ys = _series(rows, "output_tokens_per_s")
        concurrencies.update(xs)
        tput.plot(xs, ys, "-", label=system, **style)
        for ax, key in ((ttft, "ttft_ms"), (itl, "itl_ms")):
            for pct, ls in (("p50", "-"), ("p99", ":")):
                xs, ys = _series(rows, f"{key}_{pct}")
                if xs:  # the peer runs static batches: no per-token latencies
                    ax.plot(xs, ys, ls, label=f"{system} {pct}", **style)
    tput.set_title("output throughput")
    tput.set_ylabel("output tokens / s")
    ttft.set_title("time to first token")
    ttft.set_ylabel("ms (client side)")
    itl.set_title("inter-token latency")
    itl.set_ylabel("ms (client side)")
    xs = sorted(concurrencies)
    for ax in (tput, ttft, itl):
        if xs:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="x-small")
    cfg, machine = doc.get("config", {}), doc.get("machine", {})
    modes = cfg.get("modes", [])
    what = f"modes {' / '.join(modes)}" if len(modes) > 1 else str(cfg.get("dtype"))
    fig.suptitle(
        f"kvfleet bench: {cfg.get('model')} {what} on {machine.get('device')} "
        f"({machine.get('cores')} cores), kv_views {cfg.get('kv_views')}, "
        f"prefill budget {cfg.get('prefill_token_budget')}",
        fontsize="medium",
    )
    png, svg = figure_paths(json_path)
    fig.savefig(png, dpi=DPI)
    fig.savefig(svg)
    plt.close(fig)
    return png, svg


def mode_of(doc: dict) -> str:
    cfg = doc.get("config", {})
    quant = cfg.get("quant", "none")
    return str(cfg.get("dtype", "float32")) + ("" if quant in (None, "", "none") else f"+{quant}")


def merge_runs(docs: list[dict]) -> dict:
    """Several runs as one document: each system named with its run's mode (the peer too)."""
    merged: dict = {"config": dict(docs[0].get("config", {})), "machine": docs[0].get("machine", {}), "results": {}}
    merged["config"]["dtype"] = " / ".join(mode_of(d) for d in docs)
    for doc in docs:
        for system, rows in doc.get("results", {}).items():
            merged["results"][f"{system} {mode_of(doc)}"] = rows
    return merged


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or [Path(__file__).with_name("results.json")]
    docs = [json.loads(p.read_text()) for p in paths]
    if len(docs) == 1:
        png, svg = plot_results(docs[0], paths[0])
    else:
        png, svg = plot_results(merge_runs(docs), paths[0].with_name("modes.json"))
    print(f"wrote {png} and {svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
