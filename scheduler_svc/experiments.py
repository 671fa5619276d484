"""A/B experiment levers: what each arm of a lever asks the workers to do, and which workload
runs under which arm."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfleet_common.security import DuplicateMetadata, same_secret, single_metadata

# Metadata a caller sends to tag workloads with an experiment (KVFLEET_EXPERIMENT_TOKEN's value).
EXPERIMENT_TOKEN_HEADER = "x-kvfleet-experiment-token"
MIN_EXPERIMENT_TOKEN_CHARS = 16

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

    def __bool__(self) -> bool:
        """Whether any running workload is an arm."""
        return bool(self._by_workload)

    def of_workload(self, workload_id: str | None) -> ExperimentArm | None:
        return self._by_workload.get(workload_id) if workload_id is not None else None

    def shared(self, workload_ids: Iterable[str | None]) -> ExperimentArm | None:
        """The arm every one of these workloads runs under, or None (mixed, or no experiment)."""
        arms = {self.of_workload(w) for w in workload_ids}
        return arms.pop() if len(arms) == 1 else None


@dataclass(frozen=True)
class ExperimentWriters:
    """Who may tag a workload with an experiment. A tagged workload's spans and arm decide an A/B
    experiment, so a stranger's tag could skew someone's decision (or make a lever flip on the
    workers). The rule:
      - a caller whose client certificate's common name is in `names` may;
      - a caller sending `token` in the x-kvfleet-experiment-token metadata may;
      - with neither configured, any caller may on a scheduler that listens on loopback only (one
        host, as `kvfleet up` runs it), and no caller may on one that listens beyond it."""

    token: str = field(default="", repr=False)  # KVFLEET_EXPERIMENT_TOKEN; kept out of logs
    names: frozenset[str] = frozenset()  # KVFLEET_EXPERIMENT_WRITERS: certificate common names
    loopback_only: bool = True  # the scheduler listens on loopback only

    def __post_init__(self) -> None:
        if self.token and len(self.token) < MIN_EXPERIMENT_TOKEN_CHARS:
            raise ValueError(
                f"KVFLEET_EXPERIMENT_TOKEN must be at least {MIN_EXPERIMENT_TOKEN_CHARS} characters "
                f"(got {len(self.token)}); make one with: python -c 'import secrets; print(secrets.token_hex(16))'"
            )

    @property
    def configured(self) -> bool:
        return bool(self.token or self.names)

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None, peer_names: set[str]) -> str | None:
        """None when this caller may tag a workload with an experiment, else why not and what to do."""
        if peer_names & self.names:
            return None
        try:
            sent = single_metadata(metadata, EXPERIMENT_TOKEN_HEADER)
        except DuplicateMetadata as exc:
            return str(exc)
        if self.token and sent is not None and same_secret(sent, self.token):
            return None
        if not self.configured:
            if self.loopback_only:
                return None
            return (
                "this scheduler listens beyond loopback and has no experiment writers configured, so no "
                "caller may tag a workload with an experiment; set KVFLEET_EXPERIMENT_TOKEN on the scheduler "
                f"and send it as '{EXPERIMENT_TOKEN_HEADER}' metadata (kvfleet experiment does so from "
                "$KVFLEET_EXPERIMENT_TOKEN), or list certificate names in KVFLEET_EXPERIMENT_WRITERS"
            )
        how = []
        if self.token:
            how.append(f"send the experiment token as '{EXPERIMENT_TOKEN_HEADER}' metadata")
        if self.names:
            how.append("call with a client certificate named in KVFLEET_EXPERIMENT_WRITERS")
        why = "a wrong experiment token" if sent else "no experiment credential"
        return f"{why}: only experiment writers may tag a workload with an experiment; {' or '.join(how)}"
