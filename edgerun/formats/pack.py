"""The edgerun pack: a directory that `edgerun convert` writes and `edgerun.load` reads.

Layout (format version 1)::

    <pack>/edgerun.json          metadata (below)
    <pack>/model.safetensors     tensors (or model-00001-of-0000N.safetensors shards)
    <pack>/tokenizer.model       only for SentencePiece tokenizers converted from a
                                 Hugging Face checkpoint (the original file, verbatim)

Tensors are plain safetensors entries: 2-D weights in a block format are dtype U8 with
shape [rows, row_bytes] (the raw GGML-layout blocks the kernels read); float tensors are
F32 / F16 / BF16 with their element shape (norm gains: F32 [n]). Every tensor starts at
a 64-byte aligned file offset; safetensors allows no holes between tensors, so the gaps
are filled by padding entries named `__pad__.<n>` (U8), which readers ignore. Any
safetensors tool can open the files.

edgerun.json::

    {"format": "edgerun-pack", "version": 1,
     "spec": {ModelSpec fields},
     "tokenizer": {"kind": "gguf", "metadata": {"tokenizer.ggml.*": ...,
                                                "tokenizer.chat_template": ...}}
               or {"kind": "sentencepiece", "file": "tokenizer.model",
                   "add_bos": bool|null, "chat_template": str|null},
     "quantization": {"recipe": ..., "imatrix": ..., "types": {...}, ...},
     "source": {"path": ..., "format": "gguf"|"hf", "sha256": ...},
     "tensors": {name: {"qtype": "Q4_K", "shape": [rows, cols], "file": "model.safetensors"}}}

Reading maps each safetensors file once and hands out numpy views (zero copy):
`safetensors.safe_open(..., framework="numpy").get_tensor` returns a copy (measured: the
array owns a writeable buffer), so the reader parses the documented header itself (u64
little-endian header length, JSON header, data) and tests hold its views to
safetensors' own result.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from dataclasses import MISSING
from dataclasses import fields as dc_fields
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.arch.spec import ModelSpec, validate_spec
from edgerun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType, row_bytes
from edgerun.runtime.atomic import check_free_space, fsync_dir

__all__ = [
    "PACK_FORMAT",
    "PACK_VERSION",
    "META_FILE",
    "PackError",
    "PackVersionError",
    "PackFile",
    "PackWriter",
    "is_pack",
    "read_pack",
    "spec_to_json",
    "spec_from_json",
]

PACK_FORMAT = "edgerun-pack"
PACK_VERSION = 1
META_FILE = "edgerun.json"
ALIGN = 64
SHARD_BYTES = 2 << 30
_FLOAT_DTYPES = {QuantType.F32: "F32", QuantType.F16: "F16", QuantType.BF16: "BF16"}
_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1}


class PackError(ModelFormatError):
    """A pack directory that is incomplete or corrupt; the message names file and field."""


class PackVersionError(PackError, UnsupportedError):
    """A pack written by a newer (or unknown) edgerun pack format version."""


def is_pack(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file()


# ------------------------------------------------------------------------------ spec
def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    out = {}
    for f in dc_fields(spec):
        v = getattr(spec, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def spec_from_json(d: Any, source: str) -> ModelSpec:
    if not isinstance(d, dict):
        raise PackError(f"{source}: field 'spec' should be an object, found {type(d).__name__}")
    known = {f.name: f for f in dc_fields(ModelSpec)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise PackError(
            f"{source}: field 'spec.{unknown[0]}' is unknown to this edgerun version; "
            "upgrade edgerun or re-convert the model"
        )
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name not in d:
            if f.default is MISSING and f.default_factory is MISSING:
                raise PackError(f"{source}: field 'spec.{name}' is missing")
            continue
        v = d[name]
        try:
            if name in (
                "layer_windows",
                "layer_head_dims",
                "layer_kv_heads",
                "layer_d_ff",
                "layer_rope_dims",
                "layer_kv_source",
            ):
                v = tuple(int(t) for t in v)
            elif name in ("layer_rope_bases",):
                v = tuple(float(t) for t in v)
            elif name == "layer_ffn_sparsity":  # None on a dense layer
                v = tuple(None if t is None else float(t) for t in v)
            elif name in ("fused_tensors", "layer_mixers"):
                v = tuple(str(t) for t in v)
            elif name in ("layer_nope", "layer_rope_freqs"):
                if not all(isinstance(t, bool) for t in v):
                    raise TypeError
                v = tuple(v)
            elif name in ("layer_tensors", "global_tensors"):
                if not isinstance(v, dict):
                    raise TypeError
                # roles added since the pack was written take their GGUF names
                v = {**f.default_factory(), **{str(a): str(b) for a, b in v.items()}}
            elif f.type == "bool":
                if not isinstance(v, bool):
                    raise TypeError
            elif f.type == "int":
                if isinstance(v, bool) or int(v) != v:
                    raise TypeError
                v = int(v)
            elif f.type == "float":
                if isinstance(v, bool):
                    raise TypeError
                v = float(v)
            elif f.type == "str":
                if not isinstance(v, str):
                    raise TypeError
        except (TypeError, ValueError, OverflowError):
            raise PackError(
                f"{source}: field 'spec.{name}' has an invalid value {str(v)[:80]} "
                f"(expected {f.type})"
            ) from None
        kwargs[name] = v
    return ModelSpec(**kwargs)


# ---------------------------------------------------------------------------- writer
def _st_entry(qtype: QuantType, shape: tuple[int, int]) -> tuple[str, list[int], int]:
    rows, cols = shape
    if qtype in _FLOAT_DTYPES:
        dt = _FLOAT_DTYPES[qtype]
        st_shape = [cols] if rows == 1 else [rows, cols]
        return dt, st_shape, rows * cols * _ST_ITEMSIZE[dt]
    rb = row_bytes(qtype, cols)
    return "U8", [rows, rb], rows * rb


class PackWriter:
    """Writes a pack: declare every tensor up front, then `write()` them in any order.

    The safetensors headers are written first (sizes are known from the declared formats),
    so tensors stream to disk one at a time and a large model never sits in memory whole.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        plan: list[tuple[str, QuantType, tuple[int, int]]],
        shard_bytes: int = SHARD_BYTES,
    ) -> None:
        self.final = Path(out_dir)
        if self.final.exists() and not self.final.is_dir():
            raise PackError(f"{self.final} exists and is not a directory")
        if (
            self.final.is_dir()
            and any(self.final.iterdir())
            and not (self.final / META_FILE).exists()
        ):  # replacing it would delete files that are not ours
            raise PackError(
                f"{self.final} is a non-empty directory that is not an edgerun pack; "
                "choose a new output directory"
            )
        self.final.parent.mkdir(parents=True, exist_ok=True)
        # Everything goes to a staging directory beside the target and is renamed into place
        # by close(): an interrupted or killed conversion leaves the previous pack (if any)
        # intact and never a half-written one at the target path.
        total = sum(_st_entry(q, shape)[2] + ALIGN for _, q, shape in plan)
        check_free_space(self.final.parent, total, f"the pack {self.final.name}")
        self.dir = self.final.with_name(f".{self.final.name}.tmp-{os.getpid()}")
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir()
        # group into shards by size (declaration order)
        shards: list[list[tuple[str, QuantType, tuple[int, int]]]] = [[]]
        size = 0
        for ent in plan:
            n = _st_entry(ent[1], ent[2])[2]
            if shards[-1] and size + n > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(ent)
            size += n + ALIGN
        n_sh = len(shards)
        names = (
            ["model.safetensors"]
            if n_sh == 1
            else [f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors" for i in range(n_sh)]
        )
        self.tensors: dict[str, dict[str, Any]] = {}
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (shard, abs offset, nbytes)
        self._files = []
        self._written: set[str] = set()
        for si, (fname, ents) in enumerate(zip(names, shards)):
            # float tensors first: they have the strictest alignment wishes of their own
            ents = sorted(ents, key=lambda e: 0 if e[1] in _FLOAT_DTYPES else 1)
            layout = []  # (name, dtype, shape, begin, end, is_pad)
            header_guess = 0
            for _ in range(64):  # the header size depends on the offsets: iterate
                layout = []
                pos = 0
                n_pad = 0
                data_start = header_guess
                for name, qt, shape in ents:
                    dt, st_shape, n = _st_entry(qt, shape)
                    gap = (-(data_start + pos)) % ALIGN
                    if gap:
                        layout.append((f"__pad__.{n_pad}", "U8", [gap], pos, pos + gap, True))
                        n_pad += 1
                        pos += gap
                    layout.append((name, dt, st_shape, pos, pos + n, False))
                    pos += n
                hdr = self._header(layout)
                if 8 + len(hdr) <= header_guess:  # fits: pad with spaces (allowed) and stop
                    hdr += b" " * (header_guess - 8 - len(hdr))
                    break
                header_guess = 8 + len(hdr)  # grows monotonically, so this terminates
            else:
                raise PackError(f"{self.dir / fname}: could not lay out the header")
            path = self.dir / fname
            fh = open(path, "wb")
            fh.write(struct.pack("<Q", len(hdr)))
            fh.write(hdr)
            fh.truncate(header_guess + pos)
            self._files.append(fh)
            for name, _dt, _shape, b, e, is_pad in layout:
                if is_pad:
                    fh.seek(header_guess + b)
                    fh.write(b"\0" * (e - b))
                    continue
                self._where[name] = (si, header_guess + b, e - b)
            for name, qt, shape in ents:
                self.tensors[name] = {"qtype": qt.name, "shape": list(shape), "file": fname}

    @staticmethod
    def _header(layout) -> bytes:
        h: dict[str, Any] = {"__metadata__": {"format": PACK_FORMAT, "version": str(PACK_VERSION)}}
        for name, dt, shape, b, e, _ in layout:
            h[name] = {"dtype": dt, "shape": shape, "data_offsets": [b, e]}
        raw = json.dumps(h, separators=(",", ":")).encode()
        # pad so that the data starts 8-byte aligned (the header may be padded with spaces)
        raw += b" " * ((-(8 + len(raw))) % 8)
        # and to a multiple of ALIGN so that the fixpoint converges quickly
        raw += b" " * ((-(8 + len(raw))) % ALIGN)
        return raw

    def write(self, name: str, data: np.ndarray) -> None:
        """Write one declared tensor's bytes (uint8 [rows, row_bytes] or the float array)."""
        if name not in self._where:
            raise PackError(f"tensor '{name}' was not declared for this pack")
        si, off, n = self._where[name]
        buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if buf.nbytes != n:
            raise PackError(f"tensor '{name}': {buf.nbytes} bytes given, {n} declared")
        fh = self._files[si]
        fh.seek(off)
        fh.write(memoryview(buf))
        self._written.add(name)

    def close(self, meta: dict[str, Any]) -> Path:
        """Finish: check every tensor was written, write edgerun.json last."""
        missing = [n for n in self.tensors if n not in self._written]
        for fh in self._files:
            fh.close()
        if missing:
            raise PackError(f"{self.dir}: tensor '{missing[0]}' was declared but never written")
        doc = {"format": PACK_FORMAT, "version": PACK_VERSION, **meta, "tensors": self.tensors}
        (self.dir / META_FILE).write_text(
            json.dumps(doc, indent=1, ensure_ascii=False, default=_json_list)
        )
        for f in self.dir.iterdir():  # every byte on disk before the rename makes it valid
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(self.dir)
        old = None
        if self.final.exists():
            old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
            os.replace(self.final, old)
        os.replace(self.dir, self.final)
        fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.dir = self.final
        return self.final

    def abort(self) -> None:
        """Drop the staging directory (an interrupted conversion); the target is untouched."""
        for fh in self._files:
            fh.close()
        if self.dir != self.final:
            shutil.rmtree(self.dir, ignore_errors=True)


def _json_list(value: Any) -> Any:
    """json.dumps fallback: GGUF metadata arrays (numpy views, StringArray) as lists."""
    tolist = getattr(value, "tolist", None)
    if tolist is None:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return tolist()


# ---------------------------------------------------------------------------- reader
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
MAX_META_BYTES = 256 << 20  # edgerun.json (a 262k-token vocabulary is ~30 MB of JSON)
_ST_DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a repeated key is an error (json.loads would keep the last)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(ValueError):
    pass


def _load_json(raw: bytes | str, source: str, what: str) -> Any:
    """Parse untrusted JSON: duplicate keys, bad UTF-8, invalid JSON and pathological nesting
    all become a PackError naming the file."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise PackError(f"{source}: {what} has the key {e.args[0]!r} twice") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{source}: corrupt {what}, not valid JSON ({e})") from None
    except RecursionError:
        raise PackError(f"{source}: corrupt {what}, JSON nested too deeply") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _STFile:
    """One safetensors file: its parsed, checked header and one read-only mmap.

    The checks are safetensors' own: header at most 100 MB, valid JSON without repeated
    keys, known dtypes, byte ranges that match dtype x shape and tile the data section
    exactly (contiguous, from 0, no trailing bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
        except OSError:
            raise PackError(f"{path}: tensor file is missing") from None
        if size < 8:
            raise PackError(f"{path}: {size} bytes is too small to be a safetensors file")
        with open(path, "rb") as fh:
            self.buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack_from("<Q", self.buf, 0)
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise PackError(
                f"{path}: safetensors header length: expected at most "
                f"{min(MAX_HEADER_BYTES, size - 8)} bytes (the file has {size}), found {n}"
            )
        raw = bytes(self.buf[8 : 8 + n])
        if not raw.startswith(b"{"):
            raise PackError(f"{path}: corrupt safetensors header: expected '{{' first")
        self.header = _load_json(raw, str(path), "safetensors header")
        if not isinstance(self.header, dict):
            raise PackError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.data_start = 8 + n
        self.size = size
        self._check_header()

    def _check_header(self) -> None:
        path = self.path
        meta = self.header.get("__metadata__")
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
        ):
            raise PackError(f"{path}: safetensors '__metadata__' should map strings to strings")
        spans = []
        for name, ent in self.header.items():
            if name == "__metadata__":
                continue
            where = f"{path}: safetensors entry '{name}'"
            if not isinstance(ent, dict):
                raise PackError(f"{where} should be an object, found {type(ent).__name__}")
            dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
            if not isinstance(dt, str) or dt not in _ST_DTYPE_SIZES:
                raise PackError(
                    f"{where}: field 'dtype' should be one of {', '.join(_ST_DTYPE_SIZES)}, "
                    f"found {dt!r}"
                )
            if not (
                isinstance(shape, list) and len(shape) <= 8 and all(_is_int(d) for d in shape)
            ) or any(d < 0 for d in shape):
                raise PackError(
                    f"{where}: field 'shape' should be a list of non-negative integers, "
                    f"found {str(shape)[:80]}"
                )
            if (
                not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs))
                or not 0 <= offs[0] <= offs[1]
            ):
                raise PackError(
                    f"{where}: field 'data_offsets' should be [begin, end] with "
                    f"0 <= begin <= end, found {str(offs)[:80]}"
                )
            n = _ST_DTYPE_SIZES[dt]
            for d in shape:
                n *= d
            if offs[1] - offs[0] != n:
                raise PackError(
                    f"{where}: field 'data_offsets' spans {offs[1] - offs[0]} bytes, expected "
                    f"{n} ({dt} {shape})"
                )
            spans.append((offs[0], offs[1], name))
        spans.sort()
        pos = 0
        for b, e, name in spans:
            if b != pos:
                raise PackError(
                    f"{path}: safetensors entry '{name}' field 'data_offsets' begins at {b}, "
                    f"expected {pos} (tensors must be contiguous, without overlaps or holes)"
                )
            pos = e
        if self.data_start + pos != self.size:
            raise PackError(
                f"{path}: the tensors' data ends at byte {self.data_start + pos}, expected the "
                f"file size {self.size} ("
                + ("truncated copy?)" if self.data_start + pos > self.size else "trailing bytes)")
            )

    def view(self, name: str) -> tuple[str, list[int], np.ndarray]:
        ent = self.header.get(name)
        if not isinstance(ent, dict):
            raise PackError(f"{self.path}: tensor '{name}' is missing from the file")
        try:
            dt = ent["dtype"]
            shape = [int(s) for s in ent["shape"]]
            b, e = (int(v) for v in ent["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise PackError(f"{self.path}: header entry of tensor '{name}' is corrupt") from None
        if not 0 <= b <= e or self.data_start + e > self.size:
            raise PackError(
                f"{self.path}: tensor '{name}' ends at byte {self.data_start + e} but the file "
                f"has only {self.size} bytes (truncated copy?)"
            )
        arr = np.frombuffer(self.buf, dtype=np.uint8, count=e - b, offset=self.data_start + b)
        return dt, shape, arr


class PackFile:
    """An opened pack: metadata, ModelSpec, tokenizer, and zero-copy tensor views.

    Quacks like GGUFFile for ResidentStore (`tensor`, `tensor_names`) and for the CLI
    (`path`, `version`, `metadata`, `file_size`).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFoundError(f"model not found: {self.path}")
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise PackError(
                f"{self.path}: not an edgerun pack ({META_FILE} is missing); convert a model "
                "with `edgerun convert`"
            )
        self.meta_path = meta_path
        meta_size = meta_path.stat().st_size
        if meta_size > MAX_META_BYTES:
            raise PackError(
                f"{meta_path}: metadata size: expected at most {MAX_META_BYTES} bytes, found "
                f"{meta_size}"
            )
        doc = _load_json(meta_path.read_bytes(), str(meta_path), "metadata")
        if not isinstance(doc, dict):
            raise PackError(f"{meta_path}: corrupt metadata (not a JSON object)")
        src = str(meta_path)
        if doc.get("format") != PACK_FORMAT:
            raise PackError(
                f"{src}: field 'format' is {doc.get('format')!r}, expected {PACK_FORMAT!r}"
            )
        version = doc.get("version")
        if version != PACK_VERSION:
            raise PackVersionError(
                f"{src}: field 'version' is {version!r}; this edgerun reads pack version "
                f"{PACK_VERSION}. Re-convert the model with this edgerun (`edgerun convert`) "
                "or upgrade edgerun"
            )
        self.version = PACK_VERSION
        self.metadata = doc
        self.spec = validate_spec(spec_from_json(doc.get("spec"), src), src)
        tensors = doc.get("tensors")
        if not isinstance(tensors, dict) or not tensors:
            raise PackError(f"{src}: field 'tensors' is missing or empty")
        self._entries: dict[str, tuple[QuantType, tuple[int, int], str]] = {}
        for name, ent in tensors.items():
            if not isinstance(ent, dict):
                raise PackError(f"{src}: field 'tensors.{name}' should be an object")
            try:
                qtype = QuantType[ent["qtype"]]
            except KeyError:
                raise PackError(
                    f"{src}: field 'tensors.{name}.qtype' = {ent.get('qtype')!r} is not a "
                    f"format this edgerun knows ({', '.join(t.name for t in QuantType)})"
                ) from None
            except TypeError:
                raise PackError(f"{src}: field 'tensors.{name}' is corrupt") from None
            shape, fname = ent.get("shape"), ent.get("file")
            if not (
                isinstance(shape, list)
                and len(shape) == 2
                and all(_is_int(v) and 0 < v < 1 << 40 for v in shape)
            ):
                raise PackError(
                    f"{src}: field 'tensors.{name}.shape' should be [rows, cols] of positive "
                    f"integers, found {str(shape)[:80]}"
                )
            rows, cols = shape
            if not isinstance(fname, str) or not fname or Path(fname).name != fname:
                raise PackError(
                    f"{src}: field 'tensors.{name}.file' must be a plain file name, found "
                    f"{str(fname)[:80]!r}"
                )
            self._entries[name] = (qtype, (rows, cols), fname)
        self._files: dict[str, _STFile] = {}
        for fname in sorted({e[2] for e in self._entries.values()}):
            self._files[fname] = _STFile(self.path / fname)
        self.file_size = sum(f.size for f in self._files.values())
        # check the headers cover every tensor, with the declared format, now, not at first use
        for name, (qtype, (rows, cols), fname) in self._entries.items():
            st = self._files[fname]
            ent = st.header.get(name)
            if name == "__metadata__" or ent is None:
                raise PackError(
                    f"{self.path / fname}: tensor '{name}' (listed in {META_FILE}) is missing "
                    "from the file"
                )
            self._check_entry(name, qtype, rows, cols, st, ent["dtype"], ent["data_offsets"])

    def _check_entry(
        self,
        name: str,
        qtype: QuantType,
        rows: int,
        cols: int,
        st: _STFile,
        dt: str,
        offsets: list[int],
    ) -> int:
        """The row size in bytes of a tensor whose pack and safetensors entries agree."""
        elems, nbytes = BLOCK_LAYOUT[qtype]
        if cols % elems:
            raise PackError(
                f"{st.path}: tensor '{name}' has {cols} columns, not a multiple of "
                f"the {qtype.name} block size {elems}"
            )
        rb = cols // elems * nbytes
        want_dt = _FLOAT_DTYPES.get(qtype, "U8")
        size = offsets[1] - offsets[0]
        if dt != want_dt or size != rows * rb:
            raise PackError(
                f"{st.path}: tensor '{name}' is {dt} with {size} bytes; {META_FILE} says "
                f"{qtype.name} {rows}x{cols} ({want_dt}, {rows * rb} bytes)"
            )
        return rb

    # -- reader protocol -------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> QuantTensor:
        ent = self._entries.get(name)
        if ent is None:
            raise PackError(f"{self.meta_path}: tensor '{name}' is missing from the pack")
        qtype, (rows, cols), fname = ent
        st = self._files[fname]
        dt, _shape, arr = st.view(name)
        rb = self._check_entry(name, qtype, rows, cols, st, dt, [0, arr.size])
        return QuantTensor(name, qtype, (rows, cols), arr.reshape(rows, rb))

    # -- tokenizer -------------------------------------------------------------------
    def tokenizer(self):
        """The pack's tokenizer (SentencePiece file or GGUF-style vocabulary metadata)."""
        tok = self.metadata.get("tokenizer")

        def read(fname: str) -> bytes:
            p = self.path / fname
            if not p.is_file():
                raise PackError(f"{p}: tokenizer file (field 'tokenizer.file') is missing")
            return p.read_bytes()

        return _tokenizer_from_section(tok, read, str(self.meta_path))


def _tokenizer_from_section(tok: Any, files, source: str = "pack"):
    """A Tokenizer from a pack's 'tokenizer' field; files: dict or callable name -> bytes."""
    from edgerun.tokenizer import SentencePieceTokenizer, tokenizer_from_gguf_metadata

    if not isinstance(tok, dict):
        raise PackError(f"{source}: field 'tokenizer' is missing or not an object")
    kind = tok.get("kind")
    if kind == "gguf":
        meta = tok.get("metadata")
        if not isinstance(meta, dict):
            raise PackError(f"{source}: field 'tokenizer.metadata' is missing")
        return tokenizer_from_gguf_metadata(meta, source)
    if kind == "sentencepiece":
        fname = tok.get("file")
        if not isinstance(fname, str) or Path(fname).name != fname:
            raise PackError(f"{source}: field 'tokenizer.file' is missing or not a file name")
        blob = files(fname) if callable(files) else files.get(fname)
        if blob is None:
            raise PackError(f"{source}: tokenizer file {fname!r} is missing")
        return SentencePieceTokenizer.from_model_proto(
            blob, add_bos=tok.get("add_bos"), chat_template=tok.get("chat_template")
        )
    raise PackError(f"{source}: field 'tokenizer.kind' = {kind!r} is not 'gguf' or 'sentencepiece'")


def read_pack(path: str | os.PathLike) -> PackFile:
    """Open a pack directory (metadata checked, tensors mapped, nothing copied)."""
    return PackFile(path)
