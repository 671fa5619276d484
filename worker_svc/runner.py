"""The step runner: from the engine's admitted items to the model's input tensors and back.

The engine decides what runs (admission against the KV books) and samples; the model
computes; this module sits between them. It orders the items the way attention groups want
them (multi-token items first), asks the KV views for the step's groups, builds the index
tensors and additive masks once per step (``StepTensors``, shared by every layer), runs the
forward and puts the logits back in the engine's order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvfleet_common.records import record
from kvfleet_models.config import LlamaConfig
from worker_svc.kv_cache import AttnGroup, BatchLayout, KVViews, PagedKVCache, RebuildViews
from worker_svc.model.fused import StepRows
from worker_svc.model.llama import TORCH_ATTENTION_NEVER, GroupTensors, LlamaModel, PhaseTimes, StepTensors


@record
class RunItem:
    """One admitted item, as the runner needs it: its new tokens and where they go."""

    session_id: str
    tokens: tuple[int, ...]  # new tokens this step (a prefill chunk, or one decode token)
    start: int  # tokens of the session already cached before this step
    slots: tuple[int, ...]  # paged-cache slot of each new token
    blocks: tuple[int, ...]  # the session's block table after this step's append
    sample: bool  # whether the logits of the item's last token are wanted


def _group_tensors(
    g: AttnGroup,
    layout: BatchLayout,
    offsets: np.ndarray,
    num_kv_heads: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    host_blas: bool,
    torch_items: int,
    torch_decode_items: int,
    window: int = 0,
) -> GroupTensors:
    """``window``: keys a query sees, itself included (0: every key up to its position)."""
    items = list(g.items)
    starts = np.array([layout.starts[i] for i in items])
    lengths = np.array([layout.lengths[i] for i in items])
    b, q, s = len(items), int(lengths.max()), g.kv_len
    att = np.arange(b) if g.perm is None else np.array(g.perm)  # attention row of each item
    pad_index = None
    if q > 1 or g.perm is not None:
        pad_index = torch.from_numpy(np.concatenate([r * q + np.arange(n) for r, n in zip(att, lengths)])).to(device)
    # Query i of an item sits at position start + i; a padding query (i >= n) copies the last
    # real query's mask so that no row is all-masked (which would make NaNs, harmless but noisy).
    query_pos = np.empty((b, q), dtype=np.int64)
    query_pos[att] = starts[:, None] + np.minimum(np.arange(q)[None, :], lengths[:, None] - 1)
    keys = np.arange(s)[None, None, :]
    allowed = keys <= query_pos[:, :, None]  # [B, Q, S]
    # A sliding window hides the keys before it (HF: key > query - window). They stay in the
    # cache and the views (the mask drops them), so windowed and full layers share one layout.
    cut = bool(window) and int(query_pos.max()) >= window
    if cut:
        allowed &= keys > query_pos[:, :, None] - window
    mask = None if allowed.all() else np.where(allowed, 0.0, -np.inf).astype(np.float32)
    bias = None
    if not host_blas or b >= (torch_items if q > 1 else torch_decode_items):  # attention on torch's bmm
        m = torch.zeros((b, q, s)) if mask is None else torch.from_numpy(mask)
        m = m.to(device, dtype)
        if g.order == "bh":
            m = m.view(b, 1, 1, q, s).expand(b, num_kv_heads, group_size, q, s)
        else:
            m = m.view(1, b, 1, q, s).expand(num_kv_heads, b, group_size, q, s)
        bias = m.reshape(b * num_kv_heads, group_size * q, s)
    kv_lens = kv_firsts = None
    # A key is visible up to the query's own position, and under a window that cuts, from
    # the window's first (the fused decode attention reads keys [first, len) of each item).
    if q == 1 and mask is not None:
        kv_lens = torch.from_numpy(np.ascontiguousarray(query_pos[:, 0] + 1))
        assert int(kv_lens.max()) <= s
        if cut:
            kv_firsts = torch.from_numpy(np.ascontiguousarray(np.maximum(query_pos[:, 0] + 1 - window, 0)))
    start, stop = int(offsets[items[0]]), int(offsets[items[-1] + 1])
    return GroupTensors(
        group=g,
        rows=slice(start, stop),
        batch=b,
        query_len=q,
        pad_index=pad_index,
        mask=mask,
        bias=bias,
        kv_lens=kv_lens,
        kv_firsts=kv_firsts,
    )


def step_tensors(
    cfg: LlamaConfig,
    layout: BatchLayout,
    groups: list[AttnGroup],
    tokens: list[int],
    slots: list[int],
    sample_items: list[int],
    dtype: torch.dtype,
    device: torch.device,
    host_blas: bool = False,
    torch_items: int = TORCH_ATTENTION_NEVER,
    torch_decode_items: int = TORCH_ATTENTION_NEVER,
) -> StepTensors:
    """Host-side preparation of a step: index tensors and per-group masks (and, for the
    groups whose attention runs on torch's bmm, biases: every group unless ``host_blas``,
    else those of at least ``torch_items`` items, ``torch_decode_items`` for one-token groups),
    once for the layers that see every key and once for the windowed ones (each only if some
    layer reads it)."""
    lengths = np.asarray(layout.lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.repeat(np.asarray(layout.starts) - offsets[:-1], lengths) + np.arange(offsets[-1])

    def dev(a: object) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

    g = cfg.num_heads // cfg.num_kv_heads
    windows = {cfg.window(i) for i in range(cfg.num_layers)}

    def masked(window: int) -> tuple[GroupTensors, ...]:
        if window not in windows:  # no layer reads them
            return ()
        return tuple(
            _group_tensors(
                x, layout, offsets, cfg.num_kv_heads, g, dtype, device, host_blas, torch_items, torch_decode_items,
                window,
            )
            for x in groups
        )  # fmt: skip

    return StepTensors(
        tokens=dev(tokens),
        positions=dev(positions),
        slots=dev(slots),
        groups=masked(0),
        sample_rows=dev(offsets[np.asarray(sample_items, dtype=np.int64) + 1] - 1),
        window_groups=masked(cfg.sliding_window) if cfg.sliding_window else (),
    )


def _whole_step(model: LlamaModel, cache: PagedKVCache, admitted: Sequence[RunItem], times: PhaseTimes) -> torch.Tensor:
    """``run_step`` as one C call (``LlamaModel.whole_step``): no groups, masks or reordering,
    as every token is a row of its own, with its item's blocks and its own count of keys."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    pages: list[int] = []
    sample_rows: list[int] = []
    width = max(len(a.blocks) for a in admitted)
    for a in admitted:
        n = len(a.tokens)
        tokens += a.tokens
        positions += range(a.start, a.start + n)
        slots += a.slots
        pages += (list(a.blocks) + [0] * (width - len(a.blocks))) * n
        if a.sample:
            sample_rows.append(len(tokens) - 1)
    meta = np.array(tokens + positions + slots + pages, dtype=np.int64)
    logits = model.whole_step(cache, StepRows(meta, len(tokens), width, cache.block_size), times)
    if len(sample_rows) == len(tokens):
        return logits
    return logits[torch.tensor(sample_rows, dtype=torch.int64)]


