"""The second peer: llama.cpp (through llama-cpp-python's C API bindings) on the same GGUF file,
with the same prompts and output lengths as the cluster, greedy, EOS ignored.

llama.cpp runs the GGUF's own quantized weights (SmolLM2-135M's file is Q4_1 / Q8 mixed), so
this is the engine a CPU user would otherwise pick. Concurrency ``c`` is served the way a
continuous-batching server does it: up to ``c`` sequences live in one context (a unified KV
cache, one sequence id each); every iteration is one ``llama_decode`` of a batch holding each
live sequence's next token plus the prompts of newly admitted sessions (up to a prefill token
budget per iteration, as the cluster's scheduler does), and a finished sequence's slot and KV
are freed for the next session at once. Throughput counts each session's own output tokens.

llama-cpp-python is an optional extra (``pip install '.[bench-llamacpp]'``: it compiles llama.cpp
from source, several minutes on 2 cores); ``make bench`` installs it once and the benchmark
skips this peer with a line saying why when it is not importable.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.workload import Session


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (for the skip line)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken native library
        return f"llama-cpp-python is not importable ({type(exc).__name__}: {exc}); `make bench` installs it"
    return None


@dataclass(frozen=True)
class PeerRun:
    sessions: int
    concurrency: int
    output_tokens: int
    wall_s: float
    iterations: int

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def row(self) -> dict:
        """A results row, keyed as the other systems' rows are."""
        return {
            "concurrency": self.concurrency,
            "sessions": self.sessions,
            "useful_output_tokens": self.output_tokens,
            "iterations": self.iterations,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.tok_per_s, 3),
        }


def version() -> str:
    import llama_cpp

    return str(llama_cpp.__version__)


class LlamaCppPeer:
    """One model and one context sized for ``max_concurrency`` sequences of ``max_tokens`` each."""

    def __init__(
        self,
        gguf: Path,
        threads: int,
        max_concurrency: int,
        max_tokens: int,
        batch_tokens: int = 512,
        unified: bool = True,
    ):
        import llama_cpp as lc

        self._lc = lc
        lc.llama_backend_init()
        quiet(lc)
        mparams = lc.llama_model_default_params()
        self._model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max_concurrency * max_tokens
        cparams.n_batch = batch_tokens
        cparams.n_ubatch = batch_tokens
        cparams.n_seq_max = max_concurrency
        # One pool of cells shared by the sequences (as a paged cache). Measured at c=32 on 2 cores:
        # per-sequence caches (unified=False) ran at less than half this rate.
        cparams.kv_unified = unified
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self.batch_tokens = batch_tokens
        self._batch = lc.llama_batch_init(batch_tokens, 0, 1)
        self._memory = lc.llama_get_memory(self._ctx)

    def close(self) -> None:
        lc = self._lc
        lc.llama_batch_free(self._batch)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most batch_tokens of them."""
        b = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(entries)
        rc = self._lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full or a bad batch)")

    def _argmax(self, row: int) -> int:
        ptr = self._lc.llama_get_logits_ith(self._ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.vocab,))))

    def run(
        self,
        sessions: Sequence[Session],
        concurrency: int,
        prefill_budget: int = 256,
        progress: Callable[[str], None] | None = None,
    ) -> tuple[PeerRun, list[list[int]]]:
        """Serve every session, at most ``concurrency`` at once; returns the run and each
        session's tokens (for the parity check against the cluster's greedy tokens)."""
        waiting = list(range(len(sessions)))[::-1]
        free_seqs = list(range(concurrency))[::-1]
        live: dict[int, dict[str, Any]] = {}  # sequence id -> state
        outputs: list[list[int]] = [[] for _ in sessions]
        iterations = 0
        t0 = time.perf_counter()
        while waiting or live:
            entries: list[tuple[int, int, int, bool]] = []
            rows: list[int] = []  # sequence of each logits row, in batch order
            for seq, st in live.items():  # decodes first: one token each
                entries.append((st["last"], st["pos"], seq, True))
                rows.append(seq)
            budget = min(prefill_budget, self.batch_tokens - len(entries))
            while waiting and free_seqs and len(sessions[waiting[-1]].prompt) <= budget:
                idx = waiting.pop()
                seq = free_seqs.pop()
                prompt = sessions[idx].prompt
                for j, tok in enumerate(prompt):
                    entries.append((tok, j, seq, j == len(prompt) - 1))
                rows.append(seq)
                live[seq] = {"index": idx, "pos": len(prompt), "last": -1, "new": True}
                budget -= len(prompt)
            if not entries:  # a prompt longer than the whole budget: give it an iteration alone
                idx, seq = waiting.pop(), free_seqs.pop()
                prompt = sessions[idx].prompt
                entries = [(tok, j, seq, j == len(prompt) - 1) for j, tok in enumerate(prompt)]
                rows, live[seq] = [seq], {"index": idx, "pos": len(prompt), "last": -1, "new": True}
            self._decode(entries)
            iterations += 1
            logit_rows = [i for i, e in enumerate(entries) if e[3]]
            for seq, row in zip(rows, logit_rows):
                st = live[seq]
                token = self._argmax(row)
                if not st.pop("new", False):
                    st["pos"] += 1
                st["last"] = token
                out = outputs[st["index"]]
                out.append(token)
                if len(out) >= sessions[st["index"]].max_new_tokens:
                    self._lc.llama_memory_seq_rm(self._memory, seq, -1, -1)
                    del live[seq]
                    free_seqs.append(seq)
                    if progress is not None:
                        done = sum(1 for o, s in zip(outputs, sessions) if len(o) >= s.max_new_tokens)
                        progress(f"llama.cpp c={concurrency}: {done}/{len(sessions)} sessions")
        wall = time.perf_counter() - t0
        total = sum(len(o) for o in outputs)
        return PeerRun(len(sessions), concurrency, total, wall, iterations), outputs


def quiet(lc: Any) -> None:
    """llama.cpp logs every load to stderr; keep only its errors."""

    @lc.llama_log_callback
    def _log(level: int, text: bytes, user_data: Any) -> None:
        if level == 4:  # GGML_LOG_LEVEL_ERROR (5, CONT, continues any level: the load's dots)
            print(text.decode(errors="replace"), end="")

    quiet.callback = _log  # type: ignore[attr-defined]  # ctypes callbacks must outlive their use
    lc.llama_log_set(_log, ctypes.c_void_p())
