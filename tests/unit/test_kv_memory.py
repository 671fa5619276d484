"""Sizing the KV pool by memory (worker_svc/kv_memory.py)."""

from __future__ import annotations

import pytest

from worker_svc.config import WorkerConfig
from worker_svc.kv_memory import (
    DEFAULT_MAX_BLOCKS,
    DEFAULT_POOL_BYTES,
    DEFAULT_POOL_FRACTION,
    blocks_for,
    default_pool_bytes,
    parse_memory,
    plan_pool,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 2**30),
        ("512MB", 512 * 10**6),
        ("1073741824", 2**30),
        ("1.5 gib", int(1.5 * 2**30)),
        ("64kib", 65536),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


def test_a_fraction_is_of_the_memory_available() -> None:
    assert parse_memory("0.25", available=8 * 2**30) == 2 * 2**30
    with pytest.raises(ValueError, match="reports no available memory"):
        parse_memory("0.5", available=0)


@pytest.mark.parametrize("bad", ["", "lots", "12XB", "-1GiB", "1.5", "2 GiB extra"])
def test_bad_sizes_say_what_is_accepted(bad: str) -> None:
    with pytest.raises(ValueError, match="kv cache memory"):
        parse_memory(bad)


def test_blocks_that_fit_and_none_at_all() -> None:
    assert blocks_for(10 * 16 * 100 + 99, block_size=16, kv_bytes_per_token=100) == 10
    with pytest.raises(ValueError, match="holds no block"):
        blocks_for(16 * 100 - 1, block_size=16, kv_bytes_per_token=100)


def test_the_worker_refuses_a_bad_size_at_start() -> None:
    with pytest.raises(ValueError, match="got 'twelve'"):
        WorkerConfig(kv_cache_memory="twelve")


GIB = 2**30
SMOLLM2_KV = 2 * 30 * 3 * 64 * 4  # bytes a token: K and V x layers x kv heads x head_dim x float32


@pytest.mark.parametrize(
    "available, expected",
    [
        (64 * GIB, DEFAULT_POOL_BYTES),  # a server: the fixed size
        (2 * GIB, int(DEFAULT_POOL_FRACTION * 2 * GIB)),  # a small laptop: a share of what is free
        (0, DEFAULT_POOL_BYTES),  # the system does not say
    ],
)
def test_the_default_pool_is_the_smaller_of_a_size_and_a_share_of_free_memory(available: int, expected: int) -> None:
    assert default_pool_bytes(available) == expected
    assert default_pool_bytes(available) <= DEFAULT_POOL_BYTES


def test_the_default_pool_of_a_real_model_fits_its_memory() -> None:
    plan = plan_pool(0, "", 16, SMOLLM2_KV, available=64 * GIB)
    assert plan.source == "default"
    assert plan.pool_bytes <= DEFAULT_POOL_BYTES < plan.pool_bytes + 16 * SMOLLM2_KV  # as many as fit
    assert plan.num_blocks < DEFAULT_MAX_BLOCKS  # the old fixed 4096 blocks were 3 GB here
    laptop = plan_pool(0, "", 16, SMOLLM2_KV, available=2 * GIB)
    assert laptop.pool_bytes <= DEFAULT_POOL_FRACTION * 2 * GIB and laptop.num_blocks < plan.num_blocks


def test_a_small_model_s_default_pool_is_capped_in_blocks() -> None:
    plan = plan_pool(0, "", 16, kv_bytes_per_token=64, available=64 * GIB)
    assert plan.num_blocks == DEFAULT_MAX_BLOCKS


@pytest.mark.parametrize(
    "num_blocks, memory, blocks, source",
    [
        (100, "", 100, "--num-blocks"),
        (100, "1MiB", 2**20 // (16 * 1024), "--kv-cache-memory 1MiB"),  # memory wins, as before
        (0, "0.5", 4 * GIB // (16 * 1024) // 2, "--kv-cache-memory 0.5"),  # of the memory given
    ],
)
def test_a_setting_overrides_the_default(num_blocks: int, memory: str, blocks: int, source: str) -> None:
    plan = plan_pool(num_blocks, memory, 16, kv_bytes_per_token=1024, available=4 * GIB)
    assert (plan.num_blocks, plan.source) == (blocks, source)
    assert plan.pool_bytes == blocks * 16 * 1024


def test_a_default_pool_without_room_for_a_block_is_an_error() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        plan_pool(0, "", 16, kv_bytes_per_token=2**20, available=16 * 2**20)
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        plan_pool(-1, "", 16, kv_bytes_per_token=64)
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        WorkerConfig(num_blocks=-1)
