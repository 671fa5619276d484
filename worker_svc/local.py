"""An engine driven in-process the way the scheduler drives a worker: this module keeps the block
tables (the same ``BlockTables`` the scheduler core keeps per worker) and sends every item the
blocks added to its session since the last step. For benchmarks, tools and tests that run an
``Engine`` without a cluster; the scheduler itself never uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from kvfleet_common.kv_blocks import BlockTables, OutOfBlocks, TokenRange
from worker_svc.engine import DecodeItem, Engine, ItemStatus, PrefillItem, StepOutput


def _token_range(seq: list[int]) -> TokenRange:
    return lambda start, end: seq[start:end]


class LocalSteps:
    """``step`` and ``release`` as on an Engine, with the blocks chosen here.

    A prompt's first chunk (position 0) places its session: blocks for the chunk, reusing
    cached full blocks of an earlier session's equal prefix when prefix caching is on (the
    engine's setting unless ``prefix_caching`` says otherwise; only the first chunk is looked
    up, with its own tokens: send a prompt whole to reuse all of its cached prefix); later chunks
    and decodes grow the session block by block. ``OutOfBlocks`` (``kvfleet_common.kv_blocks``)
    is raised when the pool is full, before anything runs and with no session placed by the
    step.
    """

    def __init__(self, engine: Engine, prefix_caching: bool | None = None) -> None:
        self.engine = engine
        cfg = engine.config
        self.tables = BlockTables(
            cfg.num_blocks, cfg.block_size, cfg.prefix_caching if prefix_caching is None else prefix_caching
        )
        self._tokens: dict[str, list[int]] = {}  # each session's tokens in the KV, for the hashes

    def _reserve(self, prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem], salts: Mapping[str, bytes]):
        """Place and grow every item's session, all or none; returns the prefill items' cached
        tokens (placed sessions only)."""
        placed: dict[str, int] = {}
        try:
            for p in prefill:
                sid = p.session_id
                if p.start_position == 0 and not self.tables.has(sid):
                    placed[sid] = self.tables.place(sid, p.token_ids, len(p.token_ids), salts.get(sid, b""))
                elif self.tables.has(sid):
                    self.tables.grow(sid, p.start_position + len(p.token_ids))
            for d in decode:
                if self.tables.has(d.session_id):
                    self.tables.grow(d.session_id, d.position + 1)
        except OutOfBlocks:
            for sid in placed:  # (blocks grown for others stay theirs: sent with a later step)
                self.tables.free(sid)
            raise
        return placed

    def step(
        self,
        prefill: Sequence[PrefillItem] = (),
        decode: Sequence[DecodeItem] = (),
        *,
        salts: Mapping[str, bytes] | None = None,
        **kwargs,
    ) -> StepOutput:
        """Engine.step with block ids filled in; ``salts``: the prefix-cache namespace of sessions
        placed by this step (see ``kvfleet_common.kv_blocks``)."""
        placed = self._reserve(prefill, decode, salts or {})

        def blocks(sid: str) -> tuple[int, ...]:
            return self.tables.unsent(sid) if self.tables.has(sid) else ()

        prefill = [
            replace(p, block_ids=blocks(p.session_id), cached_tokens=placed.get(p.session_id, 0)) for p in prefill
        ]
        decode = [replace(d, block_ids=blocks(d.session_id)) for d in decode]
        try:
            out = self.engine.step(prefill, decode, **kwargs)
        except ValueError:  # a malformed step: the engine changed nothing
            for p in prefill:
                if p.session_id in placed:
                    self.tables.free(p.session_id)
                elif self.tables.has(p.session_id):
                    self.tables.not_taken(p.session_id, len(p.block_ids))
            for d in decode:
                if self.tables.has(d.session_id):
                    self.tables.not_taken(d.session_id, len(d.block_ids))
            raise
        except BaseException:  # the forward faulted: the engine dropped what it admitted; drop all
            sids = [p.session_id for p in prefill] + [d.session_id for d in decode]
            self.engine.release(sids)
            for sid in sids:
                self._forget(sid)
            raise
        items: list[tuple[str, int, Sequence[int], int]] = [
            (p.session_id, p.start_position, p.token_ids, len(p.block_ids)) for p in prefill
        ]
        items += [(d.session_id, d.position, (d.token_id,), len(d.block_ids)) for d in decode]
        for (sid, start, tokens, sent), r in zip(items, out.results):
            if r.status == ItemStatus.OK:
                seq = self._tokens.setdefault(sid, [])
                del seq[start:]
                seq.extend(tokens)
                self.tables.written(sid, r.kv_tokens, _token_range(seq))
            elif r.status in (ItemStatus.REJECTED, ItemStatus.FAILED):
                self._forget(sid)  # the engine freed it
            elif self.tables.has(sid):  # CACHE_MISS: the engine took nothing
                if sid in placed:
                    self.tables.free(sid)
                else:
                    self.tables.not_taken(sid, sent)
        return out

    def _forget(self, session_id: str) -> None:
        self.tables.free(session_id)
        self._tokens.pop(session_id, None)

    def release(self, session_ids: Iterable[str]) -> int:
        session_ids = list(session_ids)
        for sid in session_ids:
            self._forget(sid)
        return self.engine.release(session_ids)
