"""The sweep's and the bench's pictures: valid PNG and SVG files of the promised size, beside the JSON."""

import json
import shutil
from pathlib import Path

import pytest

from bench import plot as bench_plot
from kvfleet import sweep_plot
from tests.helpers.images import png_size, svg_size

EXAMPLE = Path(__file__).parents[1] / "data" / "concurrency_sweep_example.json"


def _check(png: Path, svg: Path, module) -> None:
    assert png_size(png) == (int(module.WIDTH_IN * module.DPI), int(module.HEIGHT_IN * module.DPI))
    assert svg_size(svg) == (f"{module.WIDTH_IN * 72:g}pt", f"{module.HEIGHT_IN * 72:g}pt")
    assert png.stat().st_size > 20_000  # drawn, not blank: three panels of lines and text


def test_sweep_plot_beside_its_json(tmp_path):
    path = tmp_path / "sweep.json"
    shutil.copy(EXAMPLE, path)
    png, svg = sweep_plot.plot_sweep(json.loads(path.read_text()), path)
    assert (png, svg) == (tmp_path / "sweep.png", tmp_path / "sweep.svg")
    _check(png, svg, sweep_plot)
    assert png_size(png) == (1200, 400)
    text = svg.read_text()
    assert "tokens per tick" in text and "peak KV (KiB)" in text and "saturation at 8" in text


def _bench_doc() -> dict:
    def row(c, tput, ttft=None, itl=None):
        r = {"concurrency": c, "sessions": 2 * c, "output_tokens_per_s": tput, "wall_s": 1.0}
        if ttft is not None:
            r.update(ttft_ms_p50=ttft, ttft_ms_p99=3 * ttft, itl_ms_p50=itl, itl_ms_p99=2 * itl)
        return r

    return {
        "config": {"model": "tiny", "dtype": "float32", "kv_views": "persistent", "prefill_token_budget": 256},
        "machine": {"device": "cpu", "cores": 2},
        "results": {
            "cluster-1w": [row(1, 20, 300, 50), row(8, 49, 800, 95), row(32, 80, 1000, 180)],
            "cluster-2w": [row(1, 17, 500, 45), row(8, 29, 1200, 170), row(32, 68, 1700, 230)],
            "peer": [row(1, 12), row(8, 27), row(32, 43)],
        },
    }


def test_bench_plot_has_every_system(tmp_path):
    png, svg = bench_plot.plot_results(_bench_doc(), tmp_path / "results.json")
    assert (png, svg) == (tmp_path / "results.png", tmp_path / "results.svg")
    _check(png, svg, bench_plot)
    assert png_size(png) == (1350, 450)
    text = svg.read_text()
    for label in ("cluster-1w", "cluster-2w", "peer", "cluster-1w p99", "time to first token"):
        assert label in text
    assert "peer p50" not in text  # the peer has no per-token latencies to draw


def test_bench_plot_of_several_modes_labels_each_run(tmp_path):
    f32, int8 = _bench_doc(), _bench_doc()
    int8["config"]["quant"] = "int8"
    for i, doc in enumerate((f32, int8)):
        (tmp_path / f"r{i}.json").write_text(json.dumps(doc))
    assert bench_plot.main([str(tmp_path / "r0.json"), str(tmp_path / "r1.json")]) == 0
    png, svg = tmp_path / "modes.png", tmp_path / "modes.svg"
    _check(png, svg, bench_plot)
    text = svg.read_text()
    for label in ("cluster-1w float32", "cluster-1w float32+int8", "peer float32+int8"):
        assert label in text


def test_png_check_catches_a_non_png(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"GIF89a" + b"\0" * 40)
    with pytest.raises(AssertionError):
        png_size(bad)
