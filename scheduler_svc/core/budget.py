"""A tick's prefill token budget: the scheduler's, and each present workload's own."""

from __future__ import annotations

from collections.abc import Mapping


class PrefillBudget:
    """The tick's prefill token budget, and each present workload's own."""

    def __init__(self, total: int, per_workload: Mapping[str, int]) -> None:
        self._total = total
        self._per_workload = dict(per_workload)

    @property
    def exhausted(self) -> bool:
        return self._total <= 0

    def room(self, workload_id: str | None) -> int:
        if workload_id is not None and workload_id in self._per_workload:
            return min(self._total, self._per_workload[workload_id])
        return self._total

    def spend(self, workload_id: str | None, tokens: int) -> None:
        self._total -= tokens
        if workload_id is not None and workload_id in self._per_workload:
            self._per_workload[workload_id] -= tokens
