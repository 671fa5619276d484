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
    # One workload: the 4 prompts are prefilled in the first tick (20 tokens, within the
    # scheduler's prefill budget), each first token comes from that prefill and the 39 others
    # from decodes of all 4 at once, whatever the machine's load; a count of every step the
    # worker ran would include the prefill.
    assert int(got.group(1)) == 39
    assert float(got.group(2)) > 0
    assert "160 tokens" in out
