"""A GGUF file's vocabulary (``tokenizer.ggml.*``) rebuilt as a ``tokenizers`` backend.

llama.cpp stores two kinds of vocabulary we serve:

* ``gpt2``: byte-level BPE. Tokens are spelt in GPT-2's byte alphabet and the file carries the
  merges; only the split rules that run before BPE are not stored, just named by
  ``tokenizer.ggml.pre``, so each name we know maps to the rules of the original tokenizer.
* ``llama``: SentencePiece (Llama 1/2, Mistral, Gemma, Phi-3). Tokens use "▁" for a space,
  carry a score, and the 256 ``<0xNN>`` byte tokens stand for bytes of characters the
  vocabulary lacks. There are no merges: llama.cpp (like sentencepiece) merges the adjacent
  pair whose concatenation is a token of the highest score until none is left. That is
  byte-fallback BPE whose merge list is every split of every token into two tokens, ranked
  by the whole token's score, which is what we build, so the ``tokenizers`` BPE gives the ids
  llama.cpp's loop would wherever the scores tell merges apart.

Written from our reading of llama.cpp's converter and tokenizer; none of their code is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from kvfleet_models.errors import ModelLoadError
from kvfleet_models.gguf_file import GgufFile

logger = logging.getLogger(__name__)

SPACE = "\u2581"  # SentencePiece's spelling of a space ("▁")


class TokenType(IntEnum):
    """llama.cpp's token types (``tokenizer.ggml.token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Split rules by tokenizer.ggml.pre, as the original tokenizers apply them before byte-level
# BPE. GPT-2's regex is ByteLevel's built-in one (use_regex=True); "smollm" (SmolLM/StarCoder
# family) isolates every digit first, as SmolLM2's tokenizer.json does with
# Digits(individual_digits=True) ahead of ByteLevel. Llama 3 takes up to three digits at a
# time, Qwen2 one, and Qwen2's tokenizer.json also composes text to NFC first.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_REGEX = ("gpt2", "default", None)
_REGEX_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_NFC_FIRST = ("qwen2", "deepseek-r1-qwen")
# Gemma's sentencepiece scores do not follow the order its merges were learnt in; the order of
# its tokens does (what transformers found on the real files), so its merges rank by id.
_RANK_BY_ID = ("gemma", "gemma2", "gemma3")


@dataclass(frozen=True)
class GgufVocab:
    """The ``tokenizer.ggml.*`` metadata that shapes the tokenizer."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    scores: list[float]  # "llama" only; empty for gpt2
    merges: list[tuple[str, str]]  # stored merges ("gpt2" always; "llama" files have none)
    pre: str | None  # tokenizer.ggml.pre
    architecture: str  # general.architecture (picks Gemma's merge order)
    add_space_prefix: bool  # "llama": a "▁" before text that starts the input or follows a token
    unknown_id: int | None

    @classmethod
    def read(cls, reader: GgufFile, path: Path) -> GgufVocab:
        from kvfleet_models.gguf_loader import field_value

        model = field_value(reader, "tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"{path}: tokenizer model {model!r} is not supported "
                "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
            )
        tokens: list[str] = list(field_value(reader, "tokenizer.ggml.tokens") or [])
        types = list(field_value(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
        if field_value(reader, "tokenizer.ggml.remove_extra_whitespaces", False):
            raise ModelLoadError(f"{path}: tokenizer.ggml.remove_extra_whitespaces is not supported")
        unknown = field_value(reader, "tokenizer.ggml.unknown_token_id")
        if unknown is None:
            unknown = next((i for i, k in enumerate(types) if k == TokenType.UNKNOWN), None)
        return cls(
            model=model,
            tokens=tokens,
            types=[int(k) for k in types],
            scores=[float(s) for s in field_value(reader, "tokenizer.ggml.scores") or []],
            merges=[_pair(m) for m in field_value(reader, "tokenizer.ggml.merges") or []],
            pre=field_value(reader, "tokenizer.ggml.pre"),
            architecture=str(field_value(reader, "general.architecture", "")),
            # llama.cpp's default for SentencePiece vocabularies; Gemma's files say False.
            add_space_prefix=bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True)),
            unknown_id=None if unknown is None else int(unknown),
        )

    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` that encodes and decodes as the original tokenizer."""
        from tokenizers import AddedToken

        backend = _byte_level(self) if self.model == "gpt2" else _sentencepiece(self)
        # Control tokens (<|im_start|>, <s>) match whole in text and are never merged into;
        # user-defined ones (<think>, Gemma's runs of spaces) match whole too, as plain text.
        special = (TokenType.CONTROL, TokenType.UNKNOWN)
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(self.tokens, self.types) if k in special]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(self.tokens, self.types)
                if k == TokenType.USER_DEFINED
            ]
        )
        return backend


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _vocab_ids(tokens: list[str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)  # a repeated spelling keeps its first id, as llama.cpp's lookup does
    if len(ids) < len(tokens):
        logger.warning("the GGUF vocabulary spells %d tokens twice; text maps to the first", len(tokens) - len(ids))
    return ids


def _byte_level(vocab: GgufVocab) -> Any:
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    backend = Backend(models.BPE(vocab=_vocab_ids(vocab.tokens), merges=vocab.merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _REGEX_SPLITS.get(vocab.pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif vocab.pre in _DIGITS_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if vocab.pre not in _GPT2_REGEX:
            logger.warning("unknown tokenizer.ggml.pre %r: splitting text with GPT-2's rules", vocab.pre)
        backend.pre_tokenizer = byte_level
    if vocab.pre in _NFC_FIRST:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(vocab: GgufVocab) -> Any:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    if len(vocab.scores) != len(vocab.tokens) and not vocab.merges:
        raise ModelLoadError("a 'llama' tokenizer needs tokenizer.ggml.scores, one per token")
    unk = vocab.tokens[vocab.unknown_id] if vocab.unknown_id is not None else None
    bpe = models.BPE(
        vocab=_vocab_ids(vocab.tokens),
        merges=vocab.merges or spm_merges(vocab),
        unk_token=unk,
        byte_fallback=True,  # a character without a token becomes its <0xNN> byte tokens
        fuse_unk=True,
    )
    backend = Backend(bpe)
    # No split into words: sentencepiece merges across the whole text, spaces included ("▁").
    # The prefix space goes before every run of text, also one after a special token, as
    # llama.cpp (and Llama 2's own tokenizer.json) does.
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if vocab.add_space_prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:  # the prefix space is the encoder's, not the text's
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def spm_merges(vocab: GgufVocab) -> list[tuple[str, str]]:
    """Every split of a normal token into two normal tokens, best merge first.

    llama.cpp merges the adjacent pair whose concatenation has the highest score (leftmost on
    a tie); as BPE merges the pair of lowest rank, ranking each split by its token's score
    reproduces that. Equal scores (files converted from tokenizer.json carry -1000 for every
    token) fall back to the token order, which is the order a BPE vocabulary learnt them in.
    """
    normal = {t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.types)) if k == TokenType.NORMAL}
    by_id = vocab.architecture in _RANK_BY_ID
    ranked: list[tuple[tuple[float, int], int, tuple[str, str]]] = []
    for token, i in normal.items():
        key = (0.0, i) if by_id else (-vocab.scores[i], i)
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((key, cut, (left, right)))
    ranked.sort()
    return [pair for _, _, pair in ranked]
