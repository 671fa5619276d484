"""The benchmark's workload: seeded sessions of mixed prompt and output lengths, as token ids.

One list is drawn once per run; every system measured at a concurrency gets the same first
``n`` sessions of it, so the cluster and the peer see identical prompts and output lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Ids below this are control tokens in most vocabularies (SmolLM2's are < 17); prompts avoid them.
_FIRST_PLAIN_ID = 100


@dataclass(frozen=True)
class Session:
    prompt: tuple[int, ...]
    max_new_tokens: int  # generated in full: EOS is ignored


@dataclass(frozen=True)
class WorkloadSpec:
    prompt_tokens: tuple[int, int] = (16, 256)  # inclusive range, uniform
    output_tokens: tuple[int, int] = (16, 128)
    seed: int = 0

    def __post_init__(self) -> None:
        for lo, hi in (self.prompt_tokens, self.output_tokens):
            if not 1 <= lo <= hi:
                raise ValueError(f"a length range needs 1 <= low <= high, got ({lo}, {hi})")


def mixed_sessions(n: int, vocab_size: int, spec: WorkloadSpec = WorkloadSpec()) -> list[Session]:
    if vocab_size <= _FIRST_PLAIN_ID + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for plain-token prompts")
    rng = np.random.default_rng(spec.seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1))
        prompt = rng.integers(_FIRST_PLAIN_ID, vocab_size, size=length)
        new = int(rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1))
        out.append(Session(tuple(int(t) for t in prompt), new))
    return out
