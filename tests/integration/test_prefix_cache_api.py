"""Prefix caching through the real scheduler and worker over gRPC: sessions sharing a 200-token
system prompt report cached prompt tokens in their final Usage, the worker counts the hits in
GetStats, and the tokens equal those of a cluster with caching off (and the numpy reference)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from scheduler_svc.core import SchedulerLimits
from tests.helpers.worker_stats import worker_stats
from tests.integration.inproc import InProcessCluster

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)
BS = 16
SYSTEM = [(11 * i + 5) % CFG.vocab_size for i in range(200)]
TURNS = [[(3 * i + k) % CFG.vocab_size for i in range(5 + 2 * k)] for k in range(3)]
NEW = 8


def _cluster(prefix_caching: bool, limits: SchedulerLimits | None = None) -> InProcessCluster:
    c = InProcessCluster(workers=1, limits=limits, block_size=BS)  # one worker: one cache
    c.worker_config = replace(c.worker_config, prefix_caching=prefix_caching)
    return c


def _run(cluster: InProcessCluster) -> list[tuple[list[int], int]]:
    """Sessions one after the other: (tokens, Usage.cached_tokens) each."""
    out = []
    with SchedulerClient(cluster.address) as client:
        for turn in TURNS:
            events = list(client.stream(build_request(SYSTEM + turn, NEW)))
            assert events[-1].finished
            out.append(([t for e in events for t in e.token_ids], events[-1].usage.cached_tokens))
    return out


def _hits(prompt_len: int, shared: int) -> int:
    """Tokens the scheduler finds cached when it places a session: the shared full blocks,
    keeping the prompt's last token to compute. However the prompt is then chunked (the cached
    tokens do not spend the prefill budget)."""
    return min((prompt_len - 1) // BS, shared // BS) * BS


@pytest.mark.parametrize("budget", [512, 64], ids=["one-chunk", "chunked"])
def test_shared_system_prompt_is_reused_and_tokens_match_caching_off(budget: int) -> None:
    limits = SchedulerLimits(prefill_token_budget=budget)
    with _cluster(False, limits) as off:
        plain = _run(off)
        assert worker_stats(off.worker_addresses[0]).prefix_cache_queries == 0
    with _cluster(True, limits) as on:
        cached = _run(on)
        stats = worker_stats(on.worker_addresses[0])
    for turn, (tokens, _), (want, none) in zip(TURNS, cached, plain):
        assert tokens == want == reference_generate(CFG, WEIGHTS, SYSTEM + turn, NEW)
        assert none == 0
    assert cached[0][1] == 0  # the first session found nothing
    for turn, (_, got) in zip(TURNS[1:], cached[1:]):
        expected = _hits(len(SYSTEM + turn), len(SYSTEM))
        assert got == expected > 0
    assert stats.prefix_cache_hits == sum(c for _, c in cached)
    assert stats.prefix_cache_queries >= sum(len(SYSTEM + t) for t in TURNS[1:])
    assert stats.used_blocks + stats.free_blocks == 1024


def test_callers_share_the_prefix_cache_only_with_themselves() -> None:
    """One caller's cached prompt is not a hit for another (so nobody can time whether someone
    else sent it); the same caller, and anonymous callers among themselves, still reuse it."""
    prompt = SYSTEM + TURNS[0]
    full = (len(prompt) - 1) // BS * BS  # full blocks, leaving one token to compute
    with _cluster(True) as c:

        def cached(token: str | None) -> tuple[list[int], int]:
            with SchedulerClient(c.address, token=token) as client:
                events = list(client.stream(build_request(prompt, NEW)))
            return [t for e in events for t in e.token_ids], events[-1].usage.cached_tokens

        first, alice_first = cached("alice-token")
        assert alice_first == 0
        assert cached("bob-token") == (first, 0)  # same tokens, computed anew
        assert cached("alice-token") == (first, full)
        assert cached("") == (first, 0)  # anonymous: a namespace of its own ...
        assert cached("") == (first, full)  # ... shared by anonymous callers
    assert first == reference_generate(CFG, WEIGHTS, prompt, NEW)
