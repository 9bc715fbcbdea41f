"""GGUF reader: metadata as a plain dict, tensors as QuantTensor views over one mmap.

The `gguf` package supplies the format's constants (value types, quant type
ids, alignment key). Its GGUFReader builds a numpy object per metadata item
(about 2 s for a 49k-token vocabulary), which alone would blow the
time-to-first-token budget, so the header is parsed here with one
sequential pass over the mapped bytes; tests hold the result to GGUFReader.

Metadata arrays stay in the mapped file rather than becoming Python lists (a
262k-token vocabulary as lists of str and float costs ~35 MiB of heap): an
array of numbers is a read-only numpy view of the file, an array of strings a
:class:`StringArray` that decodes each string when it is read.
"""

from __future__ import annotations

import mmap
import operator
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from edgerun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U64 = struct.Struct("<Q")
_NUMPY = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. dims are GGUF order (fastest-varying first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # absolute byte offset in the file


@dataclass
class GGUFFile:
    """An opened GGUF: metadata dict and lazily viewed tensors over one mmap."""

    path: Path
    version: int
    metadata: dict[str, Any]
    infos: dict[str, TensorInfo]
    file_size: int
    _buf: Any = field(repr=False, default=None)

    def tensor(self, name: str) -> QuantTensor:
        """A zero-copy view of one tensor's raw blocks."""
        info = self.infos.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path}: tensor '{name}' is missing from the file")
        try:
            qtype = QuantType(info.type_id)
        except ValueError:
            from gguf.constants import GGMLQuantizationType

            try:
                tname = GGMLQuantizationType(info.type_id).name
            except ValueError:
                tname = f"type id {info.type_id}"
            supported = ", ".join(t.name for t in QuantType)
            raise UnsupportedError(
                f"{self.path}: tensor '{name}' is stored as {tname}, which edgerun does not "
                f"support yet (supported: {supported})"
            ) from None
        cols = info.dims[0]
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        elems, nbytes = BLOCK_LAYOUT[qtype]
        if cols % elems:
            raise ModelFormatError(
                f"{self.path}: tensor '{name}' has row length {cols}, not a multiple of the "
                f"{qtype.name} block size {elems}"
            )
        rb = cols // elems * nbytes
        end = info.offset + rows * rb
        if end > self.file_size:
            raise ModelFormatError(
                f"{self.path}: tensor '{name}' ends at byte {end} but the file has only "
                f"{self.file_size} bytes (truncated download?)"
            )
        data = np.frombuffer(self._buf, dtype=np.uint8, count=rows * rb, offset=info.offset)
        return QuantTensor(name, qtype, (rows, cols), data.reshape(rows, rb))

    def tensor_names(self) -> list[str]:
        return list(self.infos)


class _Cursor:
    __slots__ = ("buf", "pos", "path", "size")

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise ModelFormatError(
                f"{self.path}: file ends inside the header while reading {what} "
                f"(offset {self.pos}, file size {self.size}); the file is truncated or corrupt"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise ModelFormatError(
                f"{self.path}: unknown metadata value type {vtype} for {what}"
            ) from None
        if vt == GGUFValueType.STRING:
            return self.string(what)
        if vt == GGUFValueType.ARRAY:
            itype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[GGUFValueType(itype)]).newbyteorder("<")
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr  # read-only: the file is mapped with ACCESS_READ
            if itype == GGUFValueType.STRING:
                return self._string_array(count, what)
            return [self.value(itype, what) for _ in range(count)]
        return self.unpack(_SCALAR[vt], what)

    def _string_array(self, count: int, what: str) -> StringArray:
        # Each string: a u64 length, then its bytes. The fast pass leaves bounds to struct and
        # one check at the end; a file that fails them is walked again, checked, for the error.
        base = pos = self.pos
        buf = self.buf
        unpack = _U64.unpack_from
        offsets = array("q", [0])
        append = offsets.append
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
                append(pos - base)
        except (struct.error, OverflowError):
            pos = self.size + 1
        if pos > self.size:
            self._check_strings(count, what)
        self.pos = pos
        if pos - base < 1 << 32:
            offsets = array("I", offsets)
        return StringArray(buf, base, offsets)

    def _check_strings(self, count: int, what: str) -> None:
        """Walk a string array with bounds checks; raises where it leaves the file."""
        for _ in range(count):
            n = self.unpack("<Q", what)
            self.need(n, what)
            self.pos += n


