"""python -m bench.prefix_cache: the worker's prefix cache on a shared system prompt.

N sessions, one after the other, each a ``--system-tokens`` system prompt (the same for all)
plus its own short user turn, on two engines in this process: prefix caching on and off. TTFT
here is the session's prefill step (the step that returns its first token), timed on the host;
the two engines alternate session by session so that both see the same machine load. The
first session of a round on the caching engine finds nothing (it fills the cache) and is
reported apart; each of ``--rounds`` rounds uses its own system prompt, so each starts cold.
The row gives median TTFT off and on over the other sessions, and the median of the paired
ratios (off / on of one session, measured back to back: robust to a machine whose load drifts).
Greedy tokens of both engines are compared: the row says whether they are equal.

``--routing``: cache-aware routing through a real cluster of two workers (separate processes),
against placement by load alone, both in this run. Two system prompts; each wave sends one
session of each, in alternating order, so that a placement blind to the caches puts every other
wave's sessions on the worker that does not hold their prompt. The row gives the hit rate
(cached / prompt tokens, over the sessions after each prompt's first), the median TTFT through
the cluster, and whether both runs' tokens are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("TQDM_DISABLE", "1")  # before gguf imports tqdm (see bench/__main__.py)

import torch  # noqa: E402

from bench.bench_modes import KV_VIEWS, KV_VIEWS_DEFAULT  # noqa: E402
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec  # noqa: E402
from worker_svc.kv_views_mode import KVViewsMode  # noqa: E402
from worker_svc.local import LocalSteps  # noqa: E402

GREEDY = SamplingSpec()
SYSTEM_TEXT = (
    "You are the support assistant of a small online bookshop. Answer questions about opening "
    "hours, orders, deliveries, returns and gift cards, briefly and politely. Opening hours are "
    "Monday to Friday from nine in the morning to six in the evening, and Saturday from ten to "
    "four; the shop is closed on Sundays and public holidays. Orders placed before noon ship the "
    "same working day. Deliveries take two to four working days within the country and up to ten "
    "working days abroad; tracking numbers are sent by e-mail once a parcel leaves the shop. "
    "Books may be returned within thirty days in their original condition with the receipt; the "
    "money goes back to the original means of payment within five working days. Gift cards are "
    "valid for two years and cannot be returned or exchanged for cash. Never invent a policy "
    "that is not written here; if a question is not covered, say so and give the shop's e-mail "
    "address, which is help@example.org, and its phone line, open during opening hours only. "
    "Keep every answer under three sentences unless the customer asks for details."
)
USER_TURNS = [
    "When do you open on Saturday?",
    "Can I return a gift card?",
    "How long does delivery abroad take?",
    "I ordered at eleven, when will it ship?",
    "Do you sell e-books?",
    "My book arrived damaged, what now?",
    "Are you open on Easter Monday?",
    "How do I track my parcel?",
    "Can I pay with a gift card online?",
    "What is your phone number?",
    "Can I exchange a book for another one?",
    "How long is a gift card valid?",
]


def prompts(model: str, system_tokens: int, sessions: int, vocab: int, round_no: int = 0) -> list[list[int]]:
    """The sessions' token ids: exactly ``system_tokens`` shared ids (a different system prompt
    per round), then each user turn."""
    if model == "tiny":  # no tokenizer: seeded ids stand in for text
        system = [(7 * i + 3 + round_no) % vocab for i in range(system_tokens)]
        return [system + [(5 * i + 11 * k) % vocab for i in range(8 + k % 5)] for k in range(sessions)]
    from kvfleet_models.tokenizer import Tokenizer

    tok = Tokenizer.for_model(model)
    system = tok.encode(f"Desk {round_no + 1}. {SYSTEM_TEXT}")
    while len(system) < system_tokens:
        system += tok.encode(" " + SYSTEM_TEXT, add_special_tokens=False)
    system = system[:system_tokens]
    turns = [USER_TURNS[k % len(USER_TURNS)] for k in range(sessions)]
    return [system + tok.encode(f"\nUser: {t}\nAssistant:", add_special_tokens=False) for t in turns]


def run_session(engine: LocalSteps, sid: str, prompt: Sequence[int], new_tokens: int) -> tuple[float, int, list[int]]:
    """(prefill seconds, cached tokens, greedy tokens); the session is released after. The
    driver keeps the block tables and finds the cached prefix, as the scheduler does."""
    engine.engine.use_threads()
    t0 = time.perf_counter()
    (r,) = engine.step([PrefillItem(sid, tuple(prompt), 0, True, GREEDY)], []).results
    ttft = time.perf_counter() - t0
    assert r.token_id is not None, f"{sid}: {r.status}"
    tokens = [r.token_id]
    for k in range(1, new_tokens):
        (d,) = engine.step([], [DecodeItem(sid, tokens[-1], len(prompt) + k - 1, GREEDY, k)]).results
        assert d.token_id is not None, f"{sid}: {d.status}"
        tokens.append(d.token_id)
    engine.release([sid])
    return ttft, r.cached_tokens, tokens


def measure(
    model: str,
    sessions: int,
    system_tokens: int,
    new_tokens: int,
    device: str,
    threads: int,
    kv_views: str,
    rounds: int = 3,
) -> dict:
    from kvfleet_models.registry import load_model

    cfg, weights = load_model(model)
    # Resolved once: an engine built with 0 reads torch's count, which the first engine's
    # thread split has already changed, and the two would then run on different threads.
    threads = threads or torch.get_num_threads()
    engines = {
        on: LocalSteps(
            Engine(
                cfg,
                weights,
                EngineConfig(
                    device=device,
                    num_blocks=512,
                    num_threads=threads,
                    kv_views=KVViewsMode.parse(kv_views),
                    prefix_caching=on,
                ),
            )
        )
        for on in (True, False)
    }
    warm = [(11 * i + 1) % cfg.vocab_size for i in range(system_tokens)]  # unrelated to the prompts
    for engine in engines.values():  # first-call costs, outside the figures
        run_session(engine, "warm", warm, 2)
    first_on: list[float] = []  # a round's first session: the cache is cold
    ttft: dict[bool, list[float]] = {True: [], False: []}  # the other sessions
    cached: list[int] = []
    prompt_lens: list[int] = []
    equal = True
    for round_no in range(rounds):
        for k, prompt in enumerate(prompts(model, system_tokens, sessions, cfg.vocab_size, round_no)):
            got, took = {}, {}
            for on in (True, False) if k % 2 else (False, True):  # alternate which goes first
                took[on], hits, got[on] = run_session(engines[on], f"r{round_no}s{k}", prompt, new_tokens)
                if on:
                    hit = hits
            equal = equal and got[True] == got[False]
            prompt_lens.append(len(prompt))
            if k == 0:
                first_on.append(took[True])
                continue
            cached.append(hit)
            for on in (True, False):
                ttft[on].append(took[on])
    s = engines[True].engine.stats()
    ms = 1e3
    return {
        "model": model,
        "device": str(engines[True].engine.device),
        "kv_views": kv_views,
        "sessions": sessions,
        "rounds": rounds,
        "system_tokens": system_tokens,
        "prompt_tokens_mean": round(statistics.mean(prompt_lens), 1),
        "cached_tokens_mean": round(statistics.mean(cached), 1),
        "ttft_first_on_ms_median": round(statistics.median(first_on) * ms, 2),
        "ttft_off_ms_median": round(statistics.median(ttft[False]) * ms, 2),
        "ttft_on_ms_median": round(statistics.median(ttft[True]) * ms, 2),
        "ttft_ratio_off_over_on": round(statistics.median(ttft[False]) / statistics.median(ttft[True]), 2),
        "paired_ratio_median": round(statistics.median(f / o for f, o in zip(ttft[False], ttft[True])), 2),
        "hit_rate": round(s.prefix_cache_hits / s.prefix_cache_queries, 3) if s.prefix_cache_queries else 0.0,
        "tokens_equal": equal,
        "threads": threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def _route_one(model: str, cache_aware: bool, waves: int, system_tokens: int, new_tokens: int) -> dict:
    from kvfleet.client import SchedulerClient, build_request
    from kvfleet.local_cluster import ClusterSpec, LocalCluster

    args = () if cache_aware else ("--no-cache-aware-routing",)
    spec = ClusterSpec(workers=2, model=model, telemetry=False, num_blocks=512, scheduler_args=args)
    vocab = 48 if model == "tiny" else None
    cached = prompt_tokens = 0
    ttft: list[float] = []
    tokens: list[list[int]] = []
    placed: list[tuple[int, str]] = []  # (system prompt, worker) of each session
    with LocalCluster(spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        if vocab is None:
            vocab = client.model_info().vocab_size
        groups = [prompts(model, system_tokens, 2 * waves, vocab, round_no=g) for g in range(2)]
        for wave in range(waves):
            order = (0, 1) if wave % 2 == 0 else (1, 0)
            t0 = time.perf_counter()
            streams = {g: client.stream(build_request(groups[g][wave], new_tokens, ignore_eos=True)) for g in order}
            firsts = {g: next(s) for g, s in streams.items()}
            took = time.perf_counter() - t0
            for g in (0, 1):
                events = [firsts[g], *streams[g]]
                tokens.append([t for e in events for t in e.token_ids])
                placed.append((g, firsts[g].worker_id))
                if wave:  # the first wave fills the caches
                    cached += events[-1].usage.cached_tokens
                    prompt_tokens += len(groups[g][wave])
                    ttft.append(took)
    return {
        "hit_rate": round(cached / prompt_tokens, 3) if prompt_tokens else 0.0,
        "ttft_ms_median": round(statistics.median(ttft) * 1e3, 2) if ttft else 0.0,
        "prompt_on_its_worker": round(
            sum(1 for g, w in placed[2:] if w == dict(placed[:2]).get(g)) / max(len(placed) - 2, 1), 3
        ),
        "tokens": tokens,
    }


def measure_routing(model: str, waves: int, system_tokens: int, new_tokens: int) -> dict:
    runs = {on: _route_one(model, on, waves, system_tokens, new_tokens) for on in (True, False)}
    on, off = runs[True], runs[False]
    return {
        "model": model,
        "workers": 2,
        "waves": waves,
        "system_tokens": system_tokens,
        "hit_rate_cache_aware": on["hit_rate"],
        "hit_rate_by_load": off["hit_rate"],
        "on_prompt_worker_cache_aware": on["prompt_on_its_worker"],
        "on_prompt_worker_by_load": off["prompt_on_its_worker"],
        "ttft_ms_cache_aware": on["ttft_ms_median"],
        "ttft_ms_by_load": off["ttft_ms_median"],
        "tokens_equal": on["tokens"] == off["tokens"],
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=8, help="sessions sharing the system prompt (at least 2)")
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="rounds, each with its own system prompt")
    p.add_argument("--new-tokens", type=int, default=4, help="greedy tokens per session, compared on/off")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's setting)")
    p.add_argument("--kv-views", default=KV_VIEWS_DEFAULT, choices=KV_VIEWS)
    p.add_argument(
        "--routing",
        action="store_true",
        help="cache-aware routing over two workers (a real cluster) against placement by load alone",
    )
    p.add_argument("--waves", type=int, default=6, help="--routing: waves of two sessions")
    p.add_argument("--json", metavar="FILE", help="also write the row as JSON to FILE")
    a = p.parse_args(argv)
    if a.routing:
        row = measure_routing(a.model, max(a.waves, 2), a.system_tokens, a.new_tokens)
        print(" | ".join(row))
        print(" | ".join(str(v) for v in row.values()))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(row, f, indent=2)
                f.write("\n")
        return 0 if row["tokens_equal"] else 1
    if a.sessions < 2 or min(a.system_tokens, a.new_tokens, a.rounds) < 1:
        p.error("--sessions must be at least 2; --system-tokens, --new-tokens and --rounds at least 1")
    row = measure(a.model, a.sessions, a.system_tokens, a.new_tokens, a.device, a.threads, a.kv_views, a.rounds)
    cols = [
        "model",
        "device",
        "sessions",
        "system_tokens",
        "cached_tokens_mean",
        "ttft_off_ms_median",
        "ttft_on_ms_median",
        "ttft_ratio_off_over_on",
        "paired_ratio_median",
        "hit_rate",
        "tokens_equal",
    ]
    print(" | ".join(cols))
    print(" | ".join(str(row[c]) for c in cols))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=2)
            f.write("\n")
    return 0 if row["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
