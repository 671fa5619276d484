"""The worker's boundary: a StepRequest becomes engine values once, kv_views an Enum."""

from __future__ import annotations

import pytest

from kvfleet.v1 import worker_pb2 as pb
from scheduler_svc.convert import step_request, step_results
from scheduler_svc.core import Sampling
from scheduler_svc.core.plan import DecodeWork
from scheduler_svc.core.types import StepStatus
from worker_svc.config import WorkerConfig
from worker_svc.convert import step_from_pb, step_to_pb
from worker_svc.engine import EngineConfig, ItemResult, ItemStatus, SamplingSpec, StepOutput, StepProfile
from worker_svc.kv_views_mode import KVViewsMode


@pytest.mark.parametrize(
    "text, mode",
    [
        ("rebuild", KVViewsMode.REBUILD),
        ("persistent", KVViewsMode.PERSISTENT),
        (KVViewsMode.PERSISTENT, KVViewsMode.PERSISTENT),
    ],
)
def test_kv_views_parse(text, mode):
    assert KVViewsMode.parse(text) is mode
    assert EngineConfig(kv_views=text).kv_views is mode
    assert WorkerConfig(kv_views=text).kv_views is mode


@pytest.mark.parametrize("bad", ["", "paged", "Rebuild", "sideways"])
def test_unknown_kv_views_is_rejected_naming_the_field(bad):
    for build in (KVViewsMode.parse, lambda v: EngineConfig(kv_views=v), lambda v: WorkerConfig(kv_views=v)):
        with pytest.raises(ValueError, match="kv_views must be 'rebuild' or 'persistent'"):
            build(bad)


def test_step_request_converts_once():
    req = pb.StepRequest(
        prefill=[
            pb.PrefillItem(
                session_id="a",
                token_ids=[1, 2],
                start_position=0,
                last_chunk=True,
                sampling=pb.Sampling(temperature=0.5, top_k=3, seed=9),
            )
        ],
        decode=[pb.DecodeItem(session_id="b", token_id=4, position=7, generated_so_far=2)],
        kv_views="persistent",
        release_session_ids=["x", "y"],
        experiment_id="e",
        experiment_arm="treatment",
    )
    call = step_from_pb(req)
    assert call.kv_views is KVViewsMode.PERSISTENT
    assert call.release_session_ids == ("x", "y") and call.tokens == 3
    assert call.prefill[0].token_ids == (1, 2) and call.prefill[0].sampling.top_k == 3
    assert call.prefill[0].sampling.top_p == 1.0  # 0 on the wire = off
    assert (call.decode[0].position, call.decode[0].generated_so_far) == (7, 2)
    assert (call.experiment_id, call.experiment_arm) == ("e", "treatment")
    assert step_from_pb(pb.StepRequest()).kv_views is None  # empty = the worker's default


def test_the_schedulers_decode_columns_reach_the_worker_as_its_items():
    """The scheduler sends decode items as columns (DecodeColumns) with each distinct sampling
    once; the worker reads back every field of every item, in order."""
    greedy, hot = Sampling(), Sampling(temperature=0.5, top_k=5, seed=3, logit_bias=((4, 2.0),))
    work = [
        DecodeWork(f"s{k}", "w", 10 + k, 20 + 2 * k, hot if k % 3 == 1 else greedy, k, blocks, 0, k == 2)
        for k, blocks in enumerate([(), (7,), (), (8, 9), ()])
    ]
    req = pb.StepRequest.FromString(step_request([], work).SerializeToString())
    assert not req.decode and len(req.samplings) == 2  # the two distinct samplings, each once
    got = step_from_pb(req).decode
    assert [(i.session_id, i.token_id, i.position, i.generated_so_far, i.block_ids, i.last_sampled) for i in got] == [
        (w.session_id, w.token_id, w.position, w.generated_so_far, w.block_ids, w.last_sampled) for w in work
    ]
    assert [i.sampling for i in got] == [
        SamplingSpec(temperature=0.5, top_k=5, seed=3, logit_bias=((4, 2.0),)) if k % 3 == 1 else SamplingSpec()
        for k in range(5)
    ]
    assert all(not i.invalid for i in got)


