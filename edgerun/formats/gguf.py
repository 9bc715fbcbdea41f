"""GGUF reader: metadata as a plain dict, tensors as QuantTensor views over one mmap.

The `gguf` package supplies the format's constants (value types, quant type
ids, alignment key). Its GGUFReader builds a numpy object per metadata item
(about 2 s for a 49k-token vocabulary), which alone would blow the
time-to-first-token budget, so the header is parsed here with one
sequential pass over the mapped bytes; tests hold the result to GGUFReader.

A model split by llama.cpp's gguf-split (``name-00001-of-00003.gguf``, ...: each shard a GGUF
holding some of the tensors, the first all the metadata, every one ``split.no``,
``split.count`` and ``split.tensors.count``) opens as one :class:`GGUFFile` from any shard's
path: each shard is mapped and a tensor is viewed in the shard that holds it.

Metadata arrays stay in the mapped file rather than becoming Python lists (a
262k-token vocabulary as lists of str and float costs ~35 MiB of heap): an
array of numbers is a read-only numpy view of the file, an array of strings a
:class:`StringArray` that decodes each string when it is read.
"""

from __future__ import annotations

import mmap
import operator
import os
import re
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

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


class GGUFMetadata(dict):
    """The metadata dict, knowing which file it came from (for error messages of code that
    reads it later: the tokenizer builder)."""

    source: str = ""


# A split model's keys (gguf-split, gguf-py's writer): this shard's index from 0, the number of
# shards, the number of tensors in all of them.
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
# Shard i (from 1) of n of a split model is "<prefix>-%05d-of-%05d.gguf" (llama_split_path).
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SHARDS = 9999  # what the five-digit name can number

