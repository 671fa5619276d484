"""``quant="gguf"``: an engine on a GGUF's own quantized blocks.

Family checkpoints (``tests/helpers/families.py``, random weights) are written as GGUF files
whose matrices the gguf package quantizes to Q8_0 / Q4_0 / Q4_1, several formats in one layer
(q, k and v of three formats stack into one product of three parts), and, 256 wide (the K
formats' super-block), to Q4_K / Q6_K (``tests/helpers/kquants.py``) in llama.cpp's Q4_K_M
manner: Q6_K for v, down and the embedding / head, Q4_K for the rest. Two references:

  * the same engine with the products on the float64 reference (``gguf_quant.reference_linear``:
    the same blocks dequantized, the activations quantized as the C does): the first step's
    logits (each prompt's prefill) equal to float32 rounding at every kernel level
    (``EMULATION_TOL``), so the C products, their wiring, the permuted rows and q's scale are
    exact. Only the first step: later, a float32 rounding difference can flip one activation's
    int8 rounding in a later product, which these random models amplify (measured up to 2 %;
    within the first step already on gemma3 and the 256-wide K files). So every product the
    engine runs is also held to its own float64 reference on its own input, at every level;
  * the same engine on the file's weights dequantized to float32 (the ordinary load): the two
    differ by the activations' int8 rounding only, which on these random 2-layer models moves
    the logits by up to 5 % of their largest (measured 0.14-0.40 at logits up to 5-11): within
    ``FLOAT_TOL`` of the largest, and the greedy tokens equal wherever float32's top-1 margin
    exceeds twice the step's largest logit difference (after a near tie the two may part).

Also: the weights are the file's bytes (no float copy), and what is refused, with its message;
and on SmolLM2's own file (Q4_1, the embedding Q8_0), the amx level's logits, through prefill
chunks and decode batches of 16 rows and more (its tiles), equal the avx512 level's.
"""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

import numpy as np
import pytest

from kvfleet_models.errors import ModelLoadError
from kvfleet_models.gguf_blocks import BlockTensor
from kvfleet_models.registry import load_model, load_model_blocks
from tests.helpers.engine_drive import drive
from tests.helpers.families import CASES, Case, make_checkpoint, prompts
from tests.helpers.gguf_families import write_gguf
from tests.helpers.models import SMOLLM2, needs_smollm2
from worker_svc.convert import info_to_pb
from worker_svc.engine import Engine, EngineConfig
from worker_svc.model import gguf_quant

# Each matrix's format: every format in the attention and MLP products, mixed within qkv and
# gate_up; the head Q4_0 where untied, the embedding Q8_0 (smollm2's).
QUANT = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q8_0", "ffn_down": "Q4_1", "token_embd": "Q8_0", "output": "Q4_0"}  # fmt: skip
# llama: q/k rows permuted in the file, tied head; qwen2: q/k/v biases, NeoX rows, tied;
# qwen3: q/k norms, untied (a quantized embedding beside the head); gemma3: scaled embedding,
# sandwich norms, soft-capped logits.
FILES = {name: (CASES[name], QUANT) for name in ("llama-linear-tied", "qwen2", "qwen3", "gemma3")}
# The K formats need rows a multiple of 256 wide: the same families at hidden 256, FFN 512.
K_QUANT = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K", "output": "Q6_K"}  # fmt: skip
_WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
FILES["llama-k"] = (Case("llama", "LlamaConfig", {**_WIDE, "tie_word_embeddings": True}), K_QUANT)
FILES["qwen3-k"] = (Case("qwen3", "Qwen3Config", {**_WIDE, "head_dim": 64}), {**K_QUANT, "token_embd": "Q4_K"})
EMULATION_TOL = 1e-3  # of the largest |logit|
FLOAT_TOL = 0.08  # of the largest |logit|: measured <= 0.046 (K files <= 0.023); a wrong row order gives ~1
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=list(FILES))
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    case, quant = FILES[name]
    root = tmp_path_factory.mktemp(name)
    hf = make_checkpoint(case, root / "hf", seed=11)
    return write_gguf(case, hf, root / f"{name}.gguf", quant=quant)


def _engine(path: Path, quant: str) -> Engine:
    """kv_dtype float32: these tests hold the products, so the KV is kept as the float32
    engine keeps it (gguf's default float16 KV adds a rounding of 5e-4 that these random
    models amplify like an int8 flip); the float16 KV is held in test_kv_dtype.py."""
    cfg, weights = load_model_blocks(str(path)) if quant == "gguf" else load_model(str(path))
    return Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=64, quant=quant, kv_dtype="float32"))