def _columns(n: int = 2, **fields) -> pb.StepRequest:
    cols = {
        "session_ids": [f"s{k}" for k in range(n)],
        "token_ids": [1] * n,
        "positions": [3] * n,
        "generated_so_far": [1] * n,
        "last_sampled": [False] * n,
        "sampling": [0] * n,
        **fields,
    }
    return pb.StepRequest(decode_columns=pb.DecodeColumns(**cols), samplings=[pb.Sampling()])


@pytest.mark.parametrize(
    "req, message",
    [
        (_columns(positions=[3]), "one entry per session id"),
        (_columns(block_counts=[1]), "one entry per session id"),
        (_columns(sampling=[0, 1]), "indexes 1 samplings"),
        (_columns(block_counts=[1, 1], block_ids=[4]), "add up to 2, but 1 block ids"),
        (_columns(session_ids=["a", "a"]), "twice"),
        (_columns(session_ids=["a", ""]), "session_id"),
    ],
)
def test_decode_columns_that_do_not_line_up_are_value_errors(req, message):
    with pytest.raises(ValueError, match=message):
        step_from_pb(req)
    both = _columns()
    both.decode.add(session_id="z", token_id=1, position=3)
    with pytest.raises(ValueError, match="not both"):
        step_from_pb(both)


@pytest.mark.parametrize(
    "req, message",
    [
        (pb.StepRequest(kv_views="sideways"), "kv_views"),
        (pb.StepRequest(decode=[pb.DecodeItem(session_id="a"), pb.DecodeItem(session_id="a")]), "twice"),
        (pb.StepRequest(prefill=[pb.PrefillItem(token_ids=[1])]), "session_id"),
    ],
)
def test_bad_step_requests_are_value_errors(req, message):
    with pytest.raises(ValueError, match=message):
        step_from_pb(req)


_RESULTS = [
    ItemResult("tok", ItemStatus.OK, 0, 5),  # token 0 is a token
    ItemResult("lp", ItemStatus.OK, 7, 6, logprob=-0.25, top_logprobs=((7, -0.25), (3, -1.5)), constraint_done=True),
    ItemResult("miss", ItemStatus.CACHE_MISS, None, 0),
    ItemResult("bad", ItemStatus.REJECTED, None, 0, error="top_p must be in (0, 1]"),
    ItemResult("fail", ItemStatus.FAILED, None, 3, logprob=0.0, error="the forward failed"),
]


def test_step_results_carry_every_field_they_have_and_none_they_lack():
    """step_to_pb sets only what a result has; a field it lacks reads as its proto default
    (has_token / has_logprob say whether the zeros are real)."""
    resp = step_to_pb(StepOutput(results=_RESULTS, profile=StepProfile(0, 0, 0, 0)), step_ns=1234)
    assert resp.step_ns == 1234
    got = [
        (r.session_id, r.status, r.has_token, r.token_id, r.kv_tokens, r.has_logprob, r.logprob,
         [(t.token_id, t.logprob) for t in r.top_logprobs], r.constraint_done, r.error)
        for r in resp.results
    ]  # fmt: skip
    assert got == [
        ("tok", pb.ITEM_OK, True, 0, 5, False, 0.0, [], False, ""),
        ("lp", pb.ITEM_OK, True, 7, 6, True, -0.25, [(7, -0.25), (3, -1.5)], True, ""),
        ("miss", pb.ITEM_CACHE_MISS, False, 0, 0, False, 0.0, [], False, ""),
        ("bad", pb.ITEM_REJECTED, False, 0, 0, False, 0.0, [], False, "top_p must be in (0, 1]"),
        ("fail", pb.ITEM_FAILED, False, 0, 3, True, 0.0, [], False, "the forward failed"),
    ]


