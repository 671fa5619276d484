"""The pure parts of ``python -m bench.quality`` and of the side-by-side modes of ``python -m
bench``: the scoring shared with worker_svc/quality.py, the issue's two quality rules, the
table and JSON, the modes' targets. The llama.cpp comparison itself runs in the bench (its
package is a source build, not a test dependency)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from bench import report
from bench.bench_modes import CPU_MODES, pick_modes
from bench.quality_table import LLAMACPP, QualityRow, document, rows_of, table, verdicts
from worker_svc.quality import TeacherForced, compare, score


def test_score_is_each_rows_argmax_and_target_nll() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    got = score(logits, torch.tensor([2, 0]))
    assert got.top1.tolist() == [1, 0]
    want = [-math.log(math.exp(1) / (1 + math.e**2 + math.e)), -math.log(math.e**3 / (math.e**3 + 2))]
    assert np.allclose(got.nll, want)


def test_compare_of_scored_logits_gives_agreement_and_perplexity_ratio() -> None:
    """llama.cpp's logits (numpy, as llama-cpp-python hands them) go through the same two steps."""
    rng = np.random.default_rng(0)
    base_logits = rng.normal(size=(50, 11)).astype(np.float32)
    test_logits = base_logits.copy()
    test_logits[:5] = rng.normal(size=(5, 11))  # a few rows of another engine differ
    targets = torch.tensor(rng.integers(0, 11, 50))
    base, test = score(torch.from_numpy(base_logits), targets), score(torch.from_numpy(test_logits), targets)
    a = compare(base, test)
    assert a.positions == 50
    assert a.top1_agreement == pytest.approx(np.mean(base_logits.argmax(1) == test_logits.argmax(1)))
    assert a.ppl_ratio == pytest.approx(math.exp(test.nll.mean() - base.nll.mean()))
    with pytest.raises(ValueError):
        compare(base, TeacherForced(test.top1[:10], test.nll[:10]))


def _row(mode: str, weights: str, agree: float, positions: int = 2287, same_as: str = "") -> QualityRow:
    system = LLAMACPP if mode == LLAMACPP else "kvfleet"
    return QualityRow(
        system, mode, weights, "-" if system == LLAMACPP else "avx512", positions, agree, 25.3, 25.2, 1.0, same_as
    )


ROWS = [
    _row("float32", "float32", 1.0),
    _row("int8", "int8 blocks of 32", 0.962, same_as="Q8_0"),
    _row("gguf", "Q4_1", 0.955, same_as="Q4_1"),
    _row("gguf", "Q8_0", 0.940, same_as="Q8_0"),
    _row(LLAMACPP, "Q4_1", 0.960),
    _row(LLAMACPP, "Q8_0", 0.965),
]


def test_verdicts_judge_each_quantized_row_against_llamacpp_on_the_same_quantization() -> None:
    got = {(v.row, v.rule.split(" ")[0]): v for v in verdicts(ROWS)}
    assert got["gguf Q4_1 @avx512", "top-1"].met  # 0.005 under llama.cpp's
    assert not got["gguf Q8_0 @avx512", "top-1"].met  # 0.025 under
    assert got["gguf Q8_0 @avx512", "top-1"].value == pytest.approx(-0.025)
    assert got["int8 int8 blocks of 32 @avx512", "top-1"].met  # 0.003 under Q8_0's
    assert got["int8 int8 blocks of 32 @avx512", "int8"].met  # >= 0.95
    assert ("float32 float32 @avx512", "top-1") not in got  # the reference is not judged
    low = verdicts([_row("int8", "int8 blocks of 32", 0.949)])
    assert [(v.rule, v.met) for v in low] == [("int8 top-1 agreement with float32", False)]


def test_no_llamacpp_row_means_no_llamacpp_verdict() -> None:
    """Without llama.cpp (or on other positions) the 0.01 rule is not claimed either way."""
    rows = [ROWS[2], _row(LLAMACPP, "Q4_1", 0.96, positions=1024)]
    assert verdicts(rows) == []


def test_document_round_trips_and_the_table_names_every_row_and_rule() -> None:
    cpu = {"model": "Some CPU", "cores": 2, "simd": ["avx2"], "levels": ["scalar", "avx2"], "default_level": "avx2"}
    doc = json.loads(json.dumps(document(ROWS, cpu, {"name": "heldout.txt", "tokens": 2288, "same_token_ids": "yes"})))
    assert rows_of(doc) == ROWS
    assert doc["rows"][2]["ppl_ratio"] == pytest.approx(25.3 / 25.2, abs=1e-5)
    text = table(doc)
    assert "same token ids in llama.cpp: yes" in text and "Some CPU" in text
    assert text.count("\nrule ") == len(doc["verdicts"]) == 4
    assert "-0.0050" in text and "NOT MET" in text


