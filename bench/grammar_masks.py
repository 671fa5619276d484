"""Which grammar library computes JSON token masks fastest on our vocabulary (issue 15 point 5).

    .venv/bin/python -m bench.grammar_masks                 # every library that imports
    .venv/bin/python -m bench.grammar_masks --libs llguidance --repeats 5

Candidates: xgrammar, llguidance, outlines-core (whichever are installed). Each builds its
tokenizer description from SmolLM2-135M's real vocabulary (49152 byte-level BPE tokens), then,
per grammar (json_object and three schemas), we time the compile and walk a valid JSON document
token by token exactly as the worker will: compute the mask, check that the document's next
token is in it, accept the token; at the end the EOS must be the only thing allowed. The mask
time covers the library's bitmask fill plus our conversion to a numpy bool vector (what the
engine needs). Nothing is asserted beyond that walk: this prints figures to quote.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from kvfleet_models.tokenizer import Tokenizer

# Schemas and one valid document each; the documents use json.dumps' default ", " / ": ".
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
    },
    "required": ["name", "age", "member", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["id", "email"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["customer", "items"],
}
READING = {
    "type": "object",
    "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}, "station": {"type": "string"}},
    "required": ["celsius", "station"],
}
CASES: list[tuple[str, str, dict[str, Any] | None, Any]] = [
    (
        "json_object",
        "json_object",
        None,
        {"title": "Notes on paging", "tags": ["kv", "cache"], "meta": {"pages": 12, "draft": False, "score": 0.75}},
    ),
    ("person", "json_schema", PERSON, {"name": "Ada Lovelace", "age": 36, "member": True, "role": "editor"}),
    (
        "order",
        "json_schema",
        ORDER,
        {
            "customer": {"id": 4711, "email": "ada@example.com"},
            "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}],
        },
    ),
    ("reading", "json_schema", READING, {"celsius": 21.5, "station": "Uppsala"}),
]
MAX_WS = 4  # whitespace run allowed between JSON tokens, where the library can bound it


class Session(Protocol):
    def mask(self) -> np.ndarray: ...
    def accept(self, token: int) -> None: ...


@dataclass
class Backend:
    name: str
    version: str
    setup_s: float  # building the library's tokenizer description
    compile: Callable[[str, dict[str, Any] | None], Any]  # (kind, schema) -> compiled grammar
    session: Callable[[Any], Session]


def _target(kind: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """The schema each library compiles: json_object is any object (OpenAI's meaning)."""
    return {"type": "object"} if kind == "json_object" or schema is None else schema


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    """A 32-bit-word bitmask (bit i of word w = token 32w+i) as a bool vector of length vocab."""
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].view(np.bool_)


