"""The bundled flash layout: each FFN neuron's bytes together, read in one go.

"LLM in a flash" reads less per token by reading whole neurons: neuron i of a layer
needs row i of up and column i of down, and a sparse FFN needs them only when its gate
says the neuron is active. So per layer the file holds

- a gate section: the d_ff gate rows in their GGUF block format, row-contiguous (a
  [n, gate_row_bytes] slice is a block matrix the existing kernels read), kept apart
  because a gate-resident FFN loads it whole and a predictor-driven one reads rows;
- a record section: per neuron one record [up row i | down column i]. GGUF stores down
  as [d_model, d_ff] rows, so column i is strided over the whole tensor; it is
  dequantized and requantized row-wise (Q8_0 by default: its error is small next to the
  source's own Q4_K/Q6_K error, and 32-element blocks fit any d_model);
- optionally a permutation (e.g. by activation frequency) so that neurons active
  together sit together and their reads coalesce. The public API speaks model neuron
  ids; positions in the file are an internal detail.

Every section starts on a 4096-byte boundary (direct I/O). A 4096-byte header (magic,
version, where the index is and its SHA256) opens the file; the JSON index at the end
holds the source's SHA256, spec basics, and per layer the formats, sizes and offsets.
A bundle is derived data: written once from a GGUF, atomically, into the cache
directory, and rewritten when its source's SHA256 (or anything else asked) differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from edgerun.runtime import numba_env

numba_env.configure()  # before numba is first imported (see runtime/numba_env.py)

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from edgerun.errors import InvalidArgumentError, ModelFormatError, UnsupportedError  # noqa: E402
from edgerun.offload.io import ALIGN, DirectReader, aligned_empty, coalesce  # noqa: E402
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType, row_bytes  # noqa: E402

MAGIC = b"EDGEBNDL"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ32s")  # magic, version, header bytes, index offset/len, sha
HEADER_BYTES = ALIGN
SUFFIX = ".bundle"
GAP_BYTES = 32 * 1024  # merge reads across gaps up to this (a read costs ~50 us; 32 KiB ~30)


class StaleBundleError(ModelFormatError):
    """A valid bundle that does not match what was asked (source hash, layers, order)."""


@njit(cache=True, nogil=True)
def _gather_rows(stage: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
    """out[k] = stage[src[k] : src[k] + row_bytes]: records out of the coalesced reads.

    nogil so a prefetch thread's copy overlaps compute on the main thread."""
    rb = out.shape[1]
    for k in range(out.shape[0]):
        out[k, :] = stage[src[k] : src[k] + rb]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class BundleLayer:
    """Where one layer's neurons are and how they are encoded."""

    layer: int
    d_ff: int
    d_model: int
    gate_offset: int
    gate_format: QuantType
    gate_row_bytes: int
    records_offset: int
    record_bytes: int
    up_format: QuantType
    up_row_bytes: int
    down_format: QuantType
    down_row_bytes: int
    down_source_format: QuantType
    order: np.ndarray | None  # position -> model neuron id (None: identity)
    position: np.ndarray | None  # model neuron id -> position


def down_columns(down: QuantTensor, fmt: QuantType | str = "Q8_0") -> np.ndarray:
    """Down's columns requantized row-wise: uint8 [d_ff, row_bytes(fmt, d_model)].

    Dequantizes the whole matrix once (a layer's float32, at write time only) and
    requantizes it in slices of columns, so no transposed copy of it is ever made."""
    from edgerun.quant.quantize import parse_qtype, quantize
    from edgerun.quant.reference import dequantize

    fmt = parse_qtype(fmt)
    w = dequantize(down.qtype, down.data)  # [d_model, d_ff]
    d_model, d_ff = w.shape
    out = np.empty((d_ff, row_bytes(fmt, d_model)), np.uint8)
    for c0 in range(0, d_ff, 1024):
        c1 = min(d_ff, c0 + 1024)
        out[c0:c1] = quantize(np.ascontiguousarray(w[:, c0:c1].T), fmt)
    return out


