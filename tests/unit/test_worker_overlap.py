"""The worker's half of overlapped scheduling: a decode planned before its input token came back
(`last_sampled`) runs on the token the engine sampled last, and numbered steps take their turns
in the scheduler's order whatever order their calls arrive in."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.unit.model_configs import GQA_CFG
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemStatus, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.step_order import StaleStep, StepOrder

CFG = GQA_CFG
WEIGHTS = tiny_weights(CFG, seed=5)
SEEDED = SamplingSpec(temperature=0.9, top_k=20, seed=7, presence_penalty=0.3)


def _steps() -> LocalSteps:
    return LocalSteps(Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=64)), prefix_caching=False)


def _generate(steps: LocalSteps, sid: str, prompt: tuple[int, ...], n: int, spec: SamplingSpec, ahead: bool):
    """n tokens; with `ahead`, every decode names no token (the engine's last sampled one)."""
    first = steps.step([PrefillItem(sid, prompt, 0, True, spec)], [])
    out = [first.results[0].token_id]
    for i in range(1, n):
        token = 0 if ahead else out[-1]
        item = DecodeItem(sid, token, len(prompt) + i - 1, spec, i, last_sampled=ahead)
        (r,) = steps.step([], [item]).results
        assert r.status == ItemStatus.OK
        out.append(r.token_id)
    return out


@pytest.mark.parametrize("spec", [SamplingSpec(), SEEDED], ids=["greedy", "seeded"])
def test_decodes_of_the_last_sampled_token_give_the_same_tokens(spec):
    prompt = tuple((7 * i + 3) % CFG.vocab_size for i in range(6))
    named = _generate(_steps(), "a", prompt, 8, spec, ahead=False)
    ahead = _generate(_steps(), "a", prompt, 8, spec, ahead=True)
    assert named == ahead
    if spec == SamplingSpec():
        assert named == reference_generate(CFG, WEIGHTS, prompt, 8)


def test_a_last_sampled_decode_of_a_session_without_one_is_a_cache_miss():
    steps = _steps()
    (r,) = steps.step([], [DecodeItem("nobody", 0, 0, SamplingSpec(), 1, last_sampled=True)]).results
    assert r.status == ItemStatus.CACHE_MISS
    # A non-last chunk samples nothing: there is no last token yet.
    steps.step([PrefillItem("b", (1, 2, 3, 4), 0, False, SamplingSpec())], [])
    (r,) = steps.step([], [DecodeItem("b", 0, 4, SamplingSpec(), 0, last_sampled=True)]).results
    assert r.status == ItemStatus.CACHE_MISS
    # Released: its last token goes with it.
    steps.step([PrefillItem("c", (1, 2, 3), 0, True, SamplingSpec())], [])
    steps.release(["c"])
    assert "c" not in steps.engine._last


def test_numbered_steps_take_their_turns_in_order():
    async def scenario() -> list[int]:
        order, took = StepOrder(), []

        async def step(seq: int, reset: bool = False) -> None:
            await order.turn(seq, reset, timeout=5)
            took.append(seq)

        # The count is set by a reset; the steps after it arrive first, and in reverse.
        late = [asyncio.ensure_future(step(s)) for s in (104, 103, 102)]
        await asyncio.sleep(0)
        assert took == []  # they wait for the reset
        await step(101, reset=True)
        await asyncio.gather(*late)
        await order.turn(0)  # unnumbered: at once
        return took

    assert asyncio.run(scenario()) == [101, 102, 103, 104]


def test_a_reset_sets_the_count_and_steps_from_before_it_are_refused():
    async def scenario() -> None:
        order = StepOrder()
        await order.turn(500, reset=True)
        waiting = asyncio.ensure_future(order.turn(503, timeout=5))  # its predecessors never come
        await asyncio.sleep(0)
        # The scheduler took the worker back (or restarted: its numbers start higher still).
        await order.turn(900, reset=True)
        with pytest.raises(StaleStep):
            await waiting  # overtaken by the reset: it must not run on the fresh books
        with pytest.raises(StaleStep):
            await order.turn(504)  # numbered before the reset
        await order.turn(901, timeout=1)
        assert order.last == 901

    asyncio.run(scenario())


def test_a_step_whose_predecessor_never_comes_times_out_and_the_count_goes_on():
    async def scenario() -> None:
        order = StepOrder()
        await order.turn(1, reset=True)
        with pytest.raises(TimeoutError):
            await order.turn(3, timeout=0.05)
        # The steps after the gap are not held up; the one that never came is stale if it does.
        await order.turn(4, timeout=1)
        with pytest.raises(StaleStep):
            await order.turn(2, timeout=1)
        assert order.last == 4

    asyncio.run(scenario())
