"""Each family's original tokenizer, made at test time, and its vocabulary as a GGUF file.

No download: a small BPE is trained with the ``tokenizers`` library on a few lines, in the shape
of the family's own tokenizer.json, and saved as a Hugging Face directory (tokenizer.json,
tokenizer_config.json with the family's chat template) that transformers loads as the original:

* "llama2" / "mistral": SentencePiece-style BPE (Llama 2's tokenizer.json: "▁" for spaces, a
  prefix "▁" before every run of text, byte fallback to <0x00>..<0xFF>, <unk> <s> </s> first);
* "gemma": the same without the prefix space, Gemma's special tokens first, runs of "▁" as
  added tokens (written into the GGUF as real spaces, as the converter writes them);
* "qwen2": byte-level BPE, Qwen2's split regex and NFC, its control tokens after the merges and
  <think> </think> as plain added tokens (as Qwen3 has them);
* "llama3": byte-level BPE with Llama 3's split regex, BOS added by the post-processor.

``write_gguf_vocab`` writes the directory's vocabulary as llama.cpp's converter does
(``--vocab-only``): SentencePiece ones as from tokenizer.model (a score per token, the later
merge the lower, token types NORMAL / UNKNOWN / CONTROL / BYTE; Gemma with add_space_prefix
false), or from tokenizer.json alone (every score -1000: "mistral" is written so); byte-level
ones with their merges and ``tokenizer.ggml.pre``; special ids, add_bos / add_eos and the chat
template in both. Written from our reading of the converter; none of its code is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPACE = "\u2581"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Our own templates in each family's chat format (the real ones are longer, not different in kind).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (sys if loop.first else '') + m['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('user and assistant turns only') }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VocabCase:
    name: str
    sentencepiece: bool  # else byte-level BPE
    architecture: str  # general.architecture of the GGUF
    pre: str  # tokenizer.ggml.pre
    control: tuple[str, ...]  # special tokens (SentencePiece: ids 0.. in this order; else after the merges)
    bos: str | None
    eos: str
    template: str
    vocab_size: int
    prefix_space: bool = True  # SentencePiece: add_space_prefix
    flat_scores: bool = False  # converted from tokenizer.json alone: every score -1000
    user_defined: tuple[str, ...] = ()  # plain added tokens
    split: str | None = None  # byte-level: the split regex
    nfc: bool = False

    @property
    def add_bos(self) -> bool:
        return self.bos is not None


CASES = {
    c.name: c
    for c in (
        VocabCase("llama2", True, "llama", "default", ("<unk>", "<s>", "</s>"), "<s>", "</s>", LLAMA2_TEMPLATE, 700),
        VocabCase("mistral", True, "llama", "default", ("<unk>", "<s>", "</s>"), "<s>", "</s>", MISTRAL_TEMPLATE, 700,
                  flat_scores=True),
        VocabCase("gemma", True, "gemma3", "default",
                  ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>",
                  GEMMA_TEMPLATE, 700, prefix_space=False, user_defined=(SPACE * 2, SPACE * 4)),
        VocabCase("qwen2", False, "qwen2", "qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                  CHATML_TEMPLATE, 900, user_defined=("<think>", "</think>"), split=QWEN2_SPLIT, nfc=True),
        VocabCase("llama3", False, "llama", "llama-bpe",
                  ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                  "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE, 900, split=LLAMA3_SPLIT),
    )
}  # fmt: skip

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "A cluster serves tokens to the clients that ask for them, and the scheduler batches them.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,000,000",
    "Café, naïve, résumé — déjà vu. Über straße! ¿Qué tal? ça va.",
    "Привет, мир! Γειά σου κόσμε. 你好，世界。こんにちは世界。",
    "Tabs\tand  double  spaces,   triple spaces,\nnew lines\n\nand blank lines.",
    "It's what we'll do, they're sure, I've seen it, you'd know, she's here.",
    '<html><body class="main">Hello &amp; welcome</body></html>',
    "Emoji are rare here: 🙂 once.",
]


@dataclass
class Original:
    """The family's tokenizer as transformers loads it from ``directory``."""

    case: VocabCase
    directory: Path
    hf: Any = field(repr=False)  # transformers tokenizer


def _sentencepiece_backend(case: VocabCase) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    # Trained like sentencepiece: pieces never cross a space ("▁" starts a word's first piece).
    trainee = Tokenizer(models.BPE(unk_token="<unk>"))
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=case.vocab_size, special_tokens=[*case.control, *byte_tokens], show_progress=False
    )
    trainee.train_from_iterator(CORPUS, trainer)
    model = json.loads(trainee.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    # The byte tokens are vocabulary, not added tokens: rebuild without the trainer's additions.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if case.prefix_space else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if case.prefix_space else steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in case.control])
    # Gemma's runs of spaces: added tokens matched in the normalized text (spaces as "▁").
    tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in case.user_defined])
    assert case.bos is not None
    tok.post_processor = processors.TemplateProcessing(
        single=f"{case.bos} $A", pair=f"{case.bos} $A {case.bos} $B", special_tokens=[(case.bos, vocab[case.bos])]
    )
    return tok


