"""Sizing the KV pool by memory (worker_svc/kv_memory.py)."""

from __future__ import annotations

import pytest

from worker_svc.config import WorkerConfig
from worker_svc.kv_memory import blocks_for, parse_memory


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
