"""python -m bench.quality: teacher-forced quality of our quantized modes and of llama.cpp on
the same GGUF, against our float32, on the same token ids (issue 25 point 4).

    .venv/bin/python -m bench.quality                     # SmolLM2's GGUF, every kernel level, whole text
    .venv/bin/python -m bench.quality --quick             # the best level only, the text's first 1,025 tokens
    .venv/bin/python -m bench.quality --gguf other.gguf   # any GGUF our loader reads (e.g. a Q4_K one)

Every engine is scored by worker_svc/quality.py over tests/data/heldout.txt (our tokenizer's
ids; llama.cpp is fed the ids, never the text, after checking that its own tokenizer gives the
same ids): top-1 agreement with our float32 (the file's weights dequantized) and the
perplexity ratio. Ours: int8 and gguf at each kernel level this CPU runs. llama.cpp
(llama-cpp-python, ``logits_all``): on the file, and on a Q8_0 copy of it that llama.cpp
writes itself (``--requant``), which is the quantization our int8 mode makes (int8 blocks of
32 with one scale each); our gguf mode serves that copy too. llama.cpp runs in a child process,
so a crash (its AMX kernels crashed on this Xeon: the Makefile builds it without them) is
reported, not fatal. Writes bench/quality.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.quality_table import LLAMACPP, QualityRow, document, table
from kvfleet.progress import Progress, for_terminal

HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "heldout.txt"
DEFAULT_OUT = Path(__file__).with_name("quality.json")
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
QUICK_TOKENS = 1025


def int8_levels(levels: Sequence[str]) -> list[str]:
    """Of ``levels``, those int8 has (it has no amx level); its best where it has none of them."""
    from worker_svc.model import q8

    return [lv for lv in levels if lv in q8.LEVELS] or list(q8.runnable_levels()[-1:])


def cpu_info() -> dict:
    from worker_svc.model import q8
    from worker_svc.model.gguf_quant import runnable_levels

    model, flags = "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    levels, forced = runnable_levels(), os.environ.get("KVFLEET_Q8_LEVEL")
    return {
        "model": model,
        "cores": len(os.sched_getaffinity(0)),
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "levels": list(levels),  # gguf's: int8's and amx where the tiles may be used
        "default_level": forced or levels[-1],
        "int8_level": forced if forced in q8.LEVELS else q8.runnable_levels()[-1],
    }


def _llamacpp_child(gguf: str, ids: list[int], text: str, threads: int, out: str) -> None:
    """In a child process: llama.cpp's own tokens of ``text``, and its logits over ``ids``
    scored as ours are."""
    import llama_cpp
    import torch

    from bench.llamacpp_peer import quiet
    from worker_svc.quality import score

    quiet(llama_cpp)
    vocab = llama_cpp.Llama(gguf, vocab_only=True, verbose=False)
    tokens = vocab.tokenize(text.encode(), add_bos=True, special=True)
    del vocab
    llm = llama_cpp.Llama(
        gguf,
        logits_all=True,
        n_ctx=len(ids) + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    t0 = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - t0
    logits = torch.from_numpy(np.asarray(llm.scores[: len(ids) - 1]))  # [n - 1, V]
    got = score(logits, torch.tensor(ids[1:]))
    # "CPU : SSE3 = 1 | AVX2 = 1 | ...": the features its build uses (no AMX in ours: see the Makefile)
    pairs = (part.rsplit("=", 1) for part in llama_cpp.llama_print_system_info().decode().split("|") if "=" in part)
    build = " ".join(k.split(":")[-1].strip() for k, v in pairs if v.strip() == "1")
    info = f"llama-cpp-python {llama_cpp.__version__}, {threads} threads, build {build}"
    np.savez(out, top1=got.top1, nll=got.nll, tokens=np.asarray(tokens), seconds=seconds, info=info)


def _requant_child(src: str, dst: str, threads: int) -> None:
    import llama_cpp

    from bench.llamacpp_peer import quiet

    quiet(llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True  # from the file's blocks dequantized, as our int8 mode does
    params.nthread = threads
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise SystemExit(1)


def _in_child(target: Callable[..., None], *args: object) -> str | None:
    """Runs ``target`` in a fresh process; None, or how it failed (a signal is a crash)."""
    p = multiprocessing.get_context("spawn").Process(target=target, args=args)
    p.start()
    p.join()
    if p.exitcode == 0:
        return None
    code = p.exitcode or 0
    return f"crashed (signal {-code})" if code < 0 else f"exited with {code}"


def _agreement_row(system, mode, weights, level, base, got, seconds, same_as="") -> QualityRow:  # type: ignore[no-untyped-def]
    from worker_svc.quality import compare

    a = compare(base, got)
    return QualityRow(
        system, mode, weights, level, a.positions, a.top1_agreement, a.ppl_test, a.ppl_base, seconds, same_as
    )


def _ours(path: Path, quant: str, level: str | None, ids: Sequence[int], loaded=None):  # type: ignore[no-untyped-def]
    """Our engine on ``path`` (float32 weights, int8 of them, or the file's blocks) at ``level``."""
    from kvfleet_models.registry import load_model, load_model_blocks
    from worker_svc.engine import Engine, EngineConfig
    from worker_svc.model.q8 import LEVEL_ENV
    from worker_svc.quality import teacher_forced

    cfg, weights = loaded or (load_model_blocks(str(path)) if quant == "gguf" else load_model(str(path)))
    saved = os.environ.get(LEVEL_ENV)
    if level:
        os.environ[LEVEL_ENV] = level
    try:
        engine = Engine(cfg, weights, EngineConfig(num_blocks=-(-len(ids) // 16) + 8, quant=quant))
        if level:
            assert engine.model.kernel_level == level, (engine.model.kernel_level, level)
        t0 = time.perf_counter()
        got = teacher_forced(engine, ids)
        return got, time.perf_counter() - t0
    finally:
        os.environ.pop(LEVEL_ENV, None)
        if saved is not None:
            os.environ[LEVEL_ENV] = saved


def measure(
    gguf: Path,
    base: Path,
    levels: Sequence[str],
    tokens: int,
    threads: int,
    requant: bool,
    progress: Progress,
) -> dict:
    from kvfleet_models.errors import ModelLoadError
    from kvfleet_models.registry import load_model
    from kvfleet_models.tokenizer import Tokenizer
    from worker_svc.quality import TeacherForced

    text = HELDOUT.read_text()
    encoded = Tokenizer.for_model(str(base)).encode(text)
    ids = encoded[:tokens] if tokens else encoded
    cpu, notes, same_ids = cpu_info(), [], "not checked (llama.cpp did not run)"

    label = f"{gguf.stem.rsplit('.', 1)[-1]} (file)"
    progress(f"float32 on {base.name}: {len(ids)} tokens")
    loaded = load_model(str(base))
    f32, secs = _ours(base, "none", None, ids, loaded)
    rows = [_agreement_row("kvfleet", "float32", "float32", "-", f32, f32, secs)]
    progress.advance(message=f"float32 perplexity {rows[0].ppl:.3f}")
    runs: list[tuple[str, Path, str]] = [("gguf", gguf, label)]
    for level in int8_levels(levels):
        progress(f"int8 at {level}")
        got, secs = _ours(base, "int8", level, ids, loaded)
        rows.append(_agreement_row("kvfleet", "int8", "int8 blocks of 32", level, f32, got, secs, "Q8_0 (requantized)"))
        progress.advance(message=f"int8 at {level}: {rows[-1].top1_agreement:.4f}")
    del loaded
    gc.collect()
    files = {label: gguf}
    with tempfile.TemporaryDirectory() as tmp:
        if requant:
            q8 = Path(tmp) / f"{gguf.stem}.Q8_0.gguf"
            progress("llama.cpp writes a Q8_0 copy of the file")
            failed = _in_child(_requant_child, str(gguf), str(q8), threads)
            if failed:
                notes.append(f"llama.cpp's Q8_0 requantization {failed}")
            else:
                files["Q8_0 (requantized)"] = q8
                runs.append(("gguf", q8, "Q8_0 (requantized)"))
        for mode, path, weights in runs:
            for level in levels:
                progress(f"gguf on {weights} at {level}")
                try:
                    got, secs = _ours(path, mode, level, ids)
                except ModelLoadError as e:  # a block format --quant gguf does not serve (yet)
                    notes.append(f"our gguf mode refuses {weights}: {e}")
                    progress.advance(len(levels), message=f"gguf on {weights}: refused")
                    break
                rows.append(_agreement_row("kvfleet", mode, weights, level, f32, got, secs, weights))
                progress.advance(message=f"gguf on {weights} at {level}: {rows[-1].top1_agreement:.4f}")
                gc.collect()
        for weights, path in files.items():
            progress(f"llama.cpp on {weights} ({threads} threads, logits_all)")
            out = Path(tmp) / "llamacpp.npz"
            failed = _in_child(_llamacpp_child, str(path), list(ids), text, threads, str(out))
            progress.advance(message=f"llama.cpp on {weights}: {failed or 'done'}")
            if failed:
                notes.append(f"llama.cpp on {weights} {failed}")
                continue
            r = np.load(out)
            # llama.cpp's own tokens of the text (its BOS as the file asks) against our ids
            same = [int(t) for t in r["tokens"]] == list(encoded)
            same_ids = "yes" if same else "NO (its tokenizer differs; it was fed our ids)"
            cpu["llamacpp"] = str(r["info"])
            rows.append(
                _agreement_row(
                    LLAMACPP, LLAMACPP, weights, "-", f32, TeacherForced(r["top1"], r["nll"]), float(r["seconds"])
                )
            )
    doc = document(rows, cpu, {"name": HELDOUT.name, "tokens": len(ids), "same_token_ids": same_ids})
    doc["files"] = {"gguf": str(gguf), "base": str(base)}
    doc["notes"] = notes
    doc["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return doc


def progress_for(levels: Sequence[str], requant: bool) -> Progress:
    """A bar over ``measure``'s runs: float32, int8 and gguf per level (gguf per file), llama.cpp per file."""
    files = 2 if requant else 1
    return for_terminal("bench.quality", total=1 + len(int8_levels(levels)) + len(levels) * files + files)


def main(argv: list[str] | None = None) -> int:
    from kvfleet_models.registry import default_model_file
    from worker_svc.model.gguf_quant import runnable_levels

    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF measured (default: SmolLM2-135M's)")
    p.add_argument("--base", type=Path, default=None, help="the GGUF whose float32 is the reference (default: --gguf)")
    p.add_argument(
        "--levels", default="", help="our kernel levels (default: every level this CPU runs; int8 takes those it has)"
    )
    p.add_argument("--tokens", type=int, default=0, help="the text's first N tokens (0: all)")
    p.add_argument("--no-requant", action="store_true", help="skip the Q8_0 copy (llama.cpp's and our gguf on it)")
    p.add_argument("--quick", action="store_true", help=f"the best level only, the first {QUICK_TOKENS} tokens")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    gguf = a.gguf or default_model_file("smollm2-135m")
    runnable = runnable_levels()
    levels = [lv for lv in a.levels.split(",") if lv] or (list(runnable[-1:]) if a.quick else list(runnable))
    tokens = a.tokens or (QUICK_TOKENS if a.quick else 0)
    requant = not a.no_requant
    say = progress_for(levels, requant)
    doc = measure(gguf, a.base or gguf, levels, tokens, a.threads, requant, say)
    say.close()
    print(table(doc))
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
