"""bench.batch_decode on the tiny model: the full-batch steps it reports are the worker's own
spans of the steps that decoded every session at once."""

from __future__ import annotations

import re

from bench import batch_decode


def test_it_reports_the_worker_s_full_batch_decode_steps(capsys) -> None:
    code = batch_decode.main(
        ["--model", "tiny", "--batch", "4", "--context", "5", "--new-tokens", "40", "--num-blocks", "64"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    got = re.search(r"batch 4 x 5-token prompts: (\d+) full-batch decode steps, median ([\d.]+) ms", out)
    assert got, out
    # Each session's first token comes from its prefill, the 39 others from decodes: at most 39
    # steps decode all 4 (fewer when the requests reach different ticks: 40 tokens each keep
    # them overlapping on a loaded machine, where 7 once did not); a count of every step the
    # worker ran (prefills, partial batches) would pass 39.
    assert 1 <= int(got.group(1)) <= 39
    assert float(got.group(2)) > 0
    assert "160 tokens" in out
