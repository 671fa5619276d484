"""Sampling on the worker: the per-session sampling parameters, the logit processors, the seeded
draw and the log-probabilities reported with each token.

The order in which a row of logits is processed (each step is skipped when off):

  1. logit_bias: each listed token's bias is added to its logit;
  2. repetition_penalty (CTRL / transformers rule) over the prompt and generated tokens of the
     session: a positive logit is divided by the penalty, a negative one multiplied by it;
  3. presence / frequency penalties (OpenAI rule) over the generated tokens only:
     logit -= presence * (count > 0) + frequency * count;
  4. the constraint's mask: tokens it does not allow get -inf;
  5. greedy argmax when temperature == 0; otherwise logits / temperature, then top_k, top_p,
     min_p, and a draw seeded by (seed, index) alone, so neither the batch around a session nor
     a move to another worker changes its tokens.

Log-probabilities are log_softmax over the whole vocabulary of the logits after step 4 (divided
by the temperature when it is > 0), before the top_k / top_p / min_p truncation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvfleet_common import sampling_rules
from worker_svc import failpoints


class TokenConstraint(Protocol):
    """A grammar's state for one session: which token may come next."""

    def allowed_mask(self) -> np.ndarray: ...  # bool [vocab_size], True = may be sampled next

    def accept(self, token_id: int) -> None: ...  # advance by one sampled token

    def is_done(self) -> bool: ...  # a complete value: nothing but EOS may follow


ConstraintFactory = Callable[[str, str], TokenConstraint]  # (kind, schema) -> a fresh state


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0  # 0 = greedy argmax
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    presence_penalty: float = 0.0  # over generated tokens; 0 = off
    frequency_penalty: float = 0.0  # over generated tokens; 0 = off
    repetition_penalty: float = 1.0  # over prompt + generated tokens; 1 = off
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: str = ""  # "" | "json_object" | "json_schema"
    constraint_schema: str = ""

    def __post_init__(self) -> None:
        sampling_rules.validate(self)  # ValueError naming the field and its range

    @property
    def penalises(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_host(self) -> bool:
        """Whether this row's logits must come to the host (anything but a plain argmax)."""
        return bool(self.temperature > 0 or self.penalises or self.logit_bias or self.constraint or self.logprobs)

    def check_vocab(self, vocab_size: int) -> None:
        if self.logit_bias:
            sampling_rules.validate(self, vocab_size)


@dataclass(frozen=True)
class Sampled:
    """One sampled token, with its log-probability and alternatives when they were asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # most likely first; ties by lower id
    constraint_done: bool = False


def _draw_seed(seed: int, index: int) -> int:
    """A seed from (seed, index) alone: stable across processes, unlike ``hash()``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def process_logits(
    logits: torch.Tensor,
    spec: SamplingSpec,
    history: Sequence[int] = (),
    generated: int = 0,
    allowed: np.ndarray | None = None,
) -> torch.Tensor:
    """Steps 1-4 of the module docstring on a host row [V]; returns float64 [V] (a new tensor).

    ``history`` is the session's prompt + generated tokens; its last ``generated`` are the
    generated ones. A mask that allows nothing is ignored rather than leaving no token at all.
    """
    x = logits.detach().to(torch.float64).clone()
    if spec.logit_bias:
        ids = torch.tensor([t for t, _ in spec.logit_bias], dtype=torch.long)
        x[ids] += torch.tensor([b for _, b in spec.logit_bias], dtype=torch.float64)
    if spec.repetition_penalty != 1.0 and history:
        ids = torch.unique(torch.tensor(list(history), dtype=torch.long))
        seen = x[ids]
        x[ids] = torch.where(seen > 0, seen / spec.repetition_penalty, seen * spec.repetition_penalty)
    if (spec.presence_penalty or spec.frequency_penalty) and generated > 0:
        ids, counts = torch.unique(torch.tensor(list(history[-generated:]), dtype=torch.long), return_counts=True)
        x[ids] -= spec.presence_penalty + spec.frequency_penalty * counts.to(torch.float64)
    if allowed is not None and allowed.any():
        x[torch.from_numpy(~allowed.astype(bool))] = float("-inf")
    return x


def draw(x: torch.Tensor, spec: SamplingSpec, index: int) -> int:
    """Step 5 on processed logits [V]: a function of x, spec and index only.

    top_k keeps every token tied with the k-th largest; top_p keeps the smallest prefix of the
    sorted distribution whose mass reaches top_p (always at least the most likely token);
    min_p drops tokens whose probability is below min_p x the most likely one's.
    """
    if spec.temperature == 0.0:
        return int(torch.argmax(x))
    x = x.double() / spec.temperature
    if 0 < spec.top_k < x.numel():
        kth = torch.topk(x, spec.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= spec.top_p  # mass before this token
        x = x.clone()
        x[order[drop]] = float("-inf")
    if spec.min_p > 0.0:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p), in logit space.
        x = x.masked_fill(x < torch.max(x) + math.log(spec.min_p), float("-inf"))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_draw_seed(spec.seed, index))
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen))