# ----------------------------------------------------------------------------- writing
def write_bundle(
    gguf_path: str | os.PathLike,
    out_path: str | os.PathLike,
    sha256: str,
    order: dict[int, np.ndarray] | None = None,
    layers: Iterable[int] | None = None,
    down_format: QuantType | str = "Q8_0",
    progress: bool = True,
) -> Path:
    """Write the bundle of a GGUF's FFN layers to out_path (temp file, fsync, rename).

    order: per layer, a permutation of range(d_ff) giving the model neuron id stored at
    each position. layers: a subset of layer indices (default all).
    """
    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf
    from edgerun.quant.quantize import QUANTIZABLE, parse_qtype
    from edgerun.runtime.progress import progress_bar

    src = Path(gguf_path)
    out = Path(out_path)
    gguf = read_gguf(src)
    spec = spec_from_gguf(gguf.metadata, str(src))
    dfmt = parse_qtype(down_format)
    if dfmt not in QUANTIZABLE:
        raise InvalidArgumentError(f"cannot requantize down columns to {dfmt.name}")
    if spec.d_model % BLOCK_LAYOUT[dfmt][0]:
        raise InvalidArgumentError(
            f"down format {dfmt.name} needs d_model to be a multiple of "
            f"{BLOCK_LAYOUT[dfmt][0]}; {src} has d_model {spec.d_model}"
        )
    todo = sorted(set(range(spec.n_layers) if layers is None else (int(x) for x in layers)))
    if not todo or todo[0] < 0 or todo[-1] >= spec.n_layers:
        raise InvalidArgumentError(f"layers must lie in 0..{spec.n_layers - 1}, got {todo}")
    order = {int(k): np.asarray(v) for k, v in (order or {}).items()}
    if set(order) - set(todo):
        raise InvalidArgumentError(f"order given for layers {sorted(set(order) - set(todo))}")

    def tensors(i: int, load: DirectReader | None = None) -> tuple[QuantTensor, ...]:
        names = [spec.layer_tensor(r, i) for r in ("ffn_gate", "ffn_up", "ffn_down")]
        missing = [n for n in names if n not in gguf.infos]
        if missing:
            raise UnsupportedError(
                f"{src}: offloading needs a gated FFN; tensor(s) {', '.join(missing)} missing"
            )
        gate, up, down = (gguf.tensor(n) for n in names)
        if gate.shape != up.shape or down.shape != (gate.cols, gate.rows):
            raise ModelFormatError(
                f"{src}: layer {i} FFN shapes gate {gate.shape}, up {up.shape}, "
                f"down {down.shape} do not fit together"
            )
        if load is None:
            return gate, up, down
        # read with direct I/O: touching the mmap would leave the whole GGUF resident
        return tuple(
            QuantTensor(
                t.name,
                t.qtype,
                t.shape,
                load.read(gguf.infos[t.name].offset, t.nbytes).reshape(t.data.shape),
            )
            for t in (gate, up, down)
        )

    # plan the layout first: every offset is known before a byte is written
    entries: list[dict[str, Any]] = []
    pos = HEADER_BYTES
    for i in todo:
        gate, up, down = tensors(i)
        d_ff, d_model = gate.rows, gate.cols
        perm = order.get(i)
        if perm is not None:
            _check_permutation(perm, d_ff, f"order for layer {i}")
        urb, drb = up.data.shape[1], row_bytes(dfmt, d_model)
        e: dict[str, Any] = {"layer": i, "d_ff": d_ff, "d_model": d_model}
        e["gate"] = {"offset": pos, "format": gate.qtype.name, "row_bytes": gate.data.shape[1]}
        pos = _align(pos + d_ff * gate.data.shape[1])
        e["records"] = {
            "offset": pos,
            "record_bytes": urb + drb,
            "up_format": up.qtype.name,
            "up_row_bytes": urb,
            "down_format": dfmt.name,
            "down_row_bytes": drb,
            "down_source_format": down.qtype.name,
        }
        pos = _align(pos + d_ff * (urb + drb))
        e["order"] = None
        if perm is not None:
            e["order"] = {"offset": pos, "dtype": "int32"}
            pos = _align(pos + d_ff * 4)
        entries.append(e)
    index_offset = pos
    index = {
        "format": "edgerun offload bundle",
        "version": VERSION,
        "align": ALIGN,
        "source": {"sha256": sha256, "size": gguf.file_size, "name": src.name},
        "spec": {
            "arch": spec.arch,
            "name": spec.name,
            "n_layers": spec.n_layers,
            "d_model": spec.d_model,
            "d_ff": spec.d_ff,
            "activation": spec.activation,
        },
        "layers": entries,
    }
    blob = json.dumps(index, separators=(",", ":")).encode()
    index["file_size"] = 0
    # file_size is part of the index, so size the index with it in place
    for _ in range(2):
        index["file_size"] = _align(index_offset + len(blob))
        blob = json.dumps(index, separators=(",", ":")).encode()

    from edgerun.runtime.atomic import check_free_space

    out.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out.parent, index["file_size"], f"the offload layout {out.name}")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with (
            DirectReader(src, threads=2) as load,
            open(tmp, "wb") as f,
            progress_bar(
                f"writing offload bundle {out.name}",
                total=len(todo),
                unit="layers",
                enabled=progress,
            ) as advance,
        ):
            f.write(bytes(HEADER_BYTES))
            for e in entries:
                gate, up, down = tensors(e["layer"], load)
                perm = order.get(e["layer"])
                sel = slice(None) if perm is None else perm.astype(np.int64)
                _write_at(f, e["gate"]["offset"], gate.data[sel])
                cols = down_columns(down, dfmt)[sel]
                rec = np.concatenate([up.data[sel], cols], axis=1)
                _write_at(f, e["records"]["offset"], rec)
                if perm is not None:
                    _write_at(f, e["order"]["offset"], perm.astype("<i4"))
                # written bytes stay in the page cache until flushed; under a RAM budget
                # (a first offloaded run) a whole bundle of dirty pages must not pile up
                f.flush()
                os.fdatasync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                advance()
            _write_at(f, index_offset, np.frombuffer(blob, np.uint8))
            f.write(bytes(index["file_size"] - f.tell()))
            f.seek(0)
            digest = hashlib.sha256(blob).digest()
            f.write(HEADER.pack(MAGIC, VERSION, HEADER_BYTES, index_offset, len(blob), digest))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, out)
    except OSError as e:
        from edgerun.runtime.atomic import disk_full_error

        tmp.unlink(missing_ok=True)
        raise disk_full_error(e, out, "the offload layout") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return out


