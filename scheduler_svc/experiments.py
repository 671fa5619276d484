"""A/B experiment levers: what each arm of a lever asks the workers to do, and which workload
runs under which arm."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# What each lever's arms mean on the workers (the StepRequest's kv_views).
LEVERS: dict[str, dict[str, str]] = {
    "persistent_kv_views": {"control": "rebuild", "candidate": "persistent"},
}


@dataclass(frozen=True)
class ExperimentArm:
    experiment_id: str
    arm: str
    lever: str

    def __post_init__(self) -> None:
        if not self.experiment_id:
            raise ValueError("experiment.id is empty; name the experiment")
        if self.lever not in LEVERS:
            raise ValueError(f"unknown lever {self.lever!r}; known: {', '.join(sorted(LEVERS))}")
        if self.arm not in LEVERS[self.lever]:
            raise ValueError(f"experiment arm must be control or candidate, got {self.arm!r}")

    @property
    def kv_views(self) -> str:
        return LEVERS[self.lever][self.arm]

    def attributes(self) -> dict[str, str]:
        return {"experiment.id": self.experiment_id, "experiment.arm": self.arm, "experiment.lever": self.lever}


class ExperimentArms:
    """Which running workload is an arm of which experiment."""

    def __init__(self) -> None:
        self._by_workload: dict[str, ExperimentArm] = {}

    def start(self, workload_id: str, arm: ExperimentArm | None) -> None:
        if arm is not None:
            self._by_workload[workload_id] = arm

    def end(self, workload_id: str) -> None:
        self._by_workload.pop(workload_id, None)

    def of_workload(self, workload_id: str | None) -> ExperimentArm | None:
        return self._by_workload.get(workload_id) if workload_id is not None else None

    def shared(self, workload_ids: Iterable[str | None]) -> ExperimentArm | None:
        """The arm every one of these workloads runs under, or None (mixed, or no experiment)."""
        arms = {self.of_workload(w) for w in workload_ids}
        return arms.pop() if len(arms) == 1 else None