def _skip_unless_runnable(level: str) -> None:
    runnable = gguf_quant.runnable_levels()
    if level not in runnable:
        pytest.skip(f"this CPU does not run the {level} kernels (it runs {', '.join(runnable)})")


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
def test_every_level_equals_the_float64_emulation(gguf_file: Path, level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_unless_runnable(level)
    if gguf_file.stem == "gemma3" or gguf_file.stem.endswith("-k"):
        # gemma3's sandwich norms, and the 256-wide K files (avx512 measured 0.8 % off while
        # every product was within 3e-7 of its reference): see the test below
        pytest.skip("one int8 rounding flip is amplified by this random model (module docstring)")
    monkeypatch.setenv("KVFLEET_Q8_LEVEL", level)
    plan = prompts()
    engine = _engine(gguf_file, "gguf")
    assert engine.model.kernel_level == level
    tokens, logits = drive(engine, plan, NEW_TOKENS)
    monkeypatch.setattr(gguf_quant, "load_kernels", lambda level=None: None)
    emulated = _engine(gguf_file, "gguf")
    assert emulated.model.kernel_level == "torch"
    _, ref_logits = drive(emulated, plan, NEW_TOKENS)
    for got, want in zip(logits, ref_logits):
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=EMULATION_TOL * float(np.abs(want[0]).max()))


@pytest.mark.parametrize("level", gguf_quant.LEVELS)
def test_every_product_in_the_engine_equals_its_float64_reference(
    gguf_file: Path, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each product a prefill and a decode run (every layer's parts, q's scale, ``out``
    accumulated), against the float64 reference on that product's own input: the check the
    end-to-end emulation makes, immune to a rounding flip carried on to later products. (The
    steps of ``drive`` reach 16 rows and more: the amx level's tiles run.)"""
    _skip_unless_runnable(level)
    monkeypatch.setenv("KVFLEET_Q8_LEVEL", level)
    run = gguf_quant.GGUFKernels.linear
    formats: set[str] = set()

    def checked(kernels: gguf_quant.GGUFKernels, x, w, out=None):  # type: ignore[no-untyped-def]
        ref = gguf_quant.reference_linear(x, w) + (0.0 if out is None else out.double())
        y = run(kernels, x, w, out)
        atol = 2e-6 * float(ref.abs().max()) * w.in_features**0.5  # as test_gguf_kernels
        np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=0, atol=atol)
        formats.update(p.format.name for p in w.parts)
        return y

    monkeypatch.setattr(gguf_quant.GGUFKernels, "linear", checked)
    drive(_engine(gguf_file, "gguf"), prompts(), 2)
    import gguf

    tensors = {t.name: t.tensor_type.name for t in gguf.GGUFReader(gguf_file).tensors if len(t.shape) == 2}
    if "output.weight" in tensors:  # untied: the embedding is looked up, never multiplied
        del tensors["token_embd.weight"]
    assert formats == set(tensors.values())


def test_greedy_tokens_and_logits_match_the_dequantized_float32_engine(gguf_file: Path) -> None:
    plan = prompts()
    ref_tokens, ref_logits = drive(_engine(gguf_file, "none"), plan, NEW_TOKENS)
    tokens, logits = drive(_engine(gguf_file, "gguf"), plan, NEW_TOKENS)
    for want, got, want_logits, got_logits in zip(ref_tokens, tokens, ref_logits, logits):
        for step in range(NEW_TOKENS):
            tol = FLOAT_TOL * float(np.abs(want_logits[step]).max())
            # same inputs so far: the logits agree
            np.testing.assert_allclose(got_logits[step], want_logits[step], rtol=0, atol=tol)
            top2 = np.sort(want_logits[step])[-2:]
            if top2[1] - top2[0] < 2 * float(np.abs(got_logits[step] - want_logits[step]).max()):
                break  # a near tie: the quantized engine may pick the other token from here on
            assert got[step] == want[step]


def test_weights_are_the_files_blocks_with_no_float_copy(gguf_file: Path) -> None:
    import gguf

    cfg, weights = load_model_blocks(str(gguf_file))
    engine = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=8, quant="gguf"))
    model = engine.model
    for layer in model.layers:
        for m in layer.matrices():
            assert m.gguf is not None and m.kn is None and m.nk is None and m.q8 is None
    assert model.lm_head.gguf is not None and model.embed is None and model.embed_blocks is not None
    # o's blocks are the file's bytes as they lie (o's rows are not permuted)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}
    o = model.layers[1].o.gguf
    assert o is not None and len(o.parts) == 1
    assert np.array_equal(o.parts[0].data.reshape(-1), np.asarray(tensors["blk.1.attn_output.weight"].data).reshape(-1))
    # qkv: a part per run of one format (three formats, three parts; Q4_K q and k merged)
    quant = FILES[gguf_file.stem][1]
    qkv = model.layers[0].qkv.gguf
    formats = [quant["attn_q"], quant["attn_k"], quant["attn_v"]]
    assert qkv is not None and [p.format.name for p in qkv.parts] == [f for f, _ in groupby(formats)]
    float_bytes = Engine(*load_model(str(gguf_file)), EngineConfig(block_size=4, num_blocks=8)).weight_bytes
    assert engine.weight_bytes < float_bytes / 3


