"""When the worker runs a step on its event loop instead of a thread (worker_svc.server)."""

import pytest

from worker_svc.config import WorkerConfig
from worker_svc.server import runs_inline


@pytest.mark.parametrize(
    "last_s, last_tokens, tokens, limit_s, inline",
    [
        (0.002, 4, 4, 0.005, True),  # a tiny decode step after another
        (0.002, 4, 8, 0.005, True),  # up to twice the last step's tokens
        (0.002, 4, 9, 0.005, False),  # a bigger step might take longer than the limit
        (0.050, 1, 1, 0.005, False),  # a real model's decode step
        (0.002, 4, 4, 0.0, False),  # limit 0: always in a thread
        (float("inf"), 0, 1, 0.005, False),  # the first step: nothing known yet
        (0.001, 0, 2, 0.005, True),  # after an empty step, up to 2 tokens
    ],
)
def test_inline_decision(last_s, last_tokens, tokens, limit_s, inline):
    assert runs_inline(last_s, last_tokens, tokens, limit_s) is inline


def test_config_rejects_negative_threads_and_inline_limit():
    with pytest.raises(ValueError, match="threads"):
        WorkerConfig(num_threads=-1)
    with pytest.raises(ValueError, match="inline"):
        WorkerConfig(inline_step_s=-0.1)


def test_cli_flags_reach_the_config():
    from worker_svc.__main__ import parse_args

    cfg = parse_args(["--threads", "2", "--inline-step-ms", "0"])
    assert cfg.num_threads == 2 and cfg.inline_step_s == 0.0