def run_step(
    model: LlamaModel,
    cache: PagedKVCache,
    views: KVViews,
    admitted: Sequence[RunItem],
    times: PhaseTimes,
    sync: bool = False,
) -> torch.Tensor:
    """One forward over ``admitted`` (non-empty); returns logits [N, V] on the device, row k
    for the k-th item of ``admitted`` whose ``sample`` is set."""
    if isinstance(views, RebuildViews) and model.whole_step_fits(sum(len(a.tokens) for a in admitted)):
        return _whole_step(model, cache, admitted, times)
    # Attention groups want multi-token items first, then one-token items.
    order = sorted(range(len(admitted)), key=lambda i: len(admitted[i].tokens) == 1)
    items = [admitted[i] for i in order]
    layout = BatchLayout(
        session_ids=tuple(a.session_id for a in items),
        starts=tuple(a.start for a in items),
        lengths=tuple(len(a.tokens) for a in items),
        block_tables=tuple(a.blocks for a in items),
        num_multi=sum(1 for a in items if len(a.tokens) > 1),
    )
    groups = views.begin_step(layout)
    sampled = [j for j, a in enumerate(items) if a.sample]
    st = step_tensors(
        model.cfg,
        layout,
        groups,
        tokens=[t for a in items for t in a.tokens],
        slots=[s for a in items for s in a.slots],
        sample_items=sampled,
        dtype=model.act_dtype,
        device=model.device,
        host_blas=model.host_attention,
        torch_items=model.torch_attention_items,
        torch_decode_items=model.torch_decode_items,
    )
    logits = model.forward(st, cache, views, times, sync=sync)
    # Back to admitted order: row k of the result is the k-th sampled item of ``admitted``.
    rank = {order[j]: r for r, j in enumerate(sampled)}
    back = [rank[i] for i, a in enumerate(admitted) if a.sample]
    if back != list(range(len(back))):
        logits = logits[torch.tensor(back, device=logits.device)]
    return logits