def test_a_model_that_is_not_a_gguf_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="--quant gguf serves a GGUF file's own quantized blocks: 'tiny'"):
        load_model_blocks("tiny")


def test_float_weights_are_refused_by_the_model(gguf_file: Path) -> None:
    cfg, weights = load_model(str(gguf_file))
    with pytest.raises(ValueError, match="quant=gguf runs on a GGUF's own blocks"):
        Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=8, quant="gguf"))


@pytest.mark.parametrize("device, dtype", [("cuda", "float32"), ("cpu", "bfloat16")])
def test_another_device_or_dtype_is_refused(device: str, dtype: str) -> None:
    with pytest.raises(ValueError, match="quant=gguf runs on the CPU with dtype float32"):
        EngineConfig(quant="gguf", device=device, dtype=dtype)


@pytest.mark.parametrize("fmt", ["F16", "Q5_0"])
def test_a_tensor_type_without_kernels_is_refused_naming_those_served(fmt: str, tmp_path: Path) -> None:
    hf = make_checkpoint(CASES["qwen2"], tmp_path / "hf", seed=1)
    path = write_gguf(CASES["qwen2"], hf, tmp_path / "m.gguf", quant={**QUANT, "ffn_down": fmt})
    with pytest.raises(ModelLoadError) as info:
        load_model_blocks(str(path))
    message = str(info.value)
    assert f"blk.0.ffn_down.weight is {fmt}; --quant gguf serves Q8_0, Q4_0, Q4_1, Q4_K, Q6_K weights" in message, (
        message
    )
    load_model(str(path))  # the ordinary load still dequantizes it


def test_the_worker_s_help_names_the_formats_served(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfleet_models.gguf_blocks import FORMATS
    from worker_svc.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"own quantized blocks ({', '.join(FORMATS)})" in text, text


def test_phi3_s_fused_blocks_are_refused_and_its_float_load_still_works(tmp_path: Path) -> None:
    """README: Phi-3's fused q/k/v and gate/up are not split in blocks yet, so --quant gguf
    refuses the file with a message saying so; without it the file loads dequantized."""
    hf = make_checkpoint(CASES["phi3"], tmp_path / "hf", seed=1)
    path = write_gguf(CASES["phi3"], hf, tmp_path / "phi3.gguf", quant=QUANT)
    with pytest.raises(ModelLoadError, match="does not split phi3's fused q/k/v and gate/up blocks"):
        load_model_blocks(str(path))
    cfg, weights = load_model(str(path))
    assert cfg.num_layers > 0 and "model.layers.0.self_attn.q_proj.weight" in weights


def test_worker_builds_the_gguf_engine(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no level asked for, at the best this CPU runs (a KVFLEET_Q8_LEVEL in the caller's
    environment, as in a run capped at avx2, would pick another)."""
    from worker_svc.config import WorkerConfig
    from worker_svc.model.q8 import LEVEL_ENV
    from worker_svc.server import build_engine

    monkeypatch.delenv(LEVEL_ENV, raising=False)
    cfg, engine = build_engine(WorkerConfig(model=str(gguf_file), quant="gguf", num_blocks=8, metrics_port=0))
    assert engine.quant == "gguf" and engine.model.kernel_level == gguf_quant.runnable_levels()[-1]
    assert info_to_pb("w", cfg, engine, 8, 16, "i0").kernels == engine.model.kernel_level  # GetInfo says it
    assert isinstance(load_model_blocks(str(gguf_file))[1]["model.layers.0.mlp.down_proj.weight"], BlockTensor)


@needs_smollm2
def test_smollm2_logits_at_the_amx_level_equal_the_avx512_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's Q4_1 file, prompts of 40, 33 and 21 tokens in chunks (16-25 rows a step) and
    then their decodes beside the others' prefill: every product's floats are the same at both
    levels, so the logits and tokens are too (up to threads' order, which does not enter here:
    each output element is summed by one thread)."""
    _skip_unless_runnable("amx")
    cfg, weights = load_model_blocks(SMOLLM2)
    rng = np.random.default_rng(5)
    plan = [rng.integers(100, 49000, size=n).tolist() for n in (40, 33, 21)]
    runs = {}
    for level in ("avx512", "amx"):
        monkeypatch.setenv("KVFLEET_Q8_LEVEL", level)
        engine = Engine(cfg, weights, EngineConfig(block_size=16, num_blocks=16, quant="gguf"))
        assert engine.model.kernel_level == level
        runs[level] = drive(engine, plan, 4)
    (tokens, logits), (tokens_amx, logits_amx) = runs["avx512"], runs["amx"]
    assert tokens_amx == tokens
    for want, got in zip(logits, logits_amx):
        np.testing.assert_array_equal(got, want)
