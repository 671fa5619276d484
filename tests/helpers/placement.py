"""Which workers served a workload's sessions. A workload's sessions are admitted together, in
one tick, so the scheduler spreads them over its live workers; streams sent one after another
may each find the one before finished and all land on the same worker (a flake under load)."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.client import SchedulerClient
from kvfleet.v1 import scheduler_pb2 as spb


def workload_placement(
    client: SchedulerClient, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[set[str], list[int]]:
    """Run the prompts as one workload (greedy, ignore_eos); returns the workers that served
    them and each session's count of generated tokens."""
    request = spb.WorkloadRequest()
    for prompt in prompts:
        request.sessions.add(prompt_ids=spb.TokenIds(ids=list(prompt)), max_new_tokens=new_tokens, ignore_eos=True)
    workers: set[str] = set()
    tokens = [0] * len(prompts)
    for ev in client.submit_workload(request, timeout=60):
        if ev.done:
            continue
        if ev.event.worker_id:
            workers.add(ev.event.worker_id)
        tokens[ev.session_index] += len(ev.event.token_ids)
    return workers, tokens
