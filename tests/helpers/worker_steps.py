"""Raw Worker.Step items for tests that talk to a worker without a scheduler: the block ids the
scheduler would send (it owns the block tables), given as a run of distinct blocks per session."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.v1 import worker_pb2 as wpb


def block_run(tokens: int, first: int = 0, block_size: int = 16) -> list[int]:
    """Blocks first, first + 1, ... enough for `tokens` tokens."""
    return list(range(first, first + -(-tokens // block_size)))


def prefill_item(session_id: str, token_ids: Sequence[int], first_block: int = 0, block_size: int = 16, **kw):
    """A prompt's only chunk (position 0, last), with blocks for it from `first_block` on."""
    return wpb.PrefillItem(
        session_id=session_id,
        token_ids=list(token_ids),
        last_chunk=True,
        block_ids=block_run(len(token_ids), first_block, block_size),
        **kw,
    )