def _byte_level_backend(case: VocabCase) -> Any:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    assert case.split is not None
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC() if case.nfc else None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(case.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=case.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in case.control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in case.user_defined])
    if case.bos is not None:
        bos = tok.token_to_id(case.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{case.bos} $A", pair=f"{case.bos} $A {case.bos} $B", special_tokens=[(case.bos, bos)]
        )
    return tok


def make_original(case: VocabCase, directory: Path) -> Original:
    """Train ``case``'s tokenizer, save it as a Hugging Face directory, load it with transformers."""
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    backend = _sentencepiece_backend(case) if case.sentencepiece else _byte_level_backend(case)
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is, as real repos load
        "bos_token": case.bos,
        "eos_token": case.eos,
        "chat_template": case.template,
        "clean_up_tokenization_spaces": False,
    }
    if case.sentencepiece:
        config["unk_token"] = "<unk>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Original(case, directory, AutoTokenizer.from_pretrained(str(directory)))


def _token_types(original: Original) -> list[int]:
    """llama.cpp's type of each id: CONTROL (3) for special added tokens, USER_DEFINED (4) for
    the other added ones, UNKNOWN (2), BYTE (6) for <0xNN>, NORMAL (1)."""
    import re

    backend = original.hf.backend_tokenizer
    added = {int(i): t for i, t in backend.get_added_tokens_decoder().items()}
    types = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.id_to_token(i)
        if original.case.sentencepiece and text == "<unk>":
            types.append(2)
        elif i in added:
            types.append(3 if added[i].special else 4)
        elif original.case.sentencepiece and re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            types.append(6)
        else:
            types.append(1)
    return types


def write_gguf_vocab(original: Original, path: Path) -> Path:
    """The vocabulary of ``original`` as a vocabulary-only GGUF file at ``path``."""
    import gguf

    w = gguf.GGUFWriter(path, original.case.architecture)
    add_vocab(w, original)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_vocab(w: Any, original: Original) -> None:
    """Write ``original``'s vocabulary into the GGUFWriter ``w`` (``tokenizer.*`` keys)."""
    case, backend = original.case, original.hf.backend_tokenizer
    types = _token_types(original)
    tokens = [backend.id_to_token(i) for i in range(backend.get_vocab_size(with_added_tokens=True))]
    if case.sentencepiece:  # the converter writes a user-defined piece's "▁" as the space it stands for
        tokens = [t.replace(SPACE, " ") if k == 4 else t for t, k in zip(tokens, types)]
    w.add_tokenizer_model("llama" if case.sentencepiece else "gpt2")
    w.add_tokenizer_pre(case.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if case.sentencepiece:
        # From tokenizer.model: a learnt piece's score falls with its merge order (sentencepiece
        # scores a BPE piece by minus its rank); the meta and byte pieces score 0.
        scores = [-1000.0 if case.flat_scores else (-float(i) if k == 1 else 0.0) for i, k in enumerate(types)]
        w.add_token_scores(scores)
        w.add_unk_token_id(tokens.index("<unk>"))
        if not case.prefix_space:
            w.add_add_space_prefix(False)
    else:
        merges = json.loads(backend.to_str())["model"]["merges"]
        w.add_token_merges([" ".join(m) for m in merges])
    if case.bos is not None:
        w.add_bos_token_id(tokens.index(case.bos))
    w.add_eos_token_id(tokens.index(case.eos))
    w.add_add_bos_token(case.add_bos)
    w.add_add_eos_token(False)
    w.add_chat_template(case.template)


def llama_cpp_spm(tokens: list[str], scores: list[float], types: list[int], text: str, prefix_space: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenizing written out plainly, for text with no control token
    in it: user-defined tokens are cut out of the text first (longest first, each leftmost
    first); in each run of text between them (a "▁" before it where ``prefix_space`` and it
    starts the text or follows such a token), from the characters, merge the adjacent pair
    whose concatenation is a token of the highest score (leftmost on a tie) until none is; a
    piece still not a token (a character the vocabulary lacks) becomes its UTF-8 bytes'
    <0xNN> tokens."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    fragments: list[str | int] = [text] if text else []
    for whole in sorted({t for t, k in zip(tokens, types) if k == 4}, key=len, reverse=True):
        cut: list[str | int] = []
        for f in fragments:
            for j, part in enumerate(f.split(whole) if isinstance(f, str) else [f]):
                cut += ([ids[whole]] if j else []) + ([part] if part != "" else [])
        fragments = cut
    out: list[int] = []
    after_token = True
    for f in fragments:
        if isinstance(f, int):
            out.append(f)
        else:
            out += _merge_loop(ids, scores, (" " if prefix_space and after_token else "") + f)
        after_token = isinstance(f, int)
    return out


def _merge_loop(ids: dict[str, int], scores: list[float], text: str) -> list[int]:
    pieces = list(text.replace(" ", SPACE))
    while True:
        best: tuple[float, int] | None = None
        for j in range(len(pieces) - 1):
            i = ids.get(pieces[j] + pieces[j + 1])
            if i is not None and (best is None or scores[i] > best[0]):
                best = (scores[i], j)
        if best is None:
            break
        j = best[1]
        pieces[j : j + 2] = [pieces[j] + pieces[j + 1]]
    out: list[int] = []
    for p in pieces:
        out += [ids[p]] if p in ids else [ids[f"<0x{b:02X}>"] for b in p.encode()]
    return out