# Types the well-known keys must have (llama.cpp checks each key's type as it reads it).
# Per-architecture hyperparameters are checked where the spec is built (edgerun.arch).
_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_S, _B = frozenset({GGUFValueType.STRING}), frozenset({GGUFValueType.BOOL})
_KEY_TYPES: dict[str, tuple[str, frozenset, frozenset | None]] = {
    # key: (what, value types, array element types or None for a scalar)
    "general.architecture": ("a string", _S, None),
    "general.name": ("a string", _S, None),
    "general.alignment": ("a u32", _INT_TYPES, None),
    "tokenizer.ggml.model": ("a string", _S, None),
    "tokenizer.ggml.pre": ("a string", _S, None),
    "tokenizer.chat_template": ("a string", _S, None),
    "tokenizer.ggml.tokens": ("an array of strings", frozenset({GGUFValueType.ARRAY}), _S),
    "tokenizer.ggml.merges": ("an array of strings", frozenset({GGUFValueType.ARRAY}), _S),
    "tokenizer.ggml.token_type": (
        "an array of integers",
        frozenset({GGUFValueType.ARRAY}),
        _INT_TYPES,
    ),
    "tokenizer.ggml.scores": (
        "an array of floats",
        frozenset({GGUFValueType.ARRAY}),
        _FLOAT_TYPES | _INT_TYPES,
    ),
    **{
        f"tokenizer.ggml.{k}_token_id": ("an integer", _INT_TYPES, None)
        for k in ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")
    },
    **{k: ("an integer", _INT_TYPES, None) for k in SPLIT_KEYS},
    **{
        f"tokenizer.ggml.{k}": ("a bool", _B, None)
        for k in ("add_bos_token", "add_eos_token", "add_space_prefix", "add_sep_token")
    },
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. dims are GGUF order (fastest-varying first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # absolute byte offset in the file (in shard `shard` of a split model)
    shard: int = 0


@dataclass
class GGUFFile:
    """An opened GGUF: metadata dict and lazily viewed tensors over one mmap, or over one
    mmap per shard of a split model (``shards``: each shard's own GGUFFile, in order;
    ``path`` the first shard's, ``file_size`` all of theirs)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    infos: dict[str, TensorInfo]
    file_size: int
    _buf: Any = field(repr=False, default=None)
    shards: list[GGUFFile] = field(repr=False, default_factory=list)

    @property
    def paths(self) -> list[Path]:
        """The files the model is read from: its shards, or its one file."""
        return [s.path for s in self.shards] or [self.path]

    def release_pages(self, name: str) -> int:
        """Unmap the whole pages inside tensor `name` from this process (MADV_DONTNEED on
        the read-only file mapping: the page cache keeps them and a later read maps them
        again), for a tensor the runtime has copied (qmatvec.interleave). Returns the
        bytes released."""
        if self.shards and name in self.infos:
            return self.shards[self.infos[name].shard].release_pages(name)
        info = self.infos.get(name)
        if info is None or not hasattr(self._buf, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        t = self.tensor(name)
        page = mmap.PAGESIZE
        lo = -(-info.offset // page) * page
        hi = (info.offset + t.nbytes) // page * page
        if hi <= lo:
            return 0
        self._buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return hi - lo

    def tensor(self, name: str) -> QuantTensor:
        """A zero-copy view of one tensor's raw blocks."""
        info = self.infos.get(name)
        if info is None:
            what = f"the {len(self.shards)} shards" if self.shards else "the file"
            raise ModelFormatError(f"{self.path}: tensor '{name}' is missing from {what}")
        if self.shards:
            return self.shards[info.shard].tensor(name)
        try:
            qtype = QuantType(info.type_id)
        except ValueError:
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

    def expert_matrices(
        self, name: str, n_expert: int, shape: tuple[int, int]
    ) -> list[QuantTensor]:
        """Each expert's matrix of a 3-D expert tensor (GGML ne [cols, rows, n_expert]:
        math order [n_expert, rows, cols]) as an ordinary 2-D QuantTensor, a zero-copy view of
        its rows (the experts are consecutive in the file), named '<name>[<expert>]'. The
        tensor must have exactly n_expert experts of `shape` (rows, cols)."""
        info = self.infos.get(name)
        if info is None:
            self.tensor(name)  # the missing-tensor error
        want = (n_expert, *shape)
        found = tuple(reversed(info.dims))
        if found != want:
            raise ModelFormatError(
                f"{self.path}: expert tensor '{name}' has shape {list(found)}, expected "
                f"{list(want)} ([n_expert, rows, cols] from the model's metadata)"
            )
        return self.tensor(name).stacked(n_expert)


# Limits on what a header may claim, checked before anything is allocated or indexed
# (llama.cpp's ggml/src/gguf.cpp enforces the same: strings of at most 1 GiB, at most 4
# dimensions, array payloads inside the file).
MAX_STRING_BYTES = 1 << 30
MAX_NAME_BYTES = 1 << 16  # metadata keys and tensor names (llama.cpp: names < 64 bytes)
# String values up to this size are decoded at open; longer ones (an embedded tokenizer.json
# can be 30 MB) stay in the mapped file as a MappedString, decoded when read.
MAX_EAGER_STRING_BYTES = 1 << 20
MAX_DIMS = 4
MAX_COUNT = 1_000_000  # tensors or metadata keys; real models have a few thousand at most
# Strings in all metadata arrays together (each is walked in Python): the largest real
# vocabularies have ~300k tokens plus as many merges.
MAX_ARRAY_STRINGS = 1 << 21
_INT64_MAX = (1 << 63) - 1
# The fewest bytes one entry can take: a key (u64 length, >= 1 byte), a u32 type and a
# 1-byte value; a tensor info: a name (u64 length, >= 1 byte), u32 n_dims, one u64 dim,
# u32 type and u64 offset.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8


class _Cursor:
    """Sequential reader over the mapped header; every read is bounds-checked first."""

    __slots__ = ("buf", "pos", "path", "size", "strings_left")

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)
        self.strings_left = MAX_ARRAY_STRINGS

    def fail(self, what: str, expected: str, found: Any) -> ModelFormatError:
        return ModelFormatError(
            f"{self.path}: {what}: expected {expected}, found {found} (header offset "
            f"{self.pos}); the file is corrupt or not a valid GGUF"
        )

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFormatError(
                f"{self.path}: file ends inside the header while reading {what}: expected "
                f"{n} more bytes at offset {self.pos}, found {max(0, self.size - self.pos)} "
                f"(file size {self.size}); the file is truncated or corrupt"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, limit: int = MAX_NAME_BYTES) -> str:
        n = self.unpack("<Q", what)
        if n > limit:
            raise self.fail(f"length of {what}", f"at most {limit} bytes", n)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def string_value(self, what: str) -> str | MappedString:
        """A string value: decoded when small, else left in the file (no copy at open)."""
        n = self.unpack("<Q", what)
        if n > MAX_STRING_BYTES:
            raise self.fail(f"length of {what}", f"at most {MAX_STRING_BYTES} bytes", n)
        self.need(n, what)
        start = self.pos
        self.pos += n
        if n <= MAX_EAGER_STRING_BYTES:
            return self.buf[start : start + n].decode("utf-8", errors="replace")
        return MappedString(self.buf, start, n)

    def value(self, vtype: int, what: str) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(
                f"value type of {what}", f"a GGUF value type 0..{max(GGUFValueType)}", vtype
            ) from None
        if vt == GGUFValueType.STRING:
            return self.string_value(what)
        if vt == GGUFValueType.ARRAY:
            itype = self.unpack("<I", f"element type of {what}")
            count = self.unpack("<Q", f"element count of {what}")
            if itype == GGUFValueType.ARRAY:
                raise self.fail(
                    f"element type of {what}", "a scalar or string type", "a nested array"
                )
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[GGUFValueType(itype)]).newbyteorder("<")
                if count > (self.size - self.pos) // dt.itemsize:
                    raise self.fail(
                        f"element count of {what}",
                        f"at most {(self.size - self.pos) // dt.itemsize} "
                        f"{GGUFValueType(itype).name} values (what the rest of the file holds)",
                        count,
                    )
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr  # read-only: the file is mapped with ACCESS_READ
            if itype == GGUFValueType.STRING:
                if count > self.strings_left:
                    raise self.fail(
                        f"element count of {what}",
                        f"at most {self.strings_left} strings (at most {MAX_ARRAY_STRINGS} in "
                        "all metadata arrays)",
                        count,
                    )
                self.strings_left -= count
                if count > (self.size - self.pos) // 8:
                    raise self.fail(
                        f"element count of {what}",
                        f"at most {(self.size - self.pos) // 8} strings (what the rest of the "
                        "file holds)",
                        count,
                    )
                return self._string_array(count, what)
            raise self.fail(
                f"element type of {what}", f"a GGUF value type 0..{max(GGUFValueType)}", itype
            )
        return self.unpack(_SCALAR[vt], what)

    def _string_array(self, count: int, what: str) -> StringArray:
        # Each string: a u64 length, then its bytes. The fast pass leaves bounds to struct and
        # one check at the end; a file that fails them is walked again, checked, for the error.
        base = pos = self.pos
        buf = self.buf
        unpack = _U64.unpack_from
        offsets = array("q", [0])
        append = offsets.append
        size = self.size
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
                if pos > size:
                    break
                append(pos - base)
        except (struct.error, OverflowError):
            pos = size + 1
        if pos > size:
            self._check_strings(count, what)
        self.pos = pos
        if pos - base < 1 << 32:
            offsets = array("I", offsets)
        strings = StringArray(buf, base, offsets)
        longest = strings.max_len()
        if longest > MAX_STRING_BYTES:
            raise self.fail(f"a string of {what}", f"at most {MAX_STRING_BYTES} bytes", longest)
        return strings

    def _check_strings(self, count: int, what: str) -> None:
        """Walk a string array with bounds checks; raises where it leaves the file."""
        for i in range(count):
            n = self.unpack("<Q", f"string #{i} of {what}")
            if n > MAX_STRING_BYTES:
                raise self.fail(
                    f"length of string #{i} of {what}", f"at most {MAX_STRING_BYTES} bytes", n
                )
            self.need(n, f"string #{i} of {what}")
            self.pos += n


