"""Builders for hostile model files, shared by the hostile-input and fuzz tests.

:class:`GGUFBuilder` writes GGUF files field by field, so a test can put any value (a count
of 2**63, an unknown type id, a nested array) exactly where the reader will meet it; its
default content is a tiny valid llama model (one layer, eight tokens) that loads. The
checks every rejection must pass live in :func:`assert_rejected`: an ``EdgerunError`` whose
message names the file and the field, in under a second and 100 MB.
"""

from __future__ import annotations

import os
import struct
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.errors import EdgerunError

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<?",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
T_F32 = 0
T_Q4_0 = 2

MAX_SECONDS = 1.0
MAX_BYTES = 100 << 20


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v: Any) -> bytes:
    """The encoding of one value of GGUF type ``vtype`` (arrays: ``(item_type, [items])``)."""
    if vtype == STR:
        return gstr(v)
    if vtype == ARR:
        itype, items = v
        return struct.pack("<IQ", itype, len(items)) + b"".join(value(itype, x) for x in items)
    return struct.pack(_FMT[vtype], v)


def kv(key: str, vtype: int, v: Any) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + value(vtype, v)


@dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: row length first
    data: bytes
    type_id: int = T_F32
    offset: int | None = None  # None: the running padded offset
    raw_info: bytes | None = None  # replaces the whole info entry


D, FF, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 64, 2, 1, 16, 8
TOKENS = ["<s>", "</s>", "a", "b", "ab", "c", "d", "abc"]
TOKEN_TYPES = [3, 3, 1, 1, 1, 1, 1, 1]
MERGES = ["a b", "ab c"]


def model_kvs() -> dict[str, tuple[int, Any]]:
    """Metadata of the tiny valid llama model (key -> (type, value)), in file order."""
    return {
        "general.architecture": (STR, "llama"),
        "general.name": (STR, "tiny hostile-test model"),
        "general.alignment": (U32, 32),
        "llama.block_count": (U32, 1),
        "llama.context_length": (U32, 64),
        "llama.embedding_length": (U32, D),
        "llama.feed_forward_length": (U32, FF),
        "llama.attention.head_count": (U32, HEADS),
        "llama.attention.head_count_kv": (U32, KV_HEADS),
        "llama.rope.freq_base": (F32, 10000.0),
        "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5),
        "llama.vocab_size": (U32, VOCAB),
        "llama.rope.dimension_count": (U32, HEAD_DIM),
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.pre": (STR, "default"),
        "tokenizer.ggml.tokens": (ARR, (STR, TOKENS)),
        "tokenizer.ggml.token_type": (ARR, (I32, TOKEN_TYPES)),
        "tokenizer.ggml.merges": (ARR, (STR, MERGES)),
        "tokenizer.ggml.bos_token_id": (U32, 0),
        "tokenizer.ggml.eos_token_id": (U32, 1),
        "tokenizer.ggml.add_bos_token": (BOOL, False),
        "tokenizer.chat_template": (
            STR,
            "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}",
        ),
    }


def f32(shape: tuple[int, ...], fill: float | None = None, seed: int = 0) -> bytes:
    if fill is not None:
        return np.full(shape, fill, np.float32).tobytes()
    return (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32).tobytes()


