"""Overlapped scheduling through real gRPC servers: tick N+1 is planned and sent while tick N
computes. The tokens must be the ones the one-tick-at-a-time scheduler gives (and, greedy, the
numpy reference's), with sampling, stop tokens, n choices and cancels, and nothing may be left
held on a worker afterwards."""

from __future__ import annotations

import threading
import time

from kvfleet.client import SchedulerClient, build_request
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.helpers.worker_stats import worker_stats
from tests.integration.inproc import InProcessCluster
from worker_svc.engine import Engine

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


def _requests():
    out = []
    for i in range(10):
        prompt = [(5 * i + k) % 47 + 1 for k in range(3 + i % 5)]
        if i % 3 == 0:
            out.append(("greedy", prompt, build_request(prompt, 12 + i, ignore_eos=True)))
        elif i % 3 == 1:
            out.append(
                ("seeded", prompt, build_request(prompt, 10, temperature=0.8, top_k=12, seed=i, ignore_eos=True))
            )
        else:
            stop = reference_generate(CFG, WEIGHTS, prompt, 6)[3]  # ends it at its 4th token (or before)
            out.append(("stop", prompt, build_request(prompt, 20, stop_token_ids=[stop], ignore_eos=True)))
    out.append(("choices", [9, 8, 7], build_request([9, 8, 7], 9, temperature=1.0, seed=3, n=3, ignore_eos=True)))
    return out


def _serve_all(address: str) -> dict[int, list[list[int]]]:
    """Every request at once, each on its own thread: the batches mix lengths and phases."""
    got: dict[int, list[list[int]]] = {}
    reqs = _requests()

    def one(i: int) -> None:
        with SchedulerClient(address) as client:
            req = reqs[i][2]
            if req.n > 1:
                got[i] = [c.token_ids for c in client.choices(req)]
            else:
                got[i] = [client.generate(req).token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == len(reqs)
    return got


def _nothing_held(addresses: list[str]) -> None:
    deadline = time.monotonic() + 10
    while any(worker_stats(a).active_sessions for a in addresses):
        assert time.monotonic() < deadline, "a worker still holds sessions after every stream ended"
        time.sleep(0.05)


def test_overlap_gives_the_tokens_of_one_tick_at_a_time(monkeypatch) -> None:
    # Count the decodes the workers ran on their own last sampled token (planned ahead).
    ahead = {True: 0, False: 0}
    real_step = Engine.step

    def counting_step(self, prefill, decode, **kw):
        ahead[overlap] += sum(1 for d in decode if d.last_sampled)
        return real_step(self, prefill, decode, **kw)

    monkeypatch.setattr(Engine, "step", counting_step)
    results = {}
    for overlap in (False, True):
        with InProcessCluster(workers=2, overlap=overlap, num_blocks=256) as c:
            results[overlap] = _serve_all(c.address)
            _nothing_held(c.worker_addresses)
    assert ahead[False] == 0 and ahead[True] > 50, ahead
    assert results[True] == results[False]
    for i, (kind, prompt, req) in enumerate(_requests()):
        (tokens, *_) = results[True][i]
        if kind == "greedy":
            assert tokens == reference_generate(CFG, WEIGHTS, prompt, req.max_new_tokens)
        if kind == "stop":
            assert tokens[-1] == req.stop_token_ids[0] and len(tokens) <= 4


def test_cancelled_streams_with_overlap_free_their_workers_and_it_keeps_serving() -> None:
    prompt = [3, 1, 4, 1, 5]
    with InProcessCluster(workers=1, overlap=True) as c, SchedulerClient(c.address) as client:
        for _ in range(3):
            streams = [client.stream(build_request(prompt, 200, ignore_eos=True)) for _ in range(4)]
            for s in streams:
                next(s)  # running: its first token came
            for s in streams:
                s.cancel()
        _nothing_held(c.worker_addresses)
        after = client.generate(build_request(prompt, 30, ignore_eos=True))
        assert after.token_ids == reference_generate(CFG, WEIGHTS, prompt, 30)