class MappedString:
    """A long GGUF string value left in the mapped file; ``str(s)`` decodes it (UTF-8,
    invalid bytes replaced). Code that expects a ``str`` for a key refuses it, as it would
    refuse any other wrong type."""

    __slots__ = ("_buf", "_start", "nbytes")

    def __init__(self, buf: Any, start: int, nbytes: int) -> None:
        self._buf, self._start, self.nbytes = buf, start, nbytes

    def __str__(self) -> str:
        return self._buf[self._start : self._start + self.nbytes].decode("utf-8", "replace")

    def tolist(self) -> str:
        """The decoded text (named as the arrays' method, for JSON export of metadata)."""
        return str(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str(self) == other
        if isinstance(other, MappedString):
            return str(self) == str(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = self._buf[self._start : self._start + 40].decode("utf-8", "replace")
        return f"MappedString({head!r}..., {self.nbytes} bytes)"


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

    def max_len(self) -> int:
        """The longest string's length in bytes (0 when empty), without decoding any."""
        if len(self._offsets) < 2:
            return 0
        dt = np.uint32 if self._offsets.itemsize == 4 else np.int64
        ends = np.frombuffer(memoryview(self._offsets).cast("B"), dtype=dt).astype(np.int64)
        return int((np.diff(ends) - 8).max())

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
    """Open a GGUF file: parse its header, map its tensor data without copying.

    A shard of a split model (``split.count`` > 1) opens the whole model: every shard
    beside it, found by llama.cpp's naming, checked present and consistent.

    The header is untrusted: every count, length, type id, shape and offset is checked
    against the file before anything is allocated or indexed, so a hostile or truncated
    file gets a :class:`ModelFormatError` naming the field, never a crash.
    """
    first = _read_one(path)
    count = first.metadata.get("split.count")
    if count is None or (count == 1 and not first.metadata.get("split.no")):
        return first
    return _read_split(first)


def _split_field(f: GGUFFile, key: str, low: int, high: int) -> int:
    v = f.metadata.get(key)
    if v is None:
        raise ModelFormatError(
            f"{f.path}: metadata '{key}' is missing: expected it in every shard of a split "
            "model (gguf-split writes split.no, split.count and split.tensors.count)"
        )
    if not low <= v <= high:
        raise ModelFormatError(f"{f.path}: metadata '{key}' should be {low}..{high}, found {v}")
    return int(v)


def _read_split(given: GGUFFile) -> GGUFFile:
    """The split model `given` is a shard of, from all its shards (gguf-split's layout:
    metadata in the first, tensors spread over all, each shard's offsets its own)."""
    count = _split_field(given, "split.count", 1, MAX_SHARDS)
    no = _split_field(given, "split.no", 0, count - 1)
    m = _SHARD_NAME.match(given.path.name)
    if m is None or int(m["count"]) != count or int(m["no"]) != no + 1:
        raise ModelFormatError(
            f"{given.path}: metadata 'split.no' = {no}, 'split.count' = {count} make this "
            f"shard {no + 1} of a split model, whose files are named "
            f"'<name>-{no + 1:05d}-of-{count:05d}.gguf'; this one is not, so the other "
            "shards cannot be found (keep the names gguf-split gave them)"
        )
    names = [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    paths = [given.path.with_name(n) for n in names]
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise ModelNotFoundError(
            f"{missing[0]}: shard {paths.index(missing[0]) + 1} of {count} of the split model "
            f"{names[0]} is missing ({len(missing)} of {count} missing; a split model loads "
            "only with every shard beside the others)"
        )
    shards = [given if i == no else _read_one(p) for i, p in enumerate(paths)]
    total = _split_field(shards[0], "split.tensors.count", 0, MAX_COUNT * MAX_SHARDS)
    infos: dict[str, TensorInfo] = {}
    for i, shard in enumerate(shards):
        for key, want in (("split.count", count), ("split.no", i), ("split.tensors.count", total)):
            found = shard.metadata.get(key)
            if found != want:
                raise ModelFormatError(
                    f"{shard.path}: metadata '{key}' should be {want} (shard {i + 1} of the "
                    f"split model {names[0]}), found {found}: the shards are not one model"
                )
        for name, info in shard.infos.items():
            if name in infos:
                raise ModelFormatError(
                    f"{shard.path}: tensor '{name}' is also in {paths[infos[name].shard]}: "
                    "expected each tensor in one shard"
                )
            infos[name] = TensorInfo(name, info.dims, info.type_id, info.offset, i)
    if len(infos) != total:
        raise ModelFormatError(
            f"{shards[0].path}: metadata 'split.tensors.count' = {total} but the {count} "
            f"shards hold {len(infos)} tensors"
        )
    head = shards[0]
    return GGUFFile(
        head.path,
        head.version,
        head.metadata,
        infos,
        sum(s.file_size for s in shards),
        None,
        shards,
    )


def _read_one(path: str | os.PathLike) -> GGUFFile:
    """One GGUF file (a whole model, or one shard of a split one)."""
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
    rest = size - cur.pos
    for what, n, least in (
        ("tensor count", n_tensors, _MIN_TENSOR_INFO_BYTES),
        ("metadata count", n_kv, _MIN_KV_BYTES),
    ):
        most = min(MAX_COUNT, rest // least)
        if n > most:
            raise cur.fail(what, f"at most {most} (what the file can hold)", n)
    meta = GGUFMetadata()
    meta.source = str(path)
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if not key:
            raise cur.fail(f"metadata key #{i}", "a non-empty name", "an empty string")
        if key in meta:
            raise cur.fail(f"metadata key #{i}", "a key not seen before", f"duplicate {key!r}")
        vtype = cur.unpack("<I", f"type of '{key}'")
        want = _KEY_TYPES.get(key)
        if want is not None and vtype not in want[1]:
            raise cur.fail(f"type of metadata '{key}'", want[0], _type_name(vtype))
        if want is not None and want[2] is not None:
            itype = cur.unpack("<I", f"element type of metadata '{key}'")
            if itype not in want[2]:
                raise cur.fail(
                    f"type of metadata '{key}'", want[0], f"an array of {_type_name(itype)}"
                )
            cur.pos -= 4
        meta[key] = cur.value(vtype, f"metadata '{key}'")
    align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int):
        raise cur.fail("metadata 'general.alignment'", "a u32", _describe(align))
    if align <= 0 or align & (align - 1):
        raise cur.fail("metadata 'general.alignment'", "a non-zero power of two", align)
    raw_infos: list[tuple[str, tuple[int, ...], int, int, int]] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        if not name:
            raise cur.fail(f"tensor name #{i}", "a non-empty name", "an empty string")
        if name in seen:
            raise cur.fail(f"tensor name #{i}", "a name not seen before", f"duplicate {name!r}")
        seen.add(name)
        nd = cur.unpack("<I", f"n_dims of tensor '{name}'")
        if not 1 <= nd <= MAX_DIMS:
            raise cur.fail(f"n_dims of tensor '{name}'", f"1..{MAX_DIMS}", nd)
        dims = []
        elems = 1
        for d in range(nd):
            n = cur.unpack("<Q", f"dimension {d} of tensor '{name}'")
            if not 0 < n <= _INT64_MAX:
                found = n - (1 << 64) if n > _INT64_MAX else n
                raise cur.fail(f"dimension {d} of tensor '{name}'", "a positive size", found)
            elems *= n
            if elems > _INT64_MAX:
                raise cur.fail(
                    f"dims of tensor '{name}'",
                    "an element count that fits in 64 bits",
                    f"{' x '.join(str(x) for x in (*dims, n))} = {elems}",
                )
            dims.append(n)
        tid = cur.unpack("<I", f"type of tensor '{name}'")
        layout = _ggml_layout(tid)
        if layout is None:
            raise cur.fail(f"type of tensor '{name}'", "a GGML tensor type id", tid)
        blck, type_size = layout
        if dims[0] % blck:
            raise cur.fail(
                f"dimension 0 of tensor '{name}'",
                f"a multiple of the {GGMLQuantizationType(tid).name} block size {blck}",
                dims[0],
            )
        nbytes = elems // blck * type_size
        off = cur.unpack("<Q", f"offset of tensor '{name}'")
        raw_infos.append((name, tuple(dims), tid, off, nbytes))
    data_start = (cur.pos + align - 1) // align * align
    # As llama.cpp: each tensor starts where the previous one ends, padded to the alignment,
    # so offsets can neither overlap nor break alignment; and the data must be in the file.
    expected = 0
    infos = {}
    for name, dims, tid, off, nbytes in raw_infos:
        if off != expected:
            raise cur.fail(
                f"offset of tensor '{name}'",
                f"{expected} (the previous tensor's end, padded to {align} bytes)",
                off,
            )
        end = data_start + off + nbytes
        if end > size:
            raise ModelFormatError(
                f"{path}: tensor '{name}' ends at byte {end} but the file has only {size} "
                "bytes: expected the whole tensor inside the file (truncated download?)"
            )
        expected = off + (nbytes + align - 1) // align * align
        infos[name] = TensorInfo(name, dims, tid, data_start + off)
    return GGUFFile(path, version, meta, split_fused(meta, infos, str(path)), size, buf)


def split_fused(
    meta: dict[str, Any], infos: dict[str, TensorInfo], source: str
) -> dict[str, TensorInfo]:
    """The tensor directory with each fused matrix of the file's family (arch.spec's
    FUSED_TENSORS: Phi-3's attn_qkv, a gate+up ffn_up) replaced by its parts: the same
    bytes cut by rows, as each row of any GGML type is its own run of blocks. A part is
    a tensor like any other, with its own offset, so whatever reads tensors by name (the
    model, offloading, packing) sees the usual roles. A family without fused kinds, or a
    file that already stores the parts, is left as it is."""
    from edgerun.arch import FAMILIES, spec_from_gguf
    from edgerun.arch.spec import fused_splits

    arch = meta.get("general.architecture")
    family = FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None or not getattr(family, "FUSED", ()):
        return infos
    replaced: dict[str, list[TensorInfo]] = {}
    for fused, parts in fused_splits(spec_from_gguf(meta, source)):
        info = infos.get(fused)
        if info is None:
            continue
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        total = sum(n for _, n in parts)
        if rows != total:
            own = [n for name, n in parts if name == fused]
            if own and rows == own[0]:
                continue  # the part itself: the file stores the parts separately
            raise ModelFormatError(
                f"{source}: fused tensor '{fused}' has {rows} rows, expected {total} "
                f"({' + '.join(f'{n} for {name}' for name, n in parts)})"
            )
        if len(info.dims) != 2:
            raise ModelFormatError(
                f"{source}: fused tensor '{fused}' has {len(info.dims)} dimensions, expected 2"
            )
        blck, type_size = _ggml_layout(info.type_id) or (1, 0)
        row_bytes = info.dims[0] // blck * type_size
        out, row0 = [], 0
        for name, n in parts:
            if name != fused and name in infos:
                raise ModelFormatError(
                    f"{source}: tensor '{name}' is stored both alone and in '{fused}'"
                )
            out.append(TensorInfo(name, (info.dims[0], n), info.type_id,
                                  info.offset + row0 * row_bytes))  # fmt: skip
            row0 += n
        replaced[fused] = out
    if not replaced:
        return infos
    split: dict[str, TensorInfo] = {}
    for name, info in infos.items():
        for part in replaced.get(name, (info,)):
            split[part.name] = part
    return split


def _type_name(vtype: int) -> str:
    try:
        return GGUFValueType(vtype).name.lower()
    except ValueError:
        return f"value type {vtype}"


def _ggml_layout(type_id: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block) of a GGML tensor type, None when unknown."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


def _describe(value: Any) -> str:
    """A metadata value's kind for an error message (never the whole of a long array)."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype}"
    if isinstance(value, StringArray):
        return f"an array of {len(value)} strings"
    if isinstance(value, str):
        return f"a string {value[:40]!r}"
    return f"{type(value).__name__} {value!r}"


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
        for path in self.file.paths:  # a split model's shards, in order
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        return h.hexdigest()
