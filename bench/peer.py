"""The peer: Hugging Face transformers ``generate`` with static batches, on the same GGUF.

A static batch is left-padded to its longest prompt and runs greedy until its longest output
(``max_new_tokens`` = the batch's largest, EOS never ends it early), so every row pays for the
longest prompt and the longest output. Throughput counts only the useful tokens: each
session's own output length, the same tokens the cluster is asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.workload import Session

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gguf_path(model: str) -> Path:
    from kvfleet_models.registry import SourceKind, resolve_model

    source = resolve_model(model)
    if source.kind is not SourceKind.GGUF or source.path is None:
        raise ValueError(f"the peer loads a GGUF; {model!r} is not one")
    return source.path


def load_peer(model: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = gguf_path(model)
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=_DTYPES[dtype])
    m.generation_config.eos_token_id = None  # never stop early: outputs have fixed lengths
    return m.to(device).eval()  # type: ignore[arg-type]


class _Progress:
    """A stopping criterion that never stops; it reports every ``every`` generated tokens."""

    def __init__(self, report: Callable[[str], None], label: str, total: int, every: int = 32):
        self.report, self.label, self.total, self.every, self.steps = report, label, total, every, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        self.steps += 1
        if self.steps % self.every == 0:
            self.report(f"{self.label}: {self.steps}/{self.total} tokens")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_batch(
    model, batch: Sequence[Session], device: str, pad_id: int = 0, progress: _Progress | None = None
) -> torch.Tensor:
    from transformers import StoppingCriteriaList

    width = max(len(s.prompt) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):  # left padding
        ids[row, width - len(s.prompt) :] = torch.tensor(s.prompt)
        mask[row, width - len(s.prompt) :] = 1
    new = max(s.max_new_tokens for s in batch)
    criteria = StoppingCriteriaList([progress]) if progress is not None else None
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=criteria,
        )
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return out


def pick_threads(model, sessions: Sequence[Session], device: str, options: Sequence[int]) -> dict:
    """The intra-op thread count under which a short static batch runs fastest, now. The batch
    is mostly prefill (8 x 64 prompt tokens, 4 new tokens): compute-bound, as the peer's runs
    are, so that a thread count that only pays off on large products is not missed."""
    if torch.device(device).type != "cpu" or len(options) < 1:
        return {"threads": torch.get_num_threads(), "seconds": {}}
    probe = [Session(s.prompt[:64], 4) for s in sessions[:8]]
    seconds = {}
    for n in options:
        torch.set_num_threads(n)
        generate_batch(model, probe[:2], device)  # warm
        t0 = time.perf_counter()
        generate_batch(model, probe, device)
        seconds[str(n)] = round(time.perf_counter() - t0, 3)
    best = int(min(seconds, key=seconds.__getitem__))
    torch.set_num_threads(best)
    return {"threads": best, "seconds": seconds}


def run_static(
    model, sessions: Sequence[Session], batch_size: int, device: str, progress: Callable[[str], None] = lambda m: None
) -> dict:
    useful = sum(s.max_new_tokens for s in sessions)
    computed = padded_prompt = 0
    t0 = time.perf_counter()
    for start in range(0, len(sessions), batch_size):
        batch = sessions[start : start + batch_size]
        new = max(s.max_new_tokens for s in batch)
        label = f"batch {start // batch_size + 1}/{-(-len(sessions) // batch_size)}"
        generate_batch(model, batch, device, progress=_Progress(progress, label, new))
        computed += new * len(batch)
        padded_prompt += max(len(s.prompt) for s in batch) * len(batch)
    wall = time.perf_counter() - t0
    logging.getLogger(__name__).debug("peer batch %d: %.1f s", batch_size, wall)
    return {
        "concurrency": batch_size,
        "sessions": len(sessions),
        "useful_output_tokens": useful,
        "computed_output_tokens": computed,
        "prompt_tokens": sum(len(s.prompt) for s in sessions),
        "padded_prompt_tokens": padded_prompt,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(useful / wall, 3),
    }