def test_pick_modes() -> None:
    assert pick_modes(None, None, None, "cpu") == tuple(CPU_MODES.values())
    assert pick_modes(None, None, None, "cuda") == (CPU_MODES["float32"],)
    assert [m.name for m in pick_modes("int8,gguf", None, None, "cpu")] == ["int8", "gguf"]
    (one,) = pick_modes(None, "bfloat16", None, "cpu")
    assert (one.name, one.dtype, one.quant) == ("bfloat16", "bfloat16", "none")
    with pytest.raises(ValueError):
        pick_modes("int4", None, None, "cpu")
    with pytest.raises(ValueError):
        pick_modes("int8", None, "gguf", "cpu")


def _run_doc() -> dict:
    """Two modes' clusters with the peers, as ``python -m bench`` records them."""

    def row(c: int, tok_s: float, itl: float | None = None) -> dict:
        return {"concurrency": c, "sessions": c, "output_tokens_per_s": tok_s, "itl_ms_p50": itl, "wall_s": 1.0}

    probe = {"best_tok_s": 50.0, "kv_block_bytes": 10**5, "weight_bytes": 10**8}
    doc = {
        "limits": {"bandwidth_gbs": {"best": 20.0}},
        "engine_batch1": {"int8": {**probe, "weight_bytes": 265 * 10**6}, "gguf": probe},
        "clusters": {
            "cluster-1w-int8": {
                "mode": "int8",
                "num_blocks": 100,
                "worker_memory_idle": {"worker-0": {"VmRSS": 10**9}},
            },
            "cluster-1w-gguf": {
                "mode": "gguf",
                "num_blocks": 100,
                "worker_memory_idle": {"worker-0": {"VmRSS": 4 * 10**8}},
            },
        },
        "results": {
            "cluster-1w-int8": [row(1, 40.0, 25.0), row(32, 200.0)],
            "cluster-1w-gguf": [row(1, 45.0, 22.0), row(32, 150.0)],
            "peer": [row(1, 20.0), row(32, 60.0)],
            "llama.cpp": [row(1, 50.0), row(32, 60.0)],
        },
    }
    doc["ratios"] = report.ratios(doc)
    return doc


def test_targets_per_mode_judge_batch1_on_gguf_and_rss_on_every_mode() -> None:
    t = report.targets(_run_doc())
    c1 = t["cluster_vs_llamacpp_at_1"]
    assert c1["by_mode"] == {"int8": 0.8, "gguf": 0.9} and c1["judged_on"] == "gguf"
    assert c1["value"] == 0.9 and c1["met"] is False
    c32 = t["cluster_vs_peer_at_32"]
    assert c32["value"] == pytest.approx(200 / 60, abs=1e-3) and c32["met"] is False
    assert t["cluster_vs_llamacpp_at_32"]["met"] is True  # int8: 3.33 >= 3
    rss = t["worker_rss_vs_bound"]
    # int8: 1 GB against 265 MB + 10 MB of KV + 400 MB; gguf: 400 MB against 510 MB
    assert rss["by_mode"]["gguf"] == pytest.approx(400 / 510, abs=1e-3)
    assert rss["value"] == pytest.approx(1000 / 675, abs=1e-3) and rss["met"] is False


def test_modes_table_rows_and_roofline() -> None:
    doc = _run_doc()
    line = report.roofline(doc, "gguf")
    assert line is not None and line["step_ms"] == pytest.approx(5.0)  # 100 MB at 20 GB/s
    lines = report.modes_table(doc)
    assert any(x.lstrip().startswith("cluster-1w-gguf") and "5.00" in x and "0.90" in x for x in lines)


def test_int8_runs_at_the_levels_it_has_and_gguf_at_every_one() -> None:
    from bench.quality import int8_levels
    from worker_svc.model import q8

    best = list(q8.runnable_levels()[-1:])
    assert int8_levels(["amx"]) == best  # int8 has no amx level: its best instead
    assert int8_levels(["scalar", "avx2", "avx512", "amx"]) == ["scalar", "avx2", "avx512"]
    assert int8_levels(["scalar"]) == ["scalar"]
