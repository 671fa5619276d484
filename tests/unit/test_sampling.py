"""The worker's logit processors, seeded draws, logprobs and constraint hook (worker_svc/sampling.py),
alone and through the engine on the tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models.config import tiny_config
from kvfleet_models.tiny import tiny_weights
from scheduler_svc import convert
from scheduler_svc.core import (
    AdmissionRejected,
    FinishReason,
    PrefillWork,
    RejectReason,
    Sampling,
    SchedulerCore,
    SchedulerLimits,
    SessionRequest,
    StepResult,
    StepStatus,
    TokenLogprob,
)
from tests.unit.sim import tiny_worker
from worker_svc import convert as worker_convert
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemResult, ItemStatus, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.sampling import draw, logprobs_of, process_logits, sample_token

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG)
V = CFG.vocab_size


def _steps(**kw: object) -> LocalSteps:
    """An engine on the tiny model, driven with its blocks chosen as the scheduler would."""
    return LocalSteps(Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=128), **kw))  # type: ignore[arg-type]


def _row(seed: int = 0, n: int = V) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 2, n).astype(np.float32))


# ---- the processors, one by one -------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    history = [0, 1, 0]  # prompt + generated; counts do not matter for this penalty
    x = process_logits(logits, SamplingSpec(repetition_penalty=2.0), history, 0)
    assert x.tolist() == [1.0, -4.0, 1.0, -1.0, 0.5]
    # below 1 it favours the seen tokens instead
    x = process_logits(logits, SamplingSpec(repetition_penalty=0.5), history, 0)
    assert x[0] == 4.0 and x[1] == -1.0 and x[2] == 1.0


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits = torch.zeros(6)
    history = [4, 4, 5, 1, 1, 1, 2]  # prompt [4, 4, 5], then generated [1, 1, 1, 2]
    spec = SamplingSpec(presence_penalty=0.5, frequency_penalty=0.25)
    x = process_logits(logits, spec, history, generated=4)
    expected = [0.0, -(0.5 + 0.25 * 3), -(0.5 + 0.25 * 1), 0.0, 0.0, 0.0]  # prompt tokens 4, 5 untouched
    assert x.tolist() == pytest.approx(expected)
    assert process_logits(logits, spec, history, generated=0).tolist() == [0.0] * 6
    # negative values encourage repeats
    assert process_logits(logits, SamplingSpec(presence_penalty=-1.0), history, 4)[1] == 1.0


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = _row(1)
    top = int(torch.argmax(logits))
    forced = (top + 7) % V
    for temperature in (0.0, 1.0):
        spec = SamplingSpec(temperature=temperature, logit_bias=((forced, 100.0),))
        assert {sample_token(logits, spec, i) for i in range(30)} == {forced}
        banned = SamplingSpec(temperature=temperature, logit_bias=((top, -100.0),))
        assert top not in {sample_token(logits, banned, i) for i in range(200)}
    assert process_logits(logits, SamplingSpec(logit_bias=((3, 1.5),)))[3] == pytest.approx(float(logits[3]) + 1.5)


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    draws = {sample_token(logits, SamplingSpec(1.0, min_p=0.4, seed=s), i) for s in range(3) for i in range(100)}
    assert draws == {0, 1}  # 0.25 >= 0.4 * 0.5; 0.125 is not
    draws = {sample_token(logits, SamplingSpec(1.0, min_p=0.2, seed=s), i) for s in range(3) for i in range(100)}
    assert draws == {0, 1, 2, 3}
    assert {sample_token(logits, SamplingSpec(1.0, min_p=1.0, seed=s), i) for s in range(3) for i in range(50)} == {0}


def test_constraint_mask_removes_disallowed_tokens() -> None:
    logits = _row(2)
    allowed = np.zeros(V, bool)
    allowed[[5, 9]] = True
    x = process_logits(logits, SamplingSpec(), (), 0, allowed)
    assert torch.isinf(x[~torch.from_numpy(allowed)]).all() and torch.isfinite(x[[5, 9]]).all()
    assert {sample_token(logits, SamplingSpec(1.0, seed=s), 0, allowed=allowed) for s in range(60)} == {5, 9}


# ---- logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_the_processed_logits(temperature: float) -> None:
    logits = _row(3)
    spec = SamplingSpec(temperature, top_k=5, logprobs=True, top_logprobs=20, logit_bias=((2, 3.0),))
    x = process_logits(logits, spec)
    token = draw(x, spec, 4)
    logprob, top = logprobs_of(x, spec, token)
    # An independent oracle: log-softmax by hand in float64 numpy, z - max - log(sum(exp(z - max))).
    z = x.numpy().astype(np.float64)
    if temperature:
        z = z / temperature
    shifted = z - z.max()
    expected = shifted - math.log(math.fsum(math.exp(v) for v in shifted))
    assert logprob == pytest.approx(float(expected[token]))
    # the top 20 are exactly the 20 most likely ids (ties by the lower id), with their logprobs
    want_ids = sorted(range(V), key=lambda t: (-expected[t], t))[:20]
    assert [t for t, _ in top] == want_ids
    for t, v in top:
        assert v == pytest.approx(float(expected[t]))
    # the whole vocabulary's mass, not the top_k-truncated one: top 20 > top_k 5 still real
    assert all(v > float("-inf") for _, v in top)
    if temperature == 0:
        assert top[0][0] == token


def test_top_logprobs_break_ties_by_lower_id() -> None:
    logits = torch.tensor([1.0, 3.0, 0.0, 3.0, 3.0, 2.0])
    _, top = logprobs_of(process_logits(logits, SamplingSpec()), SamplingSpec(logprobs=True, top_logprobs=4), 1)
    assert [t for t, _ in top] == [1, 3, 4, 5]


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"constraint": "yaml"}, "constraint"),
        ({"constraint": "json_schema"}, "constraint_schema"),
    ],
)
def test_spec_rejects_out_of_range_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingSpec(**kwargs)


def test_a_grammar_refusal_or_a_sampling_fault_fails_its_item_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(kind: str, schema: str):  # type: ignore[no-untyped-def]
        raise ValueError("schema nests too deep")

    engine = Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=64), constraint_factory=refuse)
    steps = LocalSteps(engine)
    prompt = (1, 2, 3, 4, 5)
    alone = steps.step([PrefillItem("ok", prompt, 0, True, SamplingSpec())], []).results[0].token_id
    steps.release(["ok"])
    monkeypatch.setenv("KVFLEET_FAILPOINTS", "worker.sample:seed=666")
    items = [
        PrefillItem("ok", prompt, 0, True, SamplingSpec()),
        PrefillItem("refused", prompt, 0, True, SamplingSpec(constraint="json_object")),
        PrefillItem("fault", prompt, 0, True, SamplingSpec(temperature=0.8, seed=666)),
        PrefillItem("other-seed", prompt, 0, True, SamplingSpec(temperature=0.8, seed=665)),
    ]
    ok, refused, fault, other = steps.step(items, []).results
    assert ok.status == ItemStatus.OK and ok.token_id == alone
    assert other.status == ItemStatus.OK and other.token_id is not None
    assert refused.status == ItemStatus.REJECTED and "schema nests too deep" in refused.error
    assert fault.status == ItemStatus.FAILED and "FailpointHit" in fault.error
    assert (refused.token_id, refused.kv_tokens, fault.token_id, fault.kv_tokens) == (None, 0, None, 0)
    # Their sessions are freed here; the two that ran hold their prompts.
    assert sorted(engine.session_ids()) == sorted(steps.tables.session_ids()) == ["ok", "other-seed"]
    assert engine.stats().item_errors == 2
    held = set(steps.tables.blocks("ok")) | set(steps.tables.blocks("other-seed"))  # the full block is shared
    assert engine.stats().used_blocks == steps.tables.allocator.num_used == len(held)


# ---- through the engine ------------------------------------------------------------------------


def _token(r: ItemResult) -> int:
    assert r.token_id is not None, r
    return r.token_id


def _generate(
    steps: LocalSteps, sid: str, prompt: list[int], n: int, spec: SamplingSpec, company: int = 0
) -> tuple[list[int], list[ItemResult]]:
    """Greedy-loop one session for n tokens, with `company` other sessions in every step.
    Returns its tokens and its ItemResults."""
    out = steps.step(
        [PrefillItem(sid, tuple(prompt), 0, True, spec)]
        + [
            PrefillItem(f"{sid}-o{i}", tuple((3 * i + j) % V for j in range(2 + i)), 0, True, SamplingSpec())
            for i in range(company)
        ],
        [],
    )
    results = [out.results[0]]
    tokens = [_token(out.results[0])]
    others = {r.session_id: (_token(r), r.kv_tokens) for r in out.results[1:]}
    while len(tokens) < n:
        decode = [DecodeItem(sid, tokens[-1], len(prompt) + len(tokens) - 1, spec, len(tokens))]
        decode += [DecodeItem(o, t, kv, SamplingSpec(1.0, seed=7), kv) for o, (t, kv) in others.items()]
        out = steps.step([], decode)
        results.append(out.results[0])
        tokens.append(_token(out.results[0]))
        others = {r.session_id: (_token(r), r.kv_tokens) for r in out.results[1:]}
    steps.release([sid, *others])
    return tokens, results


def test_engine_applies_penalties_over_its_own_history() -> None:
    """Every token equals the argmax of the raw logits processed with the history the test keeps."""
    steps = _steps()
    prompt = [3, 4, 5, 3]
    spec = SamplingSpec(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.6)
    tokens: list[int] = []
    out = steps.step([PrefillItem("s", tuple(prompt), 0, True, spec)], [], return_logits=True)
    while True:
        token = _token(out.results[0])
        assert out.logits is not None
        expected = int(
            torch.argmax(process_logits(torch.from_numpy(out.logits[0]), spec, prompt + tokens, len(tokens)))
        )
        assert token == expected
        tokens.append(token)
        if len(tokens) == 12:
            break
        decode = DecodeItem("s", token, len(prompt) + len(tokens) - 1, spec, len(tokens))
        out = steps.step([], [decode], return_logits=True)
    plain, _ = _generate(_steps(), "p", prompt, 12, SamplingSpec())
    assert tokens != plain, "the penalties should change the tiny model's greedy output"


def test_seeded_sampling_with_penalties_ignores_batch_and_moves() -> None:
    spec = SamplingSpec(1.2, top_k=30, seed=5, presence_penalty=1.0, repetition_penalty=1.2, min_p=0.05)
    alone, _ = _generate(_steps(), "s", [1, 2, 3], 10, spec)
    crowded, _ = _generate(_steps(), "s", [1, 2, 3], 10, spec, company=3)
    assert alone == crowded
    # A move: another engine recomputes prompt + the first 6 tokens and samples token 6.
    other = _steps()
    out = other.step([PrefillItem("s", (1, 2, 3, *alone[:6]), 0, True, spec, generated_so_far=6)], [])
    assert out.results[0].token_id == alone[6]


def test_engine_reports_logprobs_only_when_asked() -> None:
    steps = _steps()
    _, results = _generate(steps, "a", [1, 2], 4, SamplingSpec(logprobs=True, top_logprobs=3))
    for r in results:
        assert r.logprob is not None and r.logprob <= 0
        assert len(r.top_logprobs) == 3 and r.top_logprobs[0] == (r.token_id, pytest.approx(r.logprob))
    _, results = _generate(steps, "b", [1, 2], 2, SamplingSpec())
    assert all(r.logprob is None and r.top_logprobs == () for r in results)


# ---- the constraint hook -----------------------------------------------------------------------


class SequenceConstraint:
    """A fake grammar: exactly the tokens of `sequence`, one after the other."""

    made: list[SequenceConstraint] = []

    def __init__(self, kind: str, schema: str, sequence: tuple[int, ...]) -> None:
        self.kind, self.schema, self.sequence = kind, schema, sequence
        self.accepted: list[int] = []
        SequenceConstraint.made.append(self)

    def allowed_mask(self) -> np.ndarray:
        mask = np.zeros(V, bool)
        if len(self.accepted) < len(self.sequence):
            mask[self.sequence[len(self.accepted)]] = True
        return mask

    def accept(self, token_id: int) -> None:
        assert self.allowed_mask()[token_id], f"token {token_id} was not allowed"
        self.accepted.append(token_id)

    def is_done(self) -> bool:
        return len(self.accepted) == len(self.sequence)


def test_constraint_masks_accepts_and_reports_done() -> None:
    SequenceConstraint.made.clear()
    sequence = (11, 7, 30, 7)
    steps = _steps(constraint_factory=lambda kind, schema: SequenceConstraint(kind, schema, sequence))
    spec = SamplingSpec(temperature=1.0, seed=3, constraint="json_schema", constraint_schema='{"type": "object"}')
    tokens, results = _generate(steps, "c", [1, 2, 3], 4, spec, company=2)
    assert tokens == list(sequence)
    assert [r.constraint_done for r in results] == [False, False, False, True]
    assert len(SequenceConstraint.made) == 1
    assert (SequenceConstraint.made[0].kind, SequenceConstraint.made[0].schema) == ("json_schema", '{"type": "object"}')

    # A recompute after a move: the new session's constraint is fed the generated tokens again.
    out = steps.step([PrefillItem("m", (1, 2, 3, 11, 7), 0, True, spec, generated_so_far=2)], [])
    assert out.results[0].token_id == 30
    assert SequenceConstraint.made[-1].accepted == [11, 7, 30]


# ---- the scheduler: request -> core Sampling -> admission -> outcomes ---------------------------


def _core() -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits())
    core.add_worker(tiny_worker(), V, CFG.max_position)
    return core


def _answer(plan, token: int, **kw: object) -> dict[str, StepResult]:
    return {
        w.session_id: StepResult(w.session_id, StepStatus.OK, token, w.start_position + len(w.token_ids), **kw)  # type: ignore[arg-type]
        for w in plan.prefill
    } | {
        w.session_id: StepResult(w.session_id, StepStatus.OK, token, w.position + 1, **kw)  # type: ignore[arg-type]
        for w in plan.decode
    }


def test_request_fields_reach_the_core_sampling() -> None:
    req = spb.GenerateRequest(
        sampling=spb.SamplingParams(presence_penalty=0.5, min_p=0.1, logit_bias={7: -3.0, 2: 1.0}),
        logprobs=True,
        top_logprobs=4,
        response_format=spb.ResponseFormat(type="json_schema", json_schema='{"type": "object"}'),
    )
    s = convert.sampling_from_request(req)
    assert (s.presence_penalty, s.min_p, s.repetition_penalty) == (0.5, pytest.approx(0.1), 1.0)
    assert s.logit_bias == ((2, 1.0), (7, -3.0))
    assert (s.logprobs, s.top_logprobs, s.constraint) == (True, 4, "json_schema")
    assert (
        convert.sampling_from_request(spb.GenerateRequest(response_format=spb.ResponseFormat(type="text")))
        == Sampling()
    )
    # and on to the worker's message, which the worker reads back into the same values
    wire = convert.step_request([PrefillWork("s", "w", (1,), 0, True, s, 0)], []).prefill[0].sampling
    spec = worker_convert.sampling_from_pb(wire)
    assert (spec.logit_bias, spec.top_logprobs, spec.constraint_schema) == (s.logit_bias, 4, '{"type": "object"}')


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (Sampling(presence_penalty=-2.5), "presence_penalty"),
        (Sampling(frequency_penalty=float("nan")), "frequency_penalty"),
        (Sampling(repetition_penalty=-1.0), "repetition_penalty"),
        (Sampling(min_p=2.0), "min_p"),
        (Sampling(logit_bias=((V, 1.0),)), "logit_bias token id"),
        (Sampling(logit_bias=((1, -200.0),)), "logit_bias for token 1"),
        (Sampling(logit_bias=tuple((i % V, 0.0) for i in range(301))), "logit_bias has 301"),
        (Sampling(logprobs=True, top_logprobs=21), "top_logprobs"),
        (Sampling(top_logprobs=2), "top_logprobs needs logprobs"),
        (Sampling(constraint="xml"), "response_format.type 'xml'"),
        (Sampling(constraint="json_schema", constraint_schema="{oops"), "response_format.json_schema is not valid"),
        (Sampling(constraint="json_schema", constraint_schema="[1]"), "response_format.json_schema must be"),
    ],
)
def test_admission_rejects_bad_sampling_naming_the_field(sampling: Sampling, field: str) -> None:
    core = _core()
    with pytest.raises(AdmissionRejected, match=field.replace("(", r"\(")) as info:
        core.submit(SessionRequest((1, 2), 3, sampling))
    assert info.value.reason == RejectReason.INVALID_REQUEST


def test_outcomes_carry_logprobs_cached_tokens_and_finish_on_constraint_done() -> None:
    core = _core()
    prompt = tuple(range(1, 18))  # one full block of 16, and one token more
    # A first session writes the prompt's full block; the scheduler's books then hold it cached.
    first = core.submit(SessionRequest(prompt, 1))
    plan = core.schedule()
    assert core.update(plan, _answer(plan, 5)).finished == [(first, FinishReason.LENGTH)]
    sid = core.submit(SessionRequest(prompt, 10, Sampling(logprobs=True, top_logprobs=1)))
    plan = core.schedule()
    assert [(p.session_id, p.cached_tokens) for p in plan.prefill] == [(sid, 16)]
    out = core.update(plan, _answer(plan, 9, logprob=-0.25, top_logprobs=((9, -0.25),)))
    assert out.tokens == [(sid, 9)]
    assert out.logprobs[sid] == TokenLogprob(9, -0.25, ((9, -0.25),))
    assert core.session(sid).cached_tokens == 16
    plan = core.schedule()
    out = core.update(plan, _answer(plan, 4, logprob=-1.0, constraint_done=True))
    assert out.tokens == [(sid, 4)] and out.finished == [(sid, FinishReason.STOP)]
    assert out.logprobs[sid].logprob == -1.0


def test_a_step_item_with_sampling_outside_the_rules_is_rejected_alone() -> None:
    from kvfleet.v1 import worker_pb2 as wpb

    req = wpb.StepRequest(
        prefill=[
            wpb.PrefillItem(session_id="bad", token_ids=[1, 2], last_chunk=True, sampling=wpb.Sampling(top_p=-0.5)),
            wpb.PrefillItem(session_id="ok", token_ids=[1, 2], last_chunk=True),
        ]
    )
    call = worker_convert.step_from_pb(req)  # not a ValueError for the whole step
    bad, ok = _steps().step(call.prefill, call.decode).results
    assert bad.status == ItemStatus.REJECTED and "top_p" in bad.error and bad.token_id is None
    assert ok.status == ItemStatus.OK and ok.token_id is not None