def _llguidance(tok: Tokenizer, vocab: int, eos: list[int]) -> Backend:
    from importlib.metadata import version

    import llguidance

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t0

    def compile_(kind: str, schema: dict[str, Any] | None) -> str:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            _target(kind, schema), overrides={"whitespace_pattern": f"[ \\n\\t]{{0,{MAX_WS}}}"}
        )
        err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if err:
            raise ValueError(err)
        return grammar

    class S:
        def __init__(self, grammar: str) -> None:
            self.m = llguidance.LLMatcher(lltok, grammar)
            self.words = np.zeros((vocab + 31) // 32, dtype=np.int32)

        def mask(self) -> np.ndarray:
            self.m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
            return _unpack(self.words, vocab)

        def accept(self, token: int) -> None:
            if not self.m.consume_token(token):
                raise ValueError(self.m.get_error())

    return Backend("llguidance", version("llguidance"), setup, compile_, S)


def _xgrammar(tok: Tokenizer, vocab: int, eos: list[int]) -> Backend:
    from importlib.metadata import version

    import torch  # xgrammar imports it anyway; its bitmask API wants a DLPack array
    import xgrammar

    t0 = time.perf_counter()
    encoded = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0

    def compile_(kind: str, schema: dict[str, Any] | None) -> Any:
        # compile_builtin_json_grammar accepts any JSON value; the schema form forces an object.
        return compiler.compile_json_schema(_target(kind, schema), any_whitespace=True, max_whitespace_cnt=MAX_WS)

    class S:
        def __init__(self, compiled: Any) -> None:
            self.m = xgrammar.GrammarMatcher(compiled)
            self.words = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

        def mask(self) -> np.ndarray:
            self.m.fill_next_token_bitmask(self.words)
            return _unpack(self.words.numpy()[0], vocab)

        def accept(self, token: int) -> None:
            if not self.m.accept_token(token):
                raise ValueError(f"token {token} refused")

    return Backend("xgrammar", version("xgrammar"), setup, compile_, S)


def _outlines(tok: Tokenizer, vocab: int, eos: list[int]) -> Backend:
    from importlib.metadata import version

    import outlines_core

    t0 = time.perf_counter()
    decoder = _byte_decoder()
    special = set(tok.backend.get_added_tokens_decoder())
    entries: dict[bytes, list[int]] = {}
    for text, i in tok.backend.get_vocab(with_added_tokens=True).items():
        if i not in special:
            entries.setdefault(bytes(decoder[c] for c in text), []).append(i)
    vocabulary = outlines_core.Vocabulary(eos[0], entries)
    setup = time.perf_counter() - t0
    ws = f"[ \\n\\t]{{0,{MAX_WS}}}"

    def compile_(kind: str, schema: dict[str, Any] | None) -> Any:
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(_target(kind, schema)), ws)
        return outlines_core.Index(regex, vocabulary)

    class S:
        def __init__(self, index: Any) -> None:
            self.g = outlines_core.Guide(index)
            self.words = np.zeros((vocab + 31) // 32, dtype=np.int32)

        def mask(self) -> np.ndarray:
            self.g.write_mask_into(self.words.ctypes.data, self.words.size, 4)
            return _unpack(self.words, vocab)

        def accept(self, token: int) -> None:
            self.g.advance(token)

    return Backend("outlines-core", version("outlines-core"), setup, compile_, S)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


BACKENDS = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


@dataclass
class Row:
    lib: str
    case: str
    compile_ms: float
    session_ms: float  # a new matcher over the compiled grammar (llguidance builds its parser here)
    tokens: int
    mean_us: float
    p99_us: float
    ok: bool


def _walk(backend: Backend, compiled: Any, ids: list[int], eos: list[int]) -> tuple[float, list[float]]:
    """Session start time and mask times (s) for each step and the final EOS step; raises if refused."""
    t0 = time.perf_counter()
    session = backend.session(compiled)
    start = time.perf_counter() - t0
    times = []
    for t in [*ids, None]:
        t0 = time.perf_counter()
        mask = session.mask()
        times.append(time.perf_counter() - t0)
        if t is None:
            if not all(mask[e] for e in eos) or int(mask.sum()) != len(eos):
                raise ValueError(f"after the document: {int(mask.sum())} allowed, expected only EOS {eos}")
        else:
            if not mask[t]:
                raise ValueError(f"token {t} of the document not in the mask")
            session.accept(t)
    return start, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libs", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=10, help="walks per grammar (times pooled)")
    args = parser.parse_args()

    tok = Tokenizer.for_model("smollm2-135m")
    vocab, eos = tok.vocab_size, list(tok.eos_token_ids)
    rows: list[Row] = []
    for name in args.libs.split(","):
        try:
            backend = BACKENDS[name](tok, vocab, eos)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        print(f"{name} {backend.version}: tokenizer setup {backend.setup_s * 1e3:.0f} ms")
        for case, kind, schema, doc in CASES:
            ids = tok.encode(json.dumps(doc))
            t0 = time.perf_counter()
            try:
                compiled = backend.compile(kind, schema)
            except Exception as e:  # report and go on: one library's gap is a result
                print(f"  {case}: compile failed: {e}")
                nan = float("nan")
                rows.append(Row(name, case, nan, nan, len(ids), nan, nan, False))
                continue
            compile_ms = (time.perf_counter() - t0) * 1e3
            times: list[float] = []
            starts: list[float] = []
            ok = True
            for _ in range(args.repeats):
                try:
                    start, walk = _walk(backend, compiled, ids, eos)
                    starts.append(start)
                    times += walk
                except Exception as e:
                    print(f"  {case}: walk failed: {e}")
                    ok = False
                    break
            us = np.asarray(times) * 1e6 if times else np.asarray([np.nan])
            session_ms = float(np.mean(starts)) * 1e3 if starts else float("nan")
            rows.append(
                Row(name, case, compile_ms, session_ms, len(ids), float(us.mean()), float(np.percentile(us, 99)), ok)
            )

    words = np.zeros((vocab + 31) // 32, dtype=np.int32)
    t0 = time.perf_counter()
    for _ in range(1000):
        _unpack(words, vocab)
    print(f"\nbitmask -> bool[{vocab}] conversion (included below): {(time.perf_counter() - t0) * 1e3:.1f} us")
    head = f"{'library':<14}{'grammar':<13}{'compile ms':>11}{'session ms':>11}{'tokens':>8}{'mask mean us':>14}"
    print(f"{head}{'p99 us':>9}  ok")
    for r in rows:
        print(
            f"{r.lib:<14}{r.case:<13}{r.compile_ms:>11.1f}{r.session_ms:>11.2f}{r.tokens:>8}{r.mean_us:>14.1f}"
            f"{r.p99_us:>9.1f}  "
            f"{'yes' if r.ok else 'NO'}"
        )


if __name__ == "__main__":
    main()
