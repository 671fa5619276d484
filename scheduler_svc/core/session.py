"""The scheduler's bookkeeping for one session."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from scheduler_svc.core.types import FinishReason, SessionRequest


class Phase(str, Enum):
    QUEUED = "queued"
    PREFILL = "prefill"  # admitted; prompt (or recompute context) going into the KV in chunks
    DECODE = "decode"  # prefilled in an earlier tick; one token a tick
    FINISHED = "finished"


@dataclass
class Session:
    session_id: str
    request: SessionRequest
    workload_id: str | None
    seq: int  # arrival order (FCFS)
    phase: Phase = Phase.QUEUED
    worker_id: str | None = None  # where its KV is reserved while it runs
    generated: list[int] = field(default_factory=list)
    kv_tokens: int = 0  # tokens held on the worker, as it reported
    cached_tokens: int = 0  # of the current prefill, tokens whose KV was found in a prefix cache
    prefill_target: tuple[int, ...] = ()  # what the current prefill puts into the KV
    finish_reason: FinishReason | None = None
    admitted_tick: int = 0
    moves: int = 0  # recomputes after its worker or its step failed (capped: max_moves)
    # Bumped whenever the session leaves its worker (requeued or closed): a result of work
    # planned before that is stale (with overlapped scheduling one tick may still be out).
    epoch: int = 0

    def copy(self) -> Session:
        """A shallow copy (`generated` and the request shared), for a planning draft: cheaper
        than copy.copy, which a tick would call once per running session."""
        new = object.__new__(Session)
        new.__dict__.update(self.__dict__)
        return new

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def worst_case_tokens(self) -> int:
        # The last generated token never enters the KV.
        return self.prompt_len + self.request.max_new_tokens - 1

    @property
    def running(self) -> bool:
        return self.phase in (Phase.PREFILL, Phase.DECODE)

    @property
    def done_generating(self) -> bool:
        return len(self.generated) >= self.request.max_new_tokens

    @property
    def salt(self) -> bytes:
        """Its prefix-cache namespace: blocks are shared only between sessions of one caller,
        so that one tenant cannot time another's prompts (anonymous callers are one)."""
        return self.request.owner.encode()

    def next_prefill(self) -> tuple[int, ...]:
        # A fresh session prefills its prompt; a recomputed one its prompt plus what it generated,
        # so its next token is sampled exactly where it left off.
        return self.request.prompt_ids + tuple(self.generated)

    def start_prefill(self, cached_tokens: int = 0) -> None:
        """Admitted: its prefill begins; `cached_tokens` of it were found in a prefix cache."""
        self.prefill_target = self.next_prefill()
        self.kv_tokens = 0
        self.cached_tokens = cached_tokens  # a recompute is a new prefill: its own cache hits
        self.phase = Phase.PREFILL

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of its sequence: the prompt, then what it generated."""
        prompt = self.request.prompt_ids
        out = list(prompt[start:end])
        if end > len(prompt):
            out += self.generated[max(start - len(prompt), 0) : end - len(prompt)]
        return out
