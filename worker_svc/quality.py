"""Teacher-forced quality of an engine: over a fixed token sequence, each position's top-1
prediction and the negative log-likelihood of the true next token.

Comparing two engines (float32 and a quantized or bfloat16 one) on the same sequence gives
top-1 agreement (how often their greedy choice is the same) and the perplexity ratio
(exp of the mean NLL difference). Runs the sequence through the engine's own paged cache in
prefill chunks, so it measures the path the worker serves, not a separate forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvfleet_common.kv_blocks import BlockTables, OutOfBlocks
from worker_svc.engine import Engine
from worker_svc.kv_cache import BatchLayout
from worker_svc.model.llama import PhaseTimes
from worker_svc.runner import step_tensors


@dataclass(frozen=True)
class TeacherForced:
    top1: np.ndarray  # [n - 1] the engine's argmax after each prefix
    nll: np.ndarray  # [n - 1] -log p(token[i + 1] | token[:i + 1]), float64


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1_agreement: float  # fraction of positions where both engines' argmax is the same
    ppl_base: float
    ppl_test: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_test / self.ppl_base


def teacher_forced(
    engine: Engine, token_ids: Sequence[int], chunk: int = 512, session_id: str = "teacher-forced"
) -> TeacherForced:
    """Every position's logits of ``token_ids`` (one session, chunks of ``chunk`` tokens)."""
    model, ids = engine.model, list(token_ids)
    top1: list[np.ndarray] = []
    nll: list[np.ndarray] = []
    engine.release([session_id])
    # The blocks of one session over the whole pool (the engine must hold no other session).
    tables = BlockTables(engine.config.num_blocks, engine.config.block_size, prefix_caching=False)
    try:
        tables.place(session_id, (), len(ids))
    except OutOfBlocks:
        raise ValueError(f"{len(ids)} tokens do not fit the engine's KV cache") from None
    table, bs = tuple(tables.blocks(session_id)), engine.config.block_size
    try:
        for start in range(0, len(ids) - 1, chunk):
            tokens = ids[start : start + chunk]
            n = len(tokens)
            slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            layout = BatchLayout(
                session_ids=(session_id,),
                starts=(start,),
                lengths=(n,),
                block_tables=(table[: -(-(start + n) // bs)],),
                num_multi=int(n > 1),
            )
            groups = engine.views.begin_step(layout)
            st = step_tensors(
                model.cfg,
                layout,
                groups,
                tokens,
                slots,
                [0],
                model.act_dtype,
                model.device,
                host_blas=model.host_attention,
            )
            st = replace(st, sample_rows=torch.arange(n, device=model.device))  # every row
            logits = model.forward(st, engine.cache, engine.views, PhaseTimes())  # [n, V]
            targets = torch.tensor(ids[start + 1 : start + n + 1])
            part = score(logits[: len(targets)], targets)  # the last chunk's last token has no target
            top1.append(part.top1)
            nll.append(part.nll)
    finally:
        engine.release([session_id])
    return TeacherForced(np.concatenate(top1), np.concatenate(nll))


def score(logits: torch.Tensor, targets: torch.Tensor) -> TeacherForced:
    """Each row's argmax and the NLL of its target: logits [n, V] after each prefix, targets
    [n] the tokens that followed. Shared with bench/quality.py, which scores llama.cpp's logits
    the same way."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # float64: a 2,000-position mean of small NLLs
    nll = -logp.gather(1, targets.to(logits.device)[:, None].long())[:, 0]
    return TeacherForced(torch.argmax(logits, dim=-1).cpu().numpy(), nll.cpu().numpy())


def compare(base: TeacherForced, test: TeacherForced) -> Agreement:
    if len(base.top1) != len(test.top1):
        raise ValueError("the two runs cover different sequences")
    return Agreement(
        positions=len(base.top1),
        top1_agreement=float(np.mean(base.top1 == test.top1)),
        ppl_base=math.exp(float(base.nll.mean())),
        ppl_test=math.exp(float(test.nll.mean())),
    )