def model_tensors() -> list[Tensor]:
    """The tiny model's tensors (F32), in file order."""
    mats = {
        "token_embd.weight": (VOCAB, D),
        "blk.0.attn_q.weight": (HEADS * HEAD_DIM, D),
        "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, D),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, D),
        "blk.0.attn_output.weight": (D, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": (FF, D),
        "blk.0.ffn_up.weight": (FF, D),
        "blk.0.ffn_down.weight": (D, FF),
    }
    out = [Tensor(n, (D,), f32((D,), 1.0)) for n in ("output_norm.weight",)]
    out += [Tensor(n, (D,), f32((D,), 1.0)) for n in ("blk.0.attn_norm.weight",)]
    out += [Tensor(n, (D,), f32((D,), 1.0)) for n in ("blk.0.ffn_norm.weight",)]
    for i, (name, (rows, cols)) in enumerate(mats.items()):
        out.append(Tensor(name, (cols, rows), f32((rows, cols), seed=i)))
    return out


@dataclass
class GGUFBuilder:
    """A GGUF file assembled from parts; every part can be overridden with hostile bytes."""

    kvs: dict[str, tuple[int, Any]] = field(default_factory=model_kvs)
    tensors: list[Tensor] = field(default_factory=model_tensors)
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None  # None: len(tensors)
    n_kv: int | None = None  # None: number of kv entries written
    extra_kv: list[bytes] = field(default_factory=list)  # raw entries appended
    align: int = 32  # the padding actually written (the metadata may claim otherwise)

    def header(self) -> bytes:
        entries = [kv(k, t, v) for k, (t, v) in self.kvs.items()] + self.extra_kv
        out = [self.magic, struct.pack("<I", self.version)]
        out.append(
            struct.pack("<Q", len(self.tensors) if self.n_tensors is None else self.n_tensors)
        )
        out.append(struct.pack("<Q", len(entries) if self.n_kv is None else self.n_kv))
        out += entries
        pos = 0
        for t in self.tensors:
            off = pos if t.offset is None else t.offset
            if t.raw_info is not None:
                out.append(t.raw_info)
            else:
                info = gstr(t.name) + struct.pack("<I", len(t.dims))
                info += b"".join(struct.pack("<Q", d) for d in t.dims)
                out.append(info + struct.pack("<IQ", t.type_id, off))
            pos += len(t.data) + (-len(t.data)) % self.align
        return b"".join(out)

    def to_bytes(self) -> bytes:
        head = self.header()
        parts = [head, b"\0" * ((-len(head)) % self.align)]
        for t in self.tensors:
            parts += [t.data, b"\0" * ((-len(t.data)) % self.align)]
        return b"".join(parts)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def open_model(path: str | os.PathLike) -> Any:
    """Everything loading a GGUF does up to the forward pass (as edgerun.api.Model does):
    header, spec, tokenizer, weight store, transformer with its shape checks."""
    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf
    from edgerun.model.transformer import Transformer
    from edgerun.model.weights import ResidentStore
    from edgerun.tokenizer import tokenizer_from_gguf_metadata

    f = read_gguf(path)
    spec = spec_from_gguf(f.metadata, str(path))
    tokenizer_from_gguf_metadata(f.metadata)
    return Transformer(spec, ResidentStore(f, str(path)), str(path))


def bounded(fn: Callable[[], Any], trace: bool = True) -> tuple[BaseException | None, float, int]:
    """Run ``fn``: (the exception it raised or None, seconds taken, peak traced bytes; 0
    when ``trace`` is false)."""
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    err: BaseException | None = None
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the caller judges what was raised
        err = e
    dt = time.perf_counter() - t0
    peak = 0
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return err, dt, peak


def assert_rejected(
    fn: Callable[[], Any],
    *needles: str,
    kind: type[BaseException] = EdgerunError,
    seconds: float = MAX_SECONDS,
) -> BaseException:
    """``fn`` raises ``kind`` (an EdgerunError) whose message holds every needle (the file,
    the field), within ``seconds`` and 100 MB of traced allocations.

    Time is measured without tracemalloc (which slows allocation-heavy code ten-fold), and
    the faster of two tries counts: a stall of a shared 2-core host (seen at 1.16 s for a
    40 KB file in CI) does not repeat, a rejection that really is slow does."""
    err, dt, _ = bounded(fn, trace=False)
    if dt >= seconds:
        err, dt, _ = bounded(fn, trace=False)
    assert err is not None, "the hostile input was accepted"
    assert isinstance(err, kind), f"{type(err).__name__} raised, expected {kind.__name__}: {err}"
    for n in needles:
        assert n in str(err), f"{n!r} not in the message: {err}"
    assert dt < seconds, f"rejection took {dt:.2f} s"
    err2, _, peak = bounded(fn)
    assert type(err2) is type(err), (err, err2)
    assert peak < MAX_BYTES, f"rejection allocated {peak / 1e6:.0f} MB"
    return err


# ------------------------------------------------------------------ fuzzing support
def header_size(path: str | os.PathLike) -> int:
    """Where a valid GGUF's tensor data starts (the header, padded)."""
    from edgerun.formats.gguf import read_gguf

    f = read_gguf(path)
    return min(i.offset for i in f.infos.values())


def gguf_fields(header: bytes, per_array: int = 4) -> list[tuple[int, int]]:
    """(offset, width) of every structural field of a valid GGUF header: the counts, each
    key/name length, value type, array element type and count, n_dims, dim and offset (of
    a long string array, only the first and last ``per_array`` string lengths)."""
    out: list[tuple[int, int]] = [(8, 8), (16, 8)]
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", header, 8)

    def string() -> None:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", header, pos)
        out.append((pos, 8))
        pos += 8 + n

    sizes = {U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, BOOL: 1, U64: 8, I64: 8, F64: 8}
    for _ in range(n_kv):
        string()
        (vt,) = struct.unpack_from("<I", header, pos)
        out.append((pos, 4))
        pos += 4
        if vt == STR:
            string()
        elif vt == ARR:
            it, count = struct.unpack_from("<IQ", header, pos)
            out += [(pos, 4), (pos + 4, 8)]
            pos += 12
            if it == STR:
                for i in range(count):
                    (n,) = struct.unpack_from("<Q", header, pos)
                    if i < per_array or i >= count - per_array:
                        out.append((pos, 8))
                    pos += 8 + n
            else:
                pos += sizes[it] * count
        else:
            out.append((pos, sizes[vt]))
            pos += sizes[vt]
    for _ in range(n_tensors):
        string()
        (nd,) = struct.unpack_from("<I", header, pos)
        out.append((pos, 4))
        pos += 4
        out += [(pos + 8 * d, 8) for d in range(nd)]
        pos += 8 * nd
        out += [(pos, 4), (pos + 4, 8)]
        pos += 12
    return out


def small_vocab(meta: dict[str, Any], n: int = 400) -> dict[str, Any]:
    """A model's tokenizer metadata cut to its first ``n`` tokens (merges and ids that stay
    inside), as plain lists: a real vocabulary's shape at a fuzzable size."""
    out: dict[str, Any] = {}
    tokens = list(meta["tokenizer.ggml.tokens"][:n])
    keep = set(tokens)
    for k, v in meta.items():
        if not k.startswith("tokenizer."):
            continue
        if k == "tokenizer.ggml.tokens":
            out[k] = tokens
        elif k in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            out[k] = [x.item() for x in v[:n]]
        elif k == "tokenizer.ggml.merges":
            merges = []
            for m in v:
                a, _, b = m.partition(" ")
                if a in keep and b in keep and a + b in keep:
                    merges.append(m)
            out[k] = merges or ["a b"]
        elif k.endswith("_token_id"):
            if int(v) < n:
                out[k] = int(v)
        else:
            out[k] = v
    if "tokenizer.ggml.merges" in out and out["tokenizer.ggml.merges"] == ["a b"]:
        for t in ("a", "b", "ab"):
            if t not in keep:
                out["tokenizer.ggml.tokens"].append(t)
                if "tokenizer.ggml.token_type" in out:
                    out["tokenizer.ggml.token_type"].append(1)
                if "tokenizer.ggml.scores" in out:
                    out["tokenizer.ggml.scores"].append(0.0)
    return out


@dataclass
class UntiedStreamed:
    """A tiny untied model twice: resident, and dense-streamed with nothing held."""

    spec: Any
    footprint: Any
    plan: Any
    resident: Any
    store: Any
    streamed: Any

    def logits(self, model) -> tuple[np.ndarray, np.ndarray]:
        """A 3-token prompt's logits, and a batched decode step of two sequences."""
        from edgerun.model.kvcache import KVCache

        c = [KVCache(self.spec, 16, "f32") for _ in range(2)]
        one = model.forward([2, 3, 4], c[0], all_logits=True)
        model.forward([2], c[1])
        return one, model.forward_batch([5, 6], c)


def untied_streamed(tmp_path: Path, hold_later: bool = False) -> UntiedStreamed:
    """The model of model_tensors() plus an untied output head, and a DenseStreamStore at
    the dense minimum (every FFN and head row streamed). hold_later: the plan defers all
    FFN rows, to be held by hold_more()."""
    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf
    from edgerun.model.transformer import Transformer
    from edgerun.model.weights import ResidentStore
    from edgerun.offload.plan import footprint, minimum_budget, plan
    from edgerun.offload.store import DenseStreamStore, OffloadOptions

    b = GGUFBuilder()
    b.tensors.append(Tensor("output.weight", (32, 8), f32((8, 32), seed=9)))
    path = b.write(tmp_path / "untied.gguf")
    f = read_gguf(path)
    spec = spec_from_gguf(f.metadata, str(path))
    fp = footprint(spec, f, "f32")
    p = plan(fp, minimum_budget(fp, 0, 16, "dense"), 0, 16, mode="dense")
    if hold_later:
        p.cache_neurons = p.deferred_neurons = FF
    resident = Transformer(spec, ResidentStore(f, str(path)), str(path))
    store = DenseStreamStore(f, str(path), spec, p, OffloadOptions(io_threads=2))
    return UntiedStreamed(spec, fp, p, resident, store, Transformer(spec, store, str(path)))
