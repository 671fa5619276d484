"""A self-contained HTML report of one experiment: inline SVG strip plots (every duration as a
dot, the interquartile box, the median and the p90), the comparison and gates tables, and the
decision. Pure: summary dict + durations in, HTML text out; no scripts, no external resources.
"""

from __future__ import annotations

from html import escape
from typing import Any, Sequence

import numpy as np

from telemetry_svc.model import Arm, ExperimentData

_W, _H, _PAD = 680, 120, 40
_MAX_DOTS = 1500  # per arm; more are thinned evenly (the box and ticks use every value)
_COLORS = {Arm.CONTROL: "#4c72b0", Arm.CANDIDATE: "#dd8452"}
_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:60em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.pass{color:#1a7f37}.fail{color:#cf222e}.na{color:#888}
.decision{padding:1em;border:2px solid #888;margin:1em 0}code{font-size:.9em}
"""


def _fmt_ns(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.0f} ns"


def strip_plot(title: str, control: Sequence[int], candidate: Sequence[int]) -> str:
    """SVG of both arms' durations on one linear axis."""
    both = np.asarray([*control, *candidate], dtype=np.float64)
    lo, hi = float(both.min()), float(both.max())
    span = hi - lo or 1.0

    def x(v: float) -> float:
        return _PAD + (v - lo) / span * (_W - 2 * _PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img">',
             f"<title>{escape(title)}</title>"]  # fmt: skip
    for lane, (arm, values) in enumerate(((Arm.CONTROL, control), (Arm.CANDIDATE, candidate))):
        a = np.asarray(values, dtype=np.float64)
        y0 = 25 + lane * 45
        color = _COLORS[arm]
        parts.append(f'<text x="2" y="{y0 + 4}" font-size="10">{arm.value[:4]}</text>')
        q1, med, q3, p90 = np.quantile(a, [0.25, 0.5, 0.75, 0.9])
        parts.append(f'<rect x="{x(q1):.1f}" y="{y0 - 12}" width="{max(x(q3) - x(q1), 1):.1f}" height="24" '
                     f'fill="none" stroke="{color}"/>')  # fmt: skip
        parts.append(f'<line x1="{x(med):.1f}" x2="{x(med):.1f}" y1="{y0 - 14}" y2="{y0 + 14}" '
                     f'stroke="{color}" stroke-width="2.5"/>')  # fmt: skip
        parts.append(f'<line x1="{x(p90):.1f}" x2="{x(p90):.1f}" y1="{y0 - 14}" y2="{y0 + 14}" '
                     f'stroke="{color}" stroke-dasharray="3,2"/>')  # fmt: skip
        step = max(1, a.size // _MAX_DOTS)
        for i, v in enumerate(a[::step]):
            jitter = ((i * 0.6180339887) % 1.0 - 0.5) * 18  # golden-ratio jitter: deterministic, even
            parts.append(f'<circle cx="{x(v):.1f}" cy="{y0 + jitter:.1f}" r="1.8" fill="{color}" fill-opacity=".35"/>')
    parts.append(f'<text x="{_PAD}" y="{_H - 4}" font-size="10">{_fmt_ns(lo)}</text>')
    parts.append(f'<text x="{_W - _PAD}" y="{_H - 4}" font-size="10" text-anchor="end">{_fmt_ns(hi)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    def cells(tag: str, row: Sequence[str]) -> str:
        return "".join(f"<{tag}{' class=l' if i < left else ''}>{c}</{tag}>" for i, c in enumerate(row))

    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return f"<table><tr>{cells('th', header)}</tr>{body}</table>"


def _verdict(passed: bool | None) -> str:
    if passed is None:
        return '<span class="na">not evaluated</span>'
    return '<span class="pass">pass</span>' if passed else '<span class="fail">fail</span>'


def build_report(summary: dict[str, Any], data: ExperimentData) -> str:
    exp = escape(str(summary["experiment_id"]))
    decision = summary["decision"]
    gates = _table(
        ["gate", "kind", "span", "verdict", "why"],
        [[escape(g["name"]), escape(g["kind"]), escape(g["span"]), _verdict(g["passed"]), escape(g["reason"])]
         for g in summary["gate_details"]],
        left=5,
    )  # fmt: skip
    keys = ["n_control", "n_candidate", "control_median", "candidate_median", "median_saving",
            "control_p90", "candidate_p90", "p90_saving", "mann_whitney_p"]  # fmt: skip
    comp_rows = [[escape(name), *(f"{row[k]:.3g}" if k == "mann_whitney_p" else str(row[k]) for k in keys),
                  "[{}, {}]".format(*row["median_saving_ci95"])]
                 for name, row in summary["comparison_ns"].items()]  # fmt: skip
    comps = _table(["span", *keys, "median_saving_ci95"], comp_rows)
    plots = "".join(
        f"<h3>{escape(name)}</h3>"
        + strip_plot(name, data.samples(name, Arm.CONTROL), data.samples(name, Arm.CANDIDATE))
        for name in summary["comparison_ns"]
    )
    hashes = _table(["artifact", "sha256"], [[escape(k), f"<code>{escape(str(v))}</code>"]
                                             for k, v in summary["artifact_sha256"].items()], left=2)  # fmt: skip
    exact = summary["exactness"]
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Experiment {exp}</title>"
        f"<style>{_CSS}</style></head><body><h1>Experiment {exp}</h1>"
        f"<div class='decision'><b>Status:</b> {escape(summary['status'])} &mdash; "
        f"<b>authorize:</b> {str(decision['authorize']).lower()}<br><b>Next action:</b> "
        f"{escape(decision['next_action'])}</div>"
        f"<p>Bitwise exact across arms: <b>{escape(str(exact['bitwise_exact']))}</b>; completion tokens per "
        f"arm: {escape(str(exact['completion_tokens_by_arm']))}</p>"
        f"<h2>Gates</h2>{gates}<h2>Comparisons (ns; saving = control &minus; candidate)</h2>{comps}"
        f"<h2>Durations</h2><p>Dots: spans (control top, candidate bottom); box: interquartile range; "
        f"solid line: median; dashed: p90.</p>{plots}<h2>Artifacts</h2>{hashes}</body></html>"
    )
