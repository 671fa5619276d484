"""Our GGUF reader (kvfleet_models/gguf_file.py) reads what gguf-py's own reader reads: every
metadata value with its type, every tensor's entry and bytes; a damaged file is a
ModelLoadError wherever it is cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfleet_models.errors import ModelLoadError
from kvfleet_models.gguf_file import ARRAY, GgufFile
from tests.helpers.models import needs_smollm2, require_smollm2


def _theirs(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], list[Any]]:
    import gguf

    reader = gguf.GGUFReader(path)
    values, types = {}, {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the header
            continue
        values[key] = field.contents()
        types[key] = tuple(int(t) for t in field.types)
    return values, types, reader.tensors


def _assert_same(path: Path) -> GgufFile:
    ours = GgufFile(path)
    values, types, tensors = _theirs(path)
    assert ours.values == values
    for key, vtype in types.items():
        mine = (ours.types[key], ours.item_types[key]) if ours.types[key] == ARRAY else (ours.types[key],)
        # gguf-py lists an array's type, then its items' (a nested array: each level's)
        assert mine == (vtype[0], vtype[-1]) if vtype[0] == ARRAY else mine == vtype, key
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.n_elements,
            theirs.n_bytes,
            theirs.data_offset,
        ), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data, equal_nan=mine.data.dtype.kind == "f"), mine.name
    return ours


def _every_kind(path: Path, alignment: int | None) -> Path:
    """A file with a value of every type, arrays of each, and tensors of plain and block types
    in 1 to 3 dimensions."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 3.141592653589793)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 世界")
    writer.add_string("t.empty", "")
    writer.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>", "ü" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25, 1e-6])
    writer.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, (2, 3, 4)).astype(np.int32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        rows = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        writer.add_tensor(qtype.name.lower(), rows, raw_dtype=qtype)  # shape: of its bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_kind_reads_as_gguf_py_reads_it(tmp_path: Path, alignment: int | None) -> None:
    ours = _assert_same(_every_kind(tmp_path / "kinds.gguf", alignment))
    assert ours.values["t.strs"][-1] == "ü" * 300
    assert ours.values["t.u64"] == 2**63 + 5 and ours.values["t.bool"] is True
    if alignment is not None:
        assert all(t.data_offset % alignment == 0 for t in ours.tensors)


@needs_smollm2
def test_smollm2_reads_as_gguf_py_reads_it() -> None:
    ours = _assert_same(require_smollm2())
    assert len(ours.values["tokenizer.ggml.tokens"]) == 49152  # the vocabulary, whole
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "F32"}


def test_a_file_cut_anywhere_is_a_load_error(tmp_path: Path) -> None:
    data = _every_kind(tmp_path / "whole.gguf", None).read_bytes()
    header_end = GgufFile(tmp_path / "whole.gguf").tensors[0].data_offset
    cuts = sorted({*range(4, header_end, 7), header_end - 1, len(data) - 1})
    for cut in cuts:
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file"):
            GgufFile(path)


def test_damaged_headers_name_what_is_wrong(tmp_path: Path) -> None:
    data = bytearray(_every_kind(tmp_path / "whole.gguf", None).read_bytes())
    cases = {
        "version 7": (4, (7).to_bytes(4, "little")),
        "(a big-endian file?)": (4, (3).to_bytes(4, "big")),
        "metadata value type 99": (24 + 8 + len("general.architecture"), (99).to_bytes(4, "little")),
    }
    for says, (at, patch) in cases.items():
        bad = bytearray(data)
        bad[at : at + len(patch)] = patch
        (tmp_path / "bad.gguf").write_bytes(bytes(bad))
        with pytest.raises(ModelLoadError) as info:
            GgufFile(tmp_path / "bad.gguf")
        assert says in str(info.value) and str(tmp_path / "bad.gguf") in str(info.value)
    (tmp_path / "other.gguf").write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GgufFile(tmp_path / "other.gguf")