def test_results_as_columns_reach_the_scheduler_as_the_messages_do():
    """Every field of every result, through the columns (serialized and parsed), is what the
    scheduler reads from the ItemResult messages; only the results with extras carry one."""
    out = StepOutput(results=_RESULTS, profile=StepProfile(0, 0, 0, 0))
    as_messages = pb.StepResponse.FromString(step_to_pb(out, 1234).SerializeToString())
    as_columns = pb.StepResponse.FromString(step_to_pb(out, 1234, columns=True).SerializeToString())
    assert not as_columns.results and as_columns.step_ns == 1234
    assert [e.index for e in as_columns.columns.extras] == [1, 3, 4]  # lp, bad, fail
    got = step_results(as_columns)
    assert list(got) == ["tok", "lp", "miss", "bad", "fail"]
    assert got == step_results(as_messages)
    assert got["tok"].token_id == 0 and got["miss"].token_id is None and got["fail"].logprob == 0.0
    assert got["lp"].top_logprobs == ((7, -0.25), (3, -1.5)) and got["lp"].constraint_done
    # A step of no results asked for as columns still says so.
    empty = step_to_pb(StepOutput(results=[], profile=StepProfile(0, 0, 0, 0)), 1, columns=True)
    assert pb.StepResponse.FromString(empty.SerializeToString()).HasField("columns")


def _result_columns(**fields) -> pb.StepResponse:
    base = dict(session_ids=["a", "b"], statuses=[pb.ITEM_OK] * 2, token_ids=[3, -1], kv_tokens=[4, 5])
    return pb.StepResponse(columns=pb.ResultColumns(**{**base, **fields}))


@pytest.mark.parametrize(
    "resp, message",
    [
        (_result_columns(statuses=[pb.ITEM_OK]), "do not line up: 2 session ids, 1 statuses"),
        (_result_columns(token_ids=[3]), "1 token ids"),
        (_result_columns(kv_tokens=[4, 5, 6]), "3 kv_tokens"),
        (_result_columns(extras=[pb.ResultExtra(index=2, error="x")]), "names result 2 of 2"),
    ],
)
def test_result_columns_that_do_not_line_up_are_value_errors(resp, message):
    with pytest.raises(ValueError, match=message):
        step_results(resp)


def test_a_status_the_scheduler_does_not_know_reads_as_a_cache_miss_in_either_form():
    cols = step_results(_result_columns(statuses=[pb.ITEM_OK, 99]))
    msgs = step_results(pb.StepResponse(results=[pb.ItemResult(session_id="b", status=99)]))
    assert cols["b"].status == msgs["b"].status == StepStatus.CACHE_MISS


@pytest.mark.parametrize("blocks", [[(), (), ()], [(), (5,), (6, 7)]], ids=["no-new-blocks", "new-blocks"])
def test_columns_and_items_give_the_worker_the_same_decode_items(blocks):
    """Every field of DecodeItem, the invalid sampling's reason among them, comes out of the
    columns as out of the per-item messages (the columns' items are built positionally)."""
    samplings = [pb.Sampling(), pb.Sampling(temperature=0.5, seed=4), pb.Sampling(temperature=-1.0)]
    items = [
        pb.DecodeItem(
            session_id=f"s{k}",
            token_id=3 + k,
            position=10 + k,
            generated_so_far=20 + k,
            sampling=samplings[k],
            block_ids=list(blocks[k]),
            last_sampled=k == 1,
        )
        for k in range(3)
    ]
    cols = pb.DecodeColumns(
        session_ids=[i.session_id for i in items],
        token_ids=[i.token_id for i in items],
        positions=[i.position for i in items],
        generated_so_far=[i.generated_so_far for i in items],
        last_sampled=[i.last_sampled for i in items],
        sampling=[0, 1, 2],
        block_counts=[len(b) for b in blocks] if any(blocks) else [],
        block_ids=[b for bs in blocks for b in bs],
    )
    from_columns = step_from_pb(pb.StepRequest(decode_columns=cols, samplings=samplings)).decode
    assert from_columns == step_from_pb(pb.StepRequest(decode=items)).decode
    assert from_columns[2].invalid and not from_columns[0].invalid  # the rule broken, named
    assert [i.block_ids for i in from_columns] == [tuple(b) for b in blocks]
