"""Whether two workers serve the same model, from what each reports of it (pure).

A scheduler reads its tokenizer, its admission bounds and its detokenizing from the workers'
model: a worker serving another model would turn a session placed there into another model's
tokens. What must be equal is the model's shape (vocabulary, layers, heads, widths, its own
context, its end-of-sequence ids); the served context (``--max-model-len``) may differ, the
scheduler admitting by the smallest, and so may the name (one file reached by two paths).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


class WorkersDisagree(RuntimeError):
    """The workers given to one scheduler serve different models (the message says which)."""


@dataclass(frozen=True)
class ServedModel:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    model_max_position: int  # the model's own context, not the served one
    eos_token_ids: tuple[int, ...]

    def differences(self, other: ServedModel) -> list[str]:
        """The shape's fields that differ, each as "field mine vs theirs" (the name aside)."""
        return [
            f"{f.name} {getattr(self, f.name)} vs {getattr(other, f.name)}"
            for f in fields(self)
            if f.name != "name" and getattr(self, f.name) != getattr(other, f.name)
        ]


def fleet_mismatch(models: dict[str, ServedModel]) -> str:
    """Why the workers (worker id -> its model) cannot serve behind one scheduler, naming each
    worker unlike the first and how; "" when they all serve one model."""
    if not models:
        return ""
    (first_id, first), *rest = models.items()
    unlike = [f"{wid} serves {m.name!r} ({', '.join(first.differences(m))})" for wid, m in rest if first.differences(m)]
    if not unlike:
        return ""
    return (
        f"the workers serve different models: {first_id} serves {first.name!r}, "
        + "; ".join(unlike)
        + " (the first's values first): start every worker of a scheduler with the same --model"
    )


def returned_mismatch(worker_id: str, expected: ServedModel, got: ServedModel) -> str:
    """Why a worker that answers again cannot be used ("" if it can): it came back serving
    another model than the fleet's."""
    diff = expected.differences(got)
    if not diff:
        return ""
    return (
        f"worker {worker_id} answers again but serves {got.name!r}, not the fleet's {expected.name!r} "
        f"({', '.join(diff)}; the fleet's values first): it is not used until it serves that model again"
    )
