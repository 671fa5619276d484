"""Driving an engine as a scheduler would: prompts in chunks, decodes beside others' prefills
(the family and GGUF engine tests' common schedule)."""

from __future__ import annotations

import numpy as np

from worker_svc.engine import DecodeItem, Engine, ItemStatus, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps

GREEDY = SamplingSpec()


def drive(engine: Engine, plan: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """The prompts as a scheduler would send them: those over 15 tokens in three chunks, the
    third joining a step late, each decoding alongside the others' prefills (blocks from a LocalSteps). Returns
    each prompt's tokens and the logits [new_tokens, V] they were drawn from."""
    steps = LocalSteps(engine)
    chunks = [[7, 8, len(p) - 15] if len(p) > 15 else [len(p)] for p in plan]
    join = [0, 0, 1] + [0] * (len(plan) - 3)
    sent = [0] * len(plan)
    tokens: list[list[int]] = [[] for _ in plan]
    logits: list[list[np.ndarray]] = [[] for _ in plan]
    for step in range(100):
        prefill, decode = [], []
        for i, p in enumerate(plan):
            if step < join[i] or len(tokens[i]) >= new_tokens:
                continue
            if sent[i] < len(chunks[i]):
                start = sum(chunks[i][: sent[i]])
                chunk = tuple(p[start : start + chunks[i][sent[i]]])
                prefill.append(PrefillItem(str(i), chunk, start, sent[i] == len(chunks[i]) - 1, GREEDY))
                sent[i] += 1
            else:
                pos = len(p) + len(tokens[i]) - 1
                decode.append(DecodeItem(str(i), tokens[i][-1], pos, GREEDY, len(tokens[i])))
        if not prefill and not decode:
            return tokens, [np.stack(rows) for rows in logits]
        out = steps.step(prefill, decode, return_logits=True)
        assert out.logits is not None
        for row, r in enumerate(out.results):
            assert r.status is ItemStatus.OK, r
            if r.token_id is not None:
                tokens[int(r.session_id)].append(r.token_id)
                logits[int(r.session_id)].append(out.logits[row])
    raise AssertionError("the schedule did not finish")
