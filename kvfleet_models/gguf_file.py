"""A GGUF file's metadata and tensor table, read in one pass.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every metadata value: for
SmolLM2's 49,152 tokens and 48,900 merges that is ~2 M memmap views and 3.4 s a load (a worker
and its tokenizer each open the file, so every SmolLM2 start paid ~7 s). Here the header and
the key/value section are parsed with ``struct`` into plain Python values, numeric arrays with
one ``np.frombuffer``; tensor data stays in the memory-mapped file until a loader copies it.

Layout (little-endian; version 2 and 3): magic ``GGUF``, u32 version, u64 tensor count,
u64 key/value count; each key/value: string key, u32 value type, value (a string is u64 length
+ UTF-8 bytes; an array is u32 item type + u64 count + items); each tensor: string name,
u32 dimension count, u64 dimensions (innermost first), u32 ggml type, u64 offset from the data
section, which starts at the next multiple of ``general.alignment`` (32 when absent).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfleet_models.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# Value type codes of the GGUF spec.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
# Scalar types: struct format and numpy dtype (both little-endian).
_SCALARS: dict[int, tuple[str, str]] = {
    UINT8: ("<B", "<u1"),
    INT8: ("<b", "<i1"),
    UINT16: ("<H", "<u2"),
    INT16: ("<h", "<i2"),
    UINT32: ("<I", "<u4"),
    INT32: ("<i", "<i4"),
    FLOAT32: ("<f", "<f4"),
    BOOL: ("<?", "<?"),
    UINT64: ("<Q", "<u8"),
    INT64: ("<q", "<i8"),
    FLOAT64: ("<d", "<f8"),
}
_STRUCTS = {vtype: struct.Struct(fmt) for vtype, (fmt, _) in _SCALARS.items()}
# Tensor types read as numbers rather than bytes of blocks (as gguf-py's reader gives them).
_PLAIN_TENSORS = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class GgufTensor:
    """One tensor's entry; ``data`` is a view of the mapped file (copy it to keep it)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType (its ``.name``: "Q4_1", "F32", ...)
    shape: tuple[int, ...]  # the file's order: innermost dimension first (ggml's ne)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # numbers for F32/F16/..., else [rows..., bytes a row] uint8


class GgufFile:
    """A parsed GGUF file: ``values`` (key -> str / int / float / bool, or a list of them for
    an array), ``types`` (key -> value type code; an array's is ``ARRAY``, its items' in
    ``item_types``) and ``tensors`` in file order. ModelLoadError for a file that is not GGUF,
    is damaged or truncated, or is big-endian."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # for the ggml type enum and block sizes

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        # A plain ndarray over the mapping: slices of an np.memmap pay a Python hook each.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self.values: dict[str, Any] = {}
        self.types: dict[str, int] = {}
        self.item_types: dict[str, int] = {}
        try:
            self._pos = 4
            self.version = self._scalar(UINT32)
            if self.version not in (2, 3):
                hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
                raise ModelLoadError(
                    f"{self.path}: corrupt or truncated GGUF file (version {self.version}; 2 and 3 are read{hint})"
                )
            n_tensors, n_values = self._scalar(UINT64), self._scalar(UINT64)
            for _ in range(n_values):
                key = self._string()
                if key in self.values:
                    raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (metadata key {key!r} twice)")
                vtype = self._scalar(UINT32)
                self.types[key] = vtype
                if vtype == ARRAY:
                    self.item_types[key] = self._scalar(UINT32)
                    self.values[key] = self._array(self.item_types[key])
                else:
                    self.values[key] = self._value(vtype)
            entries = [self._tensor_entry() for _ in range(n_tensors)]
        except (_Truncated, struct.error):
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (its header ends early)") from None
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (a string is not UTF-8: {e})") from None
        except RecursionError:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (arrays nested too deep)") from None
        alignment = self.values.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (general.alignment is {alignment!r})")
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[GgufTensor] = []
        names: set[str] = set()
        for name, dims, code, offset in entries:
            if name in names:
                raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (tensor {name!r} appears twice)")
            names.add(name)
            try:
                ttype = gguf.GGMLQuantizationType(code)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name} has an unknown ggml type {code}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[ttype]
            n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise ModelLoadError(
                    f"{self.path}: corrupt or truncated GGUF file (tensor {name} rows of {dims[0]} in blocks of {block})"
                )
            n_bytes = n_elements // block * type_size
            begin = start + offset
            if begin + n_bytes > size:
                raise ModelLoadError(
                    f"{self.path}: corrupt or truncated GGUF file ({size} bytes, tensors need {begin + n_bytes})"
                )
            raw = self._map[begin : begin + n_bytes]
            outer_first = tuple(reversed(dims))
            if ttype.name in _PLAIN_TENSORS:
                data = raw.view(_PLAIN_TENSORS[ttype.name]).reshape(outer_first)
            else:  # blocks: each row's bytes
                data = raw.reshape(*outer_first[:-1], dims[0] // block * type_size) if dims else raw
            self.tensors.append(GgufTensor(name, ttype, dims, n_elements, n_bytes, begin, data))

    # -- the key/value section --------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise _Truncated
        view = self._buf[self._pos : end]
        self._pos = end
        return view

    def _scalar(self, vtype: int) -> Any:
        unpack = _STRUCTS[vtype]
        (value,) = unpack.unpack_from(self._buf, self._pos)
        self._pos += unpack.size
        return value

    def _string(self) -> str:
        return bytes(self._take(self._scalar(UINT64))).decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype not in _SCALARS:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (metadata value type {vtype})")
        return self._scalar(vtype)

    def _array(self, itype: int) -> list[Any]:
        count = self._scalar(UINT64)
        if itype == STRING:  # the vocabulary: one loop, no per-item views
            buf, pos, end, out = self._buf, self._pos, len(self._buf), []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                if pos + 8 > end:
                    raise _Truncated
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    raise _Truncated
                out.append(str(buf[pos : pos + n], "utf-8"))
                pos += n
            self._pos = pos
            return out
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype][1])
            return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).tolist()
        if itype == ARRAY:  # arrays of arrays (no model here uses them): item by item
            return [self._array(self._scalar(UINT32)) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (array item type {itype})")

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar(UINT32)
        if n_dims > 8:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (tensor {name} has {n_dims} dimensions)")
        dims = tuple(int(d) for d in np.frombuffer(self._take(8 * n_dims), dtype="<u8"))
        return name, dims, self._scalar(UINT32), self._scalar(UINT64)