def _write_at(f: Any, offset: int, data: np.ndarray) -> None:
    here = f.tell()
    if offset < here:
        raise AssertionError(f"bundle layout overlap at {offset} < {here}")
    f.write(bytes(offset - here))
    f.write(memoryview(np.ascontiguousarray(data)).cast("B"))


def _check_permutation(perm: np.ndarray, n: int, what: str) -> None:
    perm = np.asarray(perm)
    ok = (
        perm.shape == (n,)
        and np.issubdtype(perm.dtype, np.integer)
        and perm.min(initial=0) >= 0
        and perm.max(initial=0) < n
        and bool((np.bincount(perm, minlength=n) == 1).all())
    )
    if not ok:
        raise InvalidArgumentError(f"{what} must be a permutation of range({n})")


# ----------------------------------------------------------------------------- reading
class Bundle:
    """An opened bundle file: its index, and direct reads of gate rows and records.

    Reads go through one DirectReader (its counters give the I/O share of a token);
    staging buffers are per thread, so a prefetch thread may read while another computes.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        sha256: str | None = None,
        threads: int = 4,
        direct: bool | None = None,
        gap_bytes: int = GAP_BYTES,
    ) -> None:
        """sha256: the source GGUF's hash this bundle must be tied to (None: not checked)."""
        self.path = Path(path)
        self.gap_bytes = gap_bytes
        self.reader = DirectReader(self.path, threads=threads, direct=direct)
        try:
            self.index = self._read_index()
            src = self.index["source"]["sha256"]
            if sha256 is not None and src != sha256:
                raise StaleBundleError(
                    f"{self.path}: field 'source.sha256': expected {sha256}, found {src} "
                    "(written from another version of the model; it will be rewritten)"
                )
            self._layers = {e["layer"]: self._layer(e) for e in self.index["layers"]}
        except BaseException:
            self.reader.close()
            raise
        self._local = threading.local()

    def _bad(self, field: str, expected: Any, found: Any, hint: str = "") -> ModelFormatError:
        return ModelFormatError(
            f"{self.path}: field '{field}': expected {expected}, found {found}"
            + (f" ({hint})" if hint else "")
            + "; delete the file and it will be rewritten"
        )

    def _read_index(self) -> dict[str, Any]:
        size = self.reader.size
        if size < HEADER_BYTES:
            raise self._bad("file size", f">= {HEADER_BYTES} bytes", size, "truncated")
        magic, version, hbytes, ioff, ilen, isha = HEADER.unpack_from(
            self.reader.read(0, HEADER_BYTES)
        )
        if magic != MAGIC:
            raise self._bad("magic", MAGIC, magic, "not an edgerun offload bundle")
        if version != VERSION:
            raise self._bad("version", VERSION, version, "written by another edgerun")
        if hbytes != HEADER_BYTES:
            raise self._bad("header bytes", HEADER_BYTES, hbytes)
        if ioff < HEADER_BYTES or ioff % ALIGN or ioff + ilen > size or ilen > 1 << 26:
            raise self._bad("index offset", f"an aligned range inside {size} bytes", ioff)
        blob = self.reader.read(ioff, ilen).tobytes()
        if hashlib.sha256(blob).digest() != isha:
            raise self._bad("index sha256", isha.hex(), hashlib.sha256(blob).hexdigest())
        try:
            index = json.loads(blob)
        except ValueError as e:
            raise self._bad("index", "JSON", f"invalid JSON ({e})") from None
        if index.get("version") != VERSION:
            raise self._bad("index.version", VERSION, index.get("version"))
        if index.get("file_size") != size:
            raise self._bad("file_size", index.get("file_size"), size, "truncated or padded")
        self._index_offset = ioff
        return index

    def _layer(self, e: dict[str, Any]) -> BundleLayer:
        i = e.get("layer")
        try:
            d_ff, d_model = int(e["d_ff"]), int(e["d_model"])
            g, r = e["gate"], e["records"]
            fmts = {}
            for key, name in (
                ("gate.format", g["format"]),
                ("records.up_format", r["up_format"]),
                ("records.down_format", r["down_format"]),
                ("records.down_source_format", r["down_source_format"]),
            ):
                fmts[key] = QuantType[name]
        except (KeyError, TypeError, ValueError) as err:
            raise self._bad(f"layers[{i}]", "a complete layer entry", f"error {err!r}") from None
        layer = BundleLayer(
            layer=int(i),
            d_ff=d_ff,
            d_model=d_model,
            gate_offset=int(g["offset"]),
            gate_format=fmts["gate.format"],
            gate_row_bytes=int(g["row_bytes"]),
            records_offset=int(r["offset"]),
            record_bytes=int(r["record_bytes"]),
            up_format=fmts["records.up_format"],
            up_row_bytes=int(r["up_row_bytes"]),
            down_format=fmts["records.down_format"],
            down_row_bytes=int(r["down_row_bytes"]),
            down_source_format=fmts["records.down_source_format"],
            order=None,
            position=None,
        )
        for field, found, want in (
            ("gate.row_bytes", layer.gate_row_bytes, row_bytes(layer.gate_format, d_model)),
            ("records.up_row_bytes", layer.up_row_bytes, row_bytes(layer.up_format, d_model)),
            (
                "records.down_row_bytes",
                layer.down_row_bytes,
                row_bytes(layer.down_format, d_model),
            ),
            ("records.record_bytes", layer.record_bytes, layer.up_row_bytes + layer.down_row_bytes),
        ):
            if found != want:
                raise self._bad(f"layers[{i}].{field}", want, found)
        spans = [
            ("gate", layer.gate_offset, d_ff * layer.gate_row_bytes),
            ("records", layer.records_offset, d_ff * layer.record_bytes),
        ]
        if e.get("order") is not None:
            spans.append(("order", int(e["order"]["offset"]), d_ff * 4))
        for name, off, n in spans:
            if off % ALIGN or off < HEADER_BYTES or off + n > self._index_offset:
                raise self._bad(
                    f"layers[{i}].{name}.offset",
                    f"an aligned section inside [{HEADER_BYTES}, {self._index_offset})",
                    f"{n} bytes at {off}",
                )
        if e.get("order") is not None:
            order = self.reader.read(spans[-1][1], d_ff * 4).view("<i4").astype(np.int64)
            try:
                _check_permutation(order, d_ff, "order")
            except InvalidArgumentError:
                want = f"a permutation of range({d_ff})"
                raise self._bad(f"layers[{i}].order", want, "something else") from None
            position = np.empty(d_ff, np.int64)
            position[order] = np.arange(d_ff)
            layer = BundleLayer(**{**layer.__dict__, "order": order, "position": position})
        return layer

    # -- index ---------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    @property
    def source_sha256(self) -> str:
        return self.index["source"]["sha256"]

    def layer(self, i: int) -> BundleLayer:
        try:
            return self._layers[i]
        except KeyError:
            raise InvalidArgumentError(
                f"{self.path}: layer {i} is not in this bundle (it has {self.layers})"
            ) from None

    # -- reads ---------------------------------------------------------------------------
    def gate_rows(self, i: int) -> np.ndarray:
        """All gate rows of layer i in model neuron order: uint8 [d_ff, gate_row_bytes]."""
        ly = self.layer(i)
        rows = self.reader.read(ly.gate_offset, ly.d_ff * ly.gate_row_bytes)
        rows = rows.reshape(ly.d_ff, ly.gate_row_bytes)
        return rows if ly.position is None else rows[ly.position]

    def read_gate_rows(self, i: int, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Gate rows of the given model neuron ids: uint8 [len(ids), gate_row_bytes]."""
        ly = self.layer(i)
        return self._read_rows(ly, ly.gate_offset, ly.gate_row_bytes, ids, out)

    def read_records(self, i: int, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Records [up row | down column] of the given model neuron ids, in the order given:
        uint8 [len(ids), record_bytes]. Nearby neurons are read together (gap_bytes)."""
        ly = self.layer(i)
        return self._read_rows(ly, ly.records_offset, ly.record_bytes, ids, out)

    def split(self, i: int, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views of records' up rows and down columns (row stride record_bytes)."""
        ly = self.layer(i)
        return records[:, : ly.up_row_bytes], records[:, ly.up_row_bytes :]

    def _read_rows(
        self, ly: BundleLayer, base: int, rb: int, ids: np.ndarray, out: np.ndarray | None
    ) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise InvalidArgumentError(f"neuron ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        n = ids.size
        if out is None:
            out = np.empty((n, rb), np.uint8)
        elif out.shape != (n, rb) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise InvalidArgumentError(
                f"out must be a C-contiguous uint8 array of shape {(n, rb)}, got "
                f"{out.dtype} {out.shape}"
            )
        if n == 0:
            return out
        if ids.min() < 0 or ids.max() >= ly.d_ff:
            raise InvalidArgumentError(f"neuron ids must lie in 0..{ly.d_ff - 1}")
        pos = ids if ly.position is None else ly.position[ids]
        srt = np.argsort(pos, kind="stable")
        p = pos[srt]
        runs = np.array(coalesce(p, self.gap_bytes // rb), np.int64).reshape(-1, 2)
        # byte ranges widened to whole blocks, merged where they touch: all reads aligned
        a0 = (base + runs[:, 0] * rb) // ALIGN * ALIGN
        a1 = -(-(base + runs[:, 1] * rb) // ALIGN) * ALIGN
        new = np.concatenate(([True], a0[1:] > a1[:-1]))
        starts = a0[new]
        stops = np.maximum.reduceat(a1, np.flatnonzero(new))
        lens = stops - starts
        at = np.concatenate(([0], np.cumsum(lens)[:-1]))
        stage = self._staging(int(lens.sum()))
        ranges = list(zip(starts.tolist(), lens.tolist(), strict=True))
        self.reader.read_into(ranges, stage, out_offsets=at.tolist())
        addr = base + p * rb
        r = np.searchsorted(starts, addr, side="right") - 1
        src = np.empty(n, np.int64)
        src[srt] = at[r] + (addr - starts[r])
        _gather_rows(stage, src, out)
        return out

    def _staging(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = aligned_empty(_align(max(nbytes, 1 << 20)))
            self._local.buf = buf
        return buf

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# ----------------------------------------------------------------------------- cache
def bundle_path(
    gguf_path: str | os.PathLike,
    sha256: str,
    cache_dir: str | os.PathLike | None = None,
    down_format: QuantType | str = "Q8_0",
) -> Path:
    """Where the bundle of a GGUF lives: <cache>/offload/<stem>-<sha16>-<down>.bundle."""
    from edgerun.quant.quantize import parse_qtype

    if cache_dir is None:
        from edgerun.registry import cache_dir as default_cache

        cache_dir = default_cache()
    name = f"{Path(gguf_path).stem}-{sha256[:16]}-{parse_qtype(down_format).name.lower()}"
    return Path(cache_dir) / "offload" / (name + SUFFIX)


def source_sha256(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The GGUF's SHA256, remembered next to the bundles by (path, size, mtime)."""
    from edgerun.registry import sha256_file

    if cache_dir is None:
        from edgerun.registry import cache_dir as default_cache

        cache_dir = default_cache()
    src = Path(gguf_path).resolve()
    st = src.stat()
    key = f"{src} {st.st_size} {st.st_mtime_ns}"
    memo = Path(cache_dir) / "offload" / f"{src.stem}.sha256"
    try:
        stored_key, digest = memo.read_text().rsplit(" ", 1)
        if stored_key == key and len(digest.strip()) == 64:
            return digest.strip()
    except (OSError, ValueError):
        pass
    digest = sha256_file(src)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(memo.name + f".tmp-{os.getpid()}")
    tmp.write_text(f"{key} {digest}\n")
    os.replace(tmp, memo)
    return digest


def ensure_bundle(
    gguf_path: str | os.PathLike,
    sha256: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    order: dict[int, np.ndarray] | None = None,
    progress: bool = True,
    layers: Iterable[int] | None = None,
    down_format: QuantType | str = "Q8_0",
) -> Path:
    """The path of a current bundle for gguf_path, writing it when missing or stale.

    sha256: the source's known hash (the registry's verified one); None computes it once.
    A bundle is stale when its source hash, layers, down format or order differ, or when
    it does not validate. Bundles of other versions of the same file are removed.
    """
    from edgerun.quant.quantize import parse_qtype

    src = Path(gguf_path)
    if not src.is_file():
        raise InvalidArgumentError(f"{src}: no such GGUF file")
    sha = sha256 or source_sha256(src, cache_dir)
    path = bundle_path(src, sha, cache_dir, down_format)
    want_layers = None if layers is None else sorted({int(x) for x in layers})
    want_order = {int(k): np.asarray(v) for k, v in (order or {}).items()}
    if path.exists() and _is_current(path, sha, want_layers, want_order, parse_qtype(down_format)):
        return path
    write_bundle(src, path, sha, want_order or None, want_layers, down_format, progress)
    for old in path.parent.glob(f"{src.stem}-*{SUFFIX}"):
        if old != path and not old.name.startswith(f"{src.stem}-{sha[:16]}-"):
            old.unlink(missing_ok=True)  # another version of the source: never read again
    return path


def _is_current(
    path: Path,
    sha: str,
    layers: list[int] | None,
    order: dict[int, np.ndarray],
    down_format: QuantType,
) -> bool:
    try:
        with Bundle(path, sha256=sha, threads=1) as b:
            n_layers = b.index["spec"]["n_layers"]
            if b.layers != (list(range(n_layers)) if layers is None else layers):
                return False
            for i in b.layers:
                ly = b.layer(i)
                if ly.down_format != down_format:
                    return False
                want = order.get(i)
                if (ly.order is None) != (want is None):
                    return False
                if want is not None and not np.array_equal(ly.order, want):
                    return False
            return True
    except ModelFormatError:
        return False
