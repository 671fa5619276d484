"""Declarative gates over span comparisons. Pure: no I/O beyond reading the packaged default.

A gate spec is JSON:

    {"schema": "kvfleet-gate-spec-v1",          # optional
     "min_samples_per_arm": 5,                  # optional, default 5
     "gates": [{"name": ..., "kind": ..., "span": ..., "alpha": 0.05, "tolerance": 0.0,
                "min_samples": 5}, ...]}        # alpha, tolerance, min_samples optional

(a bare list of gates is accepted too). Kinds, with savings = control - candidate:

- positive_median_saving: median saving > tolerance * control median, and Mann-Whitney p < alpha;
- positive_saving: mean saving > tolerance * control mean, and p < alpha. Meant for whole-run
  spans (one per repeat, e.g. generation_wall) where every slow run counts, not just the middle;
- p90_non_regression: candidate p90 <= control p90 * (1 + tolerance) (no significance needed:
  it is a bound, not a claim of improvement);
- no_cost_transfer: fails only on a significant regression: -median saving > tolerance * control
  median and p < alpha (a phase that silently absorbed the saved time).

A gate whose span has fewer than min_samples durations in either arm is not evaluated (its
verdict is None). No multiplicity correction: authorization needs every gate to pass, and the
intersection of tests each at level alpha is itself a level-alpha test of "all improved".
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, Mapping

from telemetry_svc.stats import Comparison

SPEC_SCHEMA = "kvfleet-gate-spec-v1"
DEFAULT_MIN_SAMPLES = 5


class InvalidGateSpec(ValueError):
    """A gate spec that cannot be used; the message says what is wrong."""


class GateKind(str, enum.Enum):
    POSITIVE_MEDIAN_SAVING = "positive_median_saving"
    POSITIVE_SAVING = "positive_saving"
    P90_NON_REGRESSION = "p90_non_regression"
    NO_COST_TRANSFER = "no_cost_transfer"


@dataclass(frozen=True)
class Gate:
    name: str
    kind: GateKind
    span: str
    alpha: float = 0.05
    tolerance: float = 0.0  # a fraction of the control statistic
    min_samples: int | None = None  # None: the spec's min_samples_per_arm

    def __post_init__(self) -> None:
        if not self.name or not self.span:
            raise InvalidGateSpec("every gate needs a name and a span")
        if not 0.0 < self.alpha < 1.0:
            raise InvalidGateSpec(f"gate {self.name}: alpha must be in (0, 1), got {self.alpha}")
        if self.tolerance < 0.0:
            raise InvalidGateSpec(f"gate {self.name}: tolerance must be >= 0, got {self.tolerance}")
        if self.min_samples is not None and self.min_samples < 2:
            raise InvalidGateSpec(f"gate {self.name}: min_samples must be >= 2")


@dataclass(frozen=True)
class GateSpec:
    gates: tuple[Gate, ...]
    min_samples_per_arm: int = DEFAULT_MIN_SAMPLES

    def __post_init__(self) -> None:
        if not self.gates:
            raise InvalidGateSpec("a gate spec needs at least one gate")
        names = [g.name for g in self.gates]
        if len(set(names)) != len(names):
            raise InvalidGateSpec(f"gate names must be unique: {names}")
        if self.min_samples_per_arm < 2:
            raise InvalidGateSpec("min_samples_per_arm must be >= 2")

    @property
    def spans(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.span for g in self.gates))

    def min_samples(self, gate: Gate) -> int:
        return gate.min_samples if gate.min_samples is not None else self.min_samples_per_arm

    def to_json_obj(self) -> dict[str, Any]:
        gates = []
        for g in self.gates:
            d = {k: v for k, v in asdict(g).items() if v is not None}
            d["kind"] = g.kind.value
            gates.append(d)
        return {"schema": SPEC_SCHEMA, "min_samples_per_arm": self.min_samples_per_arm, "gates": gates}

    def sha256(self) -> str:
        """Digest of the canonical JSON (sorted keys, no spaces): independent of formatting."""
        text = json.dumps(self.to_json_obj(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _gate_from_obj(obj: Any) -> Gate:
    if not isinstance(obj, dict):
        raise InvalidGateSpec("each gate must be a JSON object")
    unknown = set(obj) - {"name", "kind", "span", "alpha", "tolerance", "min_samples"}
    if unknown:
        raise InvalidGateSpec(f"gate {obj.get('name')!r}: unknown fields {sorted(unknown)}")
    try:
        kind = GateKind(obj.get("kind"))
    except ValueError:
        kinds = [k.value for k in GateKind]
        raise InvalidGateSpec(f"gate {obj.get('name')!r}: kind must be one of {kinds}") from None
    try:
        alpha = float(obj.get("alpha", 0.05))
        tolerance = float(obj.get("tolerance", 0.0))
        ms = obj.get("min_samples")
        min_samples = None if ms is None else int(ms)
    except (TypeError, ValueError):
        raise InvalidGateSpec(f"gate {obj.get('name')!r}: alpha, tolerance, min_samples must be numbers") from None
    return Gate(str(obj.get("name", "")), kind, str(obj.get("span", "")), alpha, tolerance, min_samples)


def parse_gate_spec(text: str) -> GateSpec:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidGateSpec(f"gate spec is not JSON: {exc.msg} at line {exc.lineno}") from None
    if isinstance(obj, list):
        obj = {"gates": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("gates"), list):
        raise InvalidGateSpec("gate spec must be a list of gates or an object with a 'gates' list")
    if obj.get("schema", SPEC_SCHEMA) != SPEC_SCHEMA:
        raise InvalidGateSpec(f"unsupported gate spec schema {obj.get('schema')!r}")
    try:
        min_samples = int(obj.get("min_samples_per_arm", DEFAULT_MIN_SAMPLES))
    except (TypeError, ValueError):
        raise InvalidGateSpec("min_samples_per_arm must be an integer") from None
    return GateSpec(tuple(_gate_from_obj(g) for g in obj["gates"]), min_samples)


def load_default_spec() -> GateSpec:
    text = resources.files("telemetry_svc").joinpath("default_gates.json").read_text(encoding="utf-8")
    return parse_gate_spec(text)


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    passed: bool | None  # None: not evaluated (too few samples)
    reason: str


def evaluate_gate(gate: Gate, c: Comparison | None, min_samples: int) -> GateResult:
    n_c = c.n_control if c else 0
    n_k = c.n_candidate if c else 0
    if c is None or min(n_c, n_k) < min_samples:
        return GateResult(gate, None, f"{gate.span}: n_control={n_c}, n_candidate={n_k}, need >= {min_samples} per arm")
    p, a, tol = c.mann_whitney_p, gate.alpha, gate.tolerance
    sig = f"p={p:.3g} {'<' if p < a else '>='} alpha={a}"
    if gate.kind is GateKind.POSITIVE_MEDIAN_SAVING:
        floor = tol * c.control_median
        ok = c.median_saving > floor and p < a
        return GateResult(gate, ok, f"median saving {c.median_saving:.0f} ns (need > {floor:.0f}), {sig}")
    if gate.kind is GateKind.POSITIVE_SAVING:
        floor = tol * c.control_mean
        ok = c.mean_saving > floor and p < a
        return GateResult(gate, ok, f"mean saving {c.mean_saving:.0f} ns (need > {floor:.0f}), {sig}")
    if gate.kind is GateKind.P90_NON_REGRESSION:
        bound = c.control_p90 * (1.0 + tol)
        ok = c.candidate_p90 <= bound
        return GateResult(gate, ok, f"candidate p90 {c.candidate_p90:.0f} ns vs bound {bound:.0f}")
    # NO_COST_TRANSFER
    allowed = tol * c.control_median
    regressed = -c.median_saving > allowed and p < a
    return GateResult(
        gate, not regressed, f"median regression {-c.median_saving:.0f} ns (allowed {allowed:.0f}), {sig}"
    )


def evaluate(spec: GateSpec, comparisons: Mapping[str, Comparison]) -> tuple[GateResult, ...]:
    return tuple(evaluate_gate(g, comparisons.get(g.span), spec.min_samples(g)) for g in spec.gates)