def logprobs_of(x: torch.Tensor, spec: SamplingSpec, token: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The token's log-probability under processed logits x [V] (scaled by the temperature when
    it is > 0) and the spec's top_logprobs most likely tokens, ties broken by the lower id."""
    z = x / spec.temperature if spec.temperature > 0 else x
    lp = torch.log_softmax(z.double(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if spec.top_logprobs:
        # Every token at least as likely as the n-th (ties included), then ordered by
        # (logprob desc, id asc): cheaper than sorting the whole vocabulary.
        n = min(spec.top_logprobs, lp.numel())
        kth = torch.topk(lp, n).values[-1]
        ids = torch.nonzero(lp >= kth).flatten()
        ranked = sorted(zip(ids.tolist(), lp[ids].tolist()), key=lambda p: (-p[1], p[0]))
        top = tuple(ranked[:n])
    return float(lp[token]), top


def sample_token(
    logits: torch.Tensor,
    spec: SamplingSpec,
    index: int,
    history: Sequence[int] = (),
    generated: int = 0,
    allowed: np.ndarray | None = None,
) -> int:
    """Process a host row of logits [V] and draw one token (see the module docstring)."""
    return draw(process_logits(logits, spec, history, generated, allowed), spec, index)


class ConstraintRefused(ValueError):
    """The grammar would not take a session's response format (a schema it cannot enforce)."""


class SessionSampling:
    """What the processors need to remember per session: the tokens fed into its KV so far
    (prompt chunks and decode tokens) and its constraint's state.

    The generated tokens of a session at a sampling point are the last ``index`` of its
    history: a session recomputed after a move prefills prompt + generated, so its history
    rebuilds itself, and its constraint is rebuilt by replaying them.
    """

    def __init__(self, constraint_factory: ConstraintFactory | None = None) -> None:
        self.constraint_factory = constraint_factory
        self._history: dict[str, list[int]] = {}
        self._constraints: dict[str, tuple[TokenConstraint, int]] = {}  # (state, tokens accepted)

    def check(self, spec: SamplingSpec, vocab_size: int) -> None:
        """ValueError for a spec this worker cannot serve."""
        spec.check_vocab(vocab_size)
        if spec.constraint and self.constraint_factory is None:
            raise ValueError(
                f"constraint {spec.constraint!r}: this worker has no grammar support; send no response_format"
            )

    def feed(self, session_id: str, tokens: Sequence[int], start: int) -> None:
        """Tokens entering the session's KV at position ``start`` (0 = a session created anew)."""
        if start == 0:
            self._constraints.pop(session_id, None)
        history = self._history.setdefault(session_id, [])
        del history[start:]
        history.extend(tokens)

    def forget(self, session_id: str) -> None:
        self._history.pop(session_id, None)
        self._constraints.pop(session_id, None)

    def history(self, session_id: str) -> list[int]:
        return self._history.get(session_id, [])

    def sample(self, session_id: str, logits: torch.Tensor, spec: SamplingSpec, index: int) -> Sampled:
        """Sample the session's token number ``index`` from its host row of logits [V]."""
        failpoints.check("worker.sample", spec.seed)
        history = self.history(session_id)
        constraint = self._constraint(session_id, spec, index) if spec.constraint else None
        allowed = constraint.allowed_mask() if constraint is not None else None
        x = process_logits(logits, spec, history if spec.penalises else (), index, allowed)
        token = draw(x, spec, index)
        logprob, top = logprobs_of(x, spec, token) if spec.logprobs else (None, ())
        done = False
        if constraint is not None:
            constraint.accept(token)
            self._constraints[session_id] = (constraint, index + 1)
            done = constraint.is_done()
        return Sampled(token, logprob, top, done)

    def _constraint(self, session_id: str, spec: SamplingSpec, index: int) -> TokenConstraint:
        """The session's constraint having accepted exactly its ``index`` generated tokens:
        kept from the last sampling point, else made anew and fed the generated tokens again."""
        held = self._constraints.get(session_id)
        if held is not None and held[1] == index:
            return held[0]
        assert self.constraint_factory is not None, "checked before the step"
        try:
            constraint = self.constraint_factory(spec.constraint, spec.constraint_schema)
        except ValueError as exc:
            raise ConstraintRefused(f"response format refused by the grammar: {exc}") from None
        history = self.history(session_id)
        for token in history[max(len(history) - index, 0) :] if index else ():
            constraint.accept(token)
        return constraint