class StringArray(Sequence[str]):
    """A GGUF metadata array of strings, read from the mapped file when accessed.

    Behaves as a read-only list of ``str`` (len, indexing, slicing, iteration, ``==`` with a
    list); each access decodes the string again (UTF-8, invalid bytes replaced), so keep the
    result when one string is read many times. :meth:`tolist` gives a plain list.
    """

    __slots__ = ("_buf", "_base", "_offsets")

    def __init__(self, buf: Any, base: int, offsets: Sequence[int]) -> None:
        # String i: a u64 length at base + offsets[i], its bytes up to base + offsets[i + 1].
        self._buf = buf
        self._base = base
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("StringArray index out of range")
        start = self._base + self._offsets[i] + 8
        end = self._base + self._offsets[i + 1]
        return self._buf[start:end].decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        buf, start, end = self._buf, self._base + 8, self._base
        ends = iter(self._offsets)
        next(ends)
        for a, b in zip(self._offsets, ends):
            yield buf[start + a : end + b].decode("utf-8", errors="replace")

    def tolist(self) -> list[str]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if n > 3 else ''}], len={n})"


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file: parse its header, map its tensor data without copying."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a directory, expected a .gguf file")
    size = path.stat().st_size
    if size < 24:
        raise ModelFormatError(f"{path}: {size} bytes is too small to be a GGUF file")
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    magic = cur.unpack("<I", "magic")
    if magic != GGUF_MAGIC:
        raise ModelFormatError(
            f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')"
        )
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise UnsupportedError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise ModelFormatError(
            f"{path}: implausible header counts ({n_tensors} tensors, {n_kv} keys)"
        )
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.unpack("<I", f"type of '{key}'")
        meta[key] = cur.value(vtype, f"metadata '{key}'")
    raw_infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        nd = cur.unpack("<I", f"dims of '{name}'")
        if nd > 8:
            raise ModelFormatError(f"{path}: tensor '{name}' claims {nd} dimensions")
        dims = tuple(cur.unpack("<Q", f"dims of '{name}'") for _ in range(nd))
        tid = cur.unpack("<I", f"type of '{name}'")
        off = cur.unpack("<Q", f"offset of '{name}'")
        raw_infos.append((name, dims, tid, off))
    align = int(meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = (cur.pos + align - 1) // align * align
    infos = {
        name: TensorInfo(name, dims, tid, data_start + off) for name, dims, tid, off in raw_infos
    }
    return GGUFFile(path, version, meta, infos, size, buf)


class GGUFSource:
    """A GGUF file as a conversion source (edgerun.formats.repack; HFCheckpoint is the
    Hugging Face counterpart)."""

    kind = "gguf"

    def __init__(self, path: str | os.PathLike) -> None:
        from edgerun.arch import spec_from_gguf

        self.path = Path(path)
        self.file = read_gguf(self.path)
        self.metadata = self.file.metadata
        self.spec = spec_from_gguf(self.metadata, str(self.path))

    def tensor_names(self) -> list[str]:
        return self.file.tensor_names()

    def tensor(self, name: str) -> QuantTensor:
        return self.file.tensor(name)

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: self.file.tensor(n).shape for n in self.file.tensor_names()}

    def source_types(self) -> dict[str, QuantType]:
        return {n: self.file.tensor(n).qtype for n in self.file.tensor_names()}

    def float_tensor(self, name: str) -> np.ndarray:
        from edgerun.quant.reference import dequantize

        t = self.file.tensor(name)
        return dequantize(t.qtype, t.data).reshape(t.shape)

    def tokenizer_section(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        meta = {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}
        return {"kind": "gguf", "metadata": meta}, {}

    def sha256(self) -> str:
        import hashlib

        h = hashlib.sha256()
        with open(self.path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        return h.hexdigest()
