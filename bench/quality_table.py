"""The pure half of ``python -m bench.quality``: its rows, the issue's two quality rules, the
printed table and the JSON document. No torch, no llama.cpp: tests/unit/test_bench_quality.py
drives it directly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Issue 25 point 4: ours within this much top-1 agreement of llama.cpp's on the same
# quantization, and int8 weight-only at least this much agreement with float32.
LLAMACPP_MARGIN = 0.01
INT8_MIN_AGREEMENT = 0.95
LLAMACPP = "llama.cpp"


@dataclass(frozen=True)
class QualityRow:
    """One engine's teacher-forced figures against our float32 on the same token ids."""

    system: str  # "kvfleet" or "llama.cpp"
    mode: str  # float32 / int8 / gguf, or llama.cpp
    weights: str  # what it multiplies by: "Q4_1 (file)", "Q8_0 (requantized)", "float32"
    level: str  # our kernel level, or llama.cpp's build
    positions: int
    top1_agreement: float  # with our float32's argmax, position by position
    ppl: float
    ppl_base: float  # our float32's, on the same positions
    seconds: float
    same_as: str = ""  # for our quantized modes: the llama.cpp row's ``weights`` that is the same quantization

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_base


@dataclass(frozen=True)
class Verdict:
    rule: str
    row: str  # the row judged, as the table names it
    value: float
    want: str
    met: bool


def row_label(r: QualityRow) -> str:
    return f"{r.mode} {r.weights} @{r.level}" if r.system != LLAMACPP else f"{LLAMACPP} {r.weights}"


def counterpart(r: QualityRow, rows: Sequence[QualityRow]) -> QualityRow | None:
    """llama.cpp's row on the same quantization as ``r`` (over the same positions), if measured."""
    for other in rows:
        if other.system == LLAMACPP and r.same_as and other.weights == r.same_as and other.positions == r.positions:
            return other
    return None


def verdicts(rows: Sequence[QualityRow]) -> list[Verdict]:
    out = []
    for r in rows:
        if r.system == LLAMACPP:
            continue
        theirs = counterpart(r, rows)
        if theirs is not None:
            gap = r.top1_agreement - theirs.top1_agreement
            out.append(
                Verdict(
                    f"top-1 agreement within {LLAMACPP_MARGIN} of llama.cpp's on {theirs.weights}",
                    row_label(r),
                    round(gap, 4),
                    f">= -{LLAMACPP_MARGIN}",
                    gap >= -LLAMACPP_MARGIN,
                )
            )
        if r.mode == "int8":
            out.append(
                Verdict(
                    "int8 top-1 agreement with float32",
                    row_label(r),
                    round(r.top1_agreement, 4),
                    f">= {INT8_MIN_AGREEMENT}",
                    r.top1_agreement >= INT8_MIN_AGREEMENT,
                )
            )
    return out


def document(rows: Sequence[QualityRow], cpu: dict, text: dict) -> dict:
    """The JSON written (and embedded in ``python -m bench``'s results)."""
    return {
        "schema_version": 1,
        "cpu": cpu,
        "text": text,
        "rows": [{**asdict(r), "ppl_ratio": round(r.ppl_ratio, 5)} for r in rows],
        "verdicts": [asdict(v) for v in verdicts(rows)],
    }


def rows_of(doc: dict) -> list[QualityRow]:
    return [QualityRow(**{k: v for k, v in r.items() if k != "ppl_ratio"}) for r in doc["rows"]]


def table(doc: dict) -> str:
    cpu, text = doc["cpu"], doc["text"]
    rows = rows_of(doc)
    lines = [
        f"== teacher-forced quality against our float32: {text['name']}, {text['tokens']} tokens; "
        f"same token ids in llama.cpp: {text.get('same_token_ids', 'not checked')}",
        f"cpu: {cpu['model']} ({cpu['cores']} cores), flags {' '.join(cpu['simd'])}; our kernel levels "
        f"{', '.join(cpu['levels'])} (default {cpu['default_level']}); llama.cpp: {cpu.get('llamacpp', '-')}",
    ]
    heads = ["engine", "weights", "level", "positions", "top-1 agree", "vs llama.cpp", "ppl", "ppl ratio", "s"]
    grid = []
    for r in rows:
        theirs = counterpart(r, rows)
        grid.append(
            [
                r.mode if r.system != LLAMACPP else LLAMACPP,
                r.weights,
                r.level,
                str(r.positions),
                f"{r.top1_agreement:.4f}",
                f"{r.top1_agreement - theirs.top1_agreement:+.4f}" if theirs else "-",
                f"{r.ppl:.3f}",
                f"x{r.ppl_ratio:.4f}",
                f"{r.seconds:.0f}",
            ]
        )
    widths = [max(len(h), *(len(g[i]) for g in grid)) if grid else len(h) for i, h in enumerate(heads)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(heads, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(g, widths)) for g in grid]
    for v in doc["verdicts"]:
        lines.append(f"rule {v['rule']}: {v['row']} {v['value']} (want {v['want']}) {'MET' if v['met'] else 'NOT MET'}")
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
