"""Quantized matrix-vector / matrix-matrix products on raw GGUF blocks.

Public API (the model code calls only these):

- `matvec(w, x, out=None)`           y[rows] = W @ x                (decode)
- `matvec_many(ws, x, outs=None)`    [W @ x for W in ws]: matrices sharing x (Q/K/V,
                                     gate/up) in one kernel call where possible
- `matmul(w, x, out=None)`           Y[n, rows] = X[n, cols] @ W.T   (prefill)
- `embedding_rows(w, ids)`           float32 [len(ids), cols] rows of W, dequantized
- `matvec_reference`, `matmul_reference`: numpy references (dequantize + float64 matmul)

The kernels never build a float copy of the matrix: each output row is computed
from the row's blocks. The number of threads is whatever the caller set with
`numba.set_num_threads`.

Kernel paths: "portable" (float32 Numba code, any CPU) and the int8 paths: on x86 CPUs
with AVX-512 VNNI "vnni", on other x86 CPUs with AVX2 "avx2" (x quantized once per call
to two-level int8 blocks of 32 -- q1 plus a rounded residual q2, ~15 bits, so results
match float32 to ~1e-4 -- and integer dot products with vpdpbusd, or on AVX2 vpmaddwd
on the two levels as one int16 word; F32/F16/BF16 weights stay on the float kernels).
Q4_K, Q5_K and Q6_K decode take single-level int8 activations instead (one scale per 256
elements, refined per 32 by powers of two; activation_levels): 1.4-1.6x the two-level
kernel on avx2, and on vnni several decode vectors' dots at half the cost, for logits
~1e-4 KL from float activations (int8.q4_k_block8).
"int8" is the avx2 path's kernels spelled in LLVM's generic vector operations: the default
on 64-bit ARM (NEON widening multiply-adds; tested under qemu-user, not timed on ARM
hardware), anywhere with `EDGERUN_KERNELS=int8` (x86 compiles it to the avx2 path's
instructions).
On the vnni path a tensor with an interleaved copy (QuantTensor.interleaved, made by
`interleave`: 16 rows per block of 32 in the lanes of one register, int8.rows16)
decodes, and short prompts run (_batched_prefill), from the copy; batched rows equal
single ones bit for bit. Longer prompts take the GEMMs on the mapped rows (reads_rows).
The avx2 path runs Q4_K 5-7x and Q6_K 8-11x the portable one (1 thread, Qwen2.5-1.5B
shapes: `python benchmarks/kernels.py --shapes qwen2.5-1.5b --formats Q4_K Q6_K`).
The fastest available path is the default; `EDGERUN_KERNELS=portable` in the environment
or `set_kernel_path("portable")` forces the portable one.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import dataclasses  # noqa: E402
from collections.abc import Callable, Iterable, Sequence  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402

from edgerun.errors import InvalidArgumentError  # noqa: E402
from edgerun.ops._simd import int8_dot  # noqa: E402
from edgerun.ops.traits import NO_GEMM, ROUTES, TRAITS  # noqa: E402
from edgerun.ops.traits import prefill_max as _prefill_max  # noqa: E402
from edgerun.quant.formats import QuantTensor, QuantType, row_bytes  # noqa: E402
from edgerun.quant.reference import dequantize  # noqa: E402

__all__ = [
    "activation_block",
    "activation_levels",
    "available_paths",
    "embedding_rows",
    "interleave",
    "kernel_path",
    "matmul",
    "matmul_reference",
    "matvec",
    "matvec_batch",
    "matvec_many",
    "matvec_reference",
    "quantize_x_reference",
    "quantizes_activations",
    "reads_rows",
    "set_kernel_path",
    "uses_amx",
    "warm_prefill",
]

_NO_ROWS = np.empty((0, 1), np.uint8)
# read-only like the weights (mapped, or set so at load): a kernel called with fewer than
# three matrices then has the same signature as with three, so one compiled kernel
# serves both. A writeable pad would make a third matrix of one format (rows lent under
# a budget: offload/kv_loan.py) load a kernel the warm-up had not, ~76 MB of LLVM pages
# back in a process at its budget.
_NO_ROWS.flags.writeable = False
_NO_OUT = np.empty(0, np.float32)
_NO_OUT2 = np.empty((0, 0), np.float32)


# ------------------------------------------------------------------ kernel tables
# Every format's kernels are its row of ops/traits.py; these are that table's columns,
# looked up by format on each call.
_MV_PORTABLE = {q: t.matvec for q, t in TRAITS.items()}
_MVB = {q: t.matvec_batch for q, t in TRAITS.items() if t.matvec_batch is not None}
_MM_PORTABLE = {q: t.gemm for q, t in TRAITS.items()}
_EMB = {q: t.embedding_rows for q, t in TRAITS.items()}

# int8 paths: matvec kernels take three (data, out) slots: (d0, d1, d2, x, o0, o1, o2).
# "vnni" (AVX-512 VNNI) and "avx2" (the same kernels built on vpmaddwd with int16
# activations, int8.DOT) run every block format, matvec and prefill GEMM.
_MV3_INT8: dict = {}
_MM_INT8: dict = {}
_MVB_INT8: dict = {}
_MM_SUPERBLOCK: dict = {}
_MM_SB_BYTES: dict = {}  # the vnni path's byte GEMM (int8.superblock_bytes)
# the vnni path's decode kernels on interleaved copies (QuantTensor.interleaved)
_MV16: dict = {}
_MVB16: dict = {}
PATHS: tuple[str, ...] = ("portable",)
INT8_PATHS = ("avx2", "vnni", "int8")
if int8_dot() is not None:
    from edgerun.ops import int8 as _v

    PATHS = ("portable", _v.DOT)
    _MV3_INT8 = {q: t.mv3 for q, t in TRAITS.items() if t.mv3 is not None}
    _MM_INT8 = {q: t.gemm_kind for q, t in TRAITS.items() if t.gemm_kind is not None}
    _MVB_INT8 = {q: t.mvb3 for q, t in TRAITS.items() if t.mvb3 is not None}
    # K-quant prefill on every int8 path: one activation scale per super-block
    # (int8.superblock; 1.3-2.4x the per-32 GEMM: benchmarks/superblock_gemm.py)
    from edgerun.ops.int8 import superblock as _sb

    _MM_SUPERBLOCK = {
        q: t.superblock_kind for q, t in TRAITS.items() if t.superblock_kind is not None
    }
    if _v.DOT == "vnni":  # AMX CPUs all have AVX-512 VNNI
        from edgerun.ops import amx as _amx
        from edgerun.ops.int8 import superblock_bytes as _sbb

        # Q5_K, IQ4_XS, Q3_K, Q2_K: weight bytes on vpdpbusd, single-level x per 32
        _MM_SB_BYTES = {q: k for q, k in _MM_SUPERBLOCK.items() if k in _sbb.BYTE_KINDS}
        from edgerun.ops.int8 import rows16 as _r16

        _MV16 = {q: t.mv16 for q, t in TRAITS.items() if t.mv16 is not None}
        _MVB16 = {q: t.mvb16 for q, t in TRAITS.items() if t.mvb16 is not None}

_path = PATHS[-1]
_mv3: dict = _MV3_INT8  # the int8 3-slot kernels of the current path (empty: portable)
_rows16 = _path == "vnni"  # whether decode reads interleaved copies where a tensor has one
_use_amx = False  # the vnni path's prefill GEMMs on AMX tiles (amx)
# Prompts of at most MVB_PREFILL_MAX[route][format] tokens take the batched decode kernels
# instead of a GEMM: each format's crossovers are in its traits row (Traits.prefill_max,
# with the measurements); None holds the route's figure for the other formats.
MVB_PREFILL_MAX: dict[str, dict] = {
    r: {**{q: t.prefill_max[r] for q, t in TRAITS.items()}, None: _prefill_max(r, None)}
    for r in ROUTES
}


# ----------------------------------------------------------------- kernel path selection
def available_paths() -> tuple[str, ...]:
    """Kernel paths this CPU can run: always "portable", plus the int8 kernels: "vnni" on
    AVX-512 VNNI, "avx2" on AVX2, "int8" on 64-bit ARM or where EDGERUN_KERNELS=int8."""
    return PATHS


def kernel_path() -> str:
    """The kernel path in use."""
    return _path


def set_kernel_path(path: str = "auto") -> str:
    """Select "portable", "vnni", "avx2" or "auto" (the fastest this CPU supports); returns
    the choice."""
    global _path, _mv3, _use_amx, _rows16
    if path == "auto":
        path = PATHS[-1]
    if path not in PATHS:
        raise InvalidArgumentError(
            f"kernel path {path!r} is not available on this CPU; choose one of {PATHS} or 'auto'"
        )
    _path = path
    _mv3 = _MV3_INT8 if path in INT8_PATHS else {}
    _use_amx = path == "vnni" and _amx.available()
    _rows16 = path == "vnni"
    return _path


def uses_amx() -> bool:
    """True when prefill GEMMs run on AMX tiles (Intel Xeon 4th gen and newer;
    EDGERUN_AMX=0 turns it off): Q4_K/Q6_K on int8 tiles (the AVX-512 GEMM's integers),
    the block-32 formats on bf16 tiles (amx)."""
    return _use_amx


def _amx_bf16(qtype: QuantType, ntokens: int, cols: int) -> bool:
    """Whether a prefill of `ntokens` rows meets `qtype` on AMX bf16 tiles."""
    return (
        _use_amx
        and ntokens >= _amx.BF16_MIN_TOKENS
        and qtype in _MM_INT8
        and qtype not in _MM_SUPERBLOCK
        and cols % _amx.BF_CHUNK == 0
    )


def warm_prefill(qtypes: Iterable[QuantType], cols: int = 256) -> None:
    """Run the prefill GEMM of each of `qtypes` once, on a small zero matrix and enough
    zero rows to take it (past the format's MVB_PREFILL_MAX on this route, and onto the
    AMX tiles where the CPU has them; a format that never takes a GEMM here, NO_GEMM, is
    left to warm_decode): a short warm-up prompt takes the batched decode kernels instead, and
    the GEMMs' first compile or cache load would otherwise land in a user's first long
    prompt (and, under a RAM budget, after the page cache of loading them is dropped: a
    format that only a later layer uses would load its GEMM mid-prompt and fault ~73 MB
    of libllvmlite.so back)."""
    if _path not in INT8_PATHS:
        return  # the portable matmul is one kernel at any prompt length
    for qtype in dict.fromkeys(qtypes):
        limit = mvb_prefill_max(qtype)
        if limit >= NO_GEMM:
            continue  # every prompt takes the batched kernels (warm_decode's)
        rows = 1 + limit
        if _use_amx:
            rows = max(rows, _amx.BF16_MIN_TOKENS)
        data = np.zeros((8, row_bytes(qtype, cols)), np.uint8)
        matmul(QuantTensor("warm-up", qtype, (8, cols), data), np.zeros((rows, cols), np.float32))


def warm_decode(qtypes: Iterable[QuantType], cols: int = 256) -> None:
    """Run every decode entry (matvec, matvec_many, matvec_batch, matvec_batch_many on one
    and two vectors) once for each of `qtypes`, on a small zero matrix: the kernels are
    typed by format, not shape. Why: under a RAM budget dense offloading holds rows of a
    format (the 1.5B's Q6_K head) only after the warm-up, and the first token would then
    load mv_q6_k from Numba's cache, which runs LLVM and faults ~70 MiB of
    libllvmlite.so back into the page cache the warm-up has just given back."""
    x1 = np.zeros(cols, np.float32)
    x2 = np.zeros((2, cols), np.float32)
    for qtype in dict.fromkeys(qtypes):
        data = np.zeros((8, row_bytes(qtype, cols)), np.uint8)
        w = QuantTensor("warm-up", qtype, (8, cols), data)
        matvec(w, x1)
        matvec_many([w, w], x1)
        for x in (x1[None], x2):
            matvec_batch(w, x)
            matvec_batch_many([w, w], x)


def mvb_prefill_max(qtype: QuantType) -> int:
    """The most prompt tokens for which `qtype` takes the batched decode kernels on the
    current int8 path (MVB_PREFILL_MAX); longer prompts take a GEMM (NO_GEMM: none does)."""
    table = MVB_PREFILL_MAX["amx" if _use_amx else _path]
    return table.get(qtype, table[None])


def _mvb_prefill(qtype: QuantType, ntokens: int) -> bool:
    """Whether a prompt of `ntokens` rows meets `qtype` in the batched decode kernels."""
    return _path in INT8_PATHS and qtype in _MVB_INT8 and 1 < ntokens <= mvb_prefill_max(qtype)


# Prompts of at most this many tokens take an interleaved copy's batched kernels
# (int8.rows16) for the formats outside _MM_SUPERBLOCK; longer ones, and K-quant prompts
# past mvb_prefill_max, the GEMMs on the mapped rows. On Qwen2.5-0.5B (mostly Q5_0) with
# AMX the copies prefill faster up to 64 tokens (169 against 149 tok/s at 64) and slower
# from 128 (258 against 299); K-quant copies lose to the AMX GEMMs from 64 tokens on the
# 1.5B (90 against 137), hence _MM_SUPERBLOCK's exclusion. Re-derive: move the figure
# and compare `edgerun bench -m qwen2.5-coder-0.5b -p 32,64,128 -t 2`, alternating.
ROWS16_PREFILL_MAX = 64


def _batched_prefill(w: QuantTensor, ntokens: int) -> bool:
    """Whether a prompt of `ntokens` rows meets w in the batched decode kernels (an
    interleaved copy's, up to its limit, else _mvb_prefill's)."""
    if ntokens > 1 and _interleaved(w):
        limit = mvb_prefill_max(w.qtype)
        if w.qtype not in _MM_SUPERBLOCK:
            limit = max(limit, ROWS16_PREFILL_MAX)
        return ntokens <= limit
    return _mvb_prefill(w.qtype, ntokens)


def reads_rows(w: QuantTensor, ntokens: int) -> bool:
    """Whether `matmul(w, X)` of ntokens rows reads w.data (the mapped rows) although w
    has an interleaved copy that decode reads (a long prompt's GEMM)."""
    return _interleaved(w) and ntokens > 1 and not _batched_prefill(w, ntokens)


def _x1_span(qtype: QuantType) -> int:
    """Elements per activation scale where `qtype` is one of int8's X1 formats
    (their decode takes quantize_x1's single level; int8.x1_span), else 0."""
    return _v.x1_span.py_func(_MM_INT8[qtype]) if _path in INT8_PATHS and qtype in _MM_INT8 else 0


def _sb8_decode(qtype: QuantType) -> bool:
    """Whether `qtype`'s decode takes quantize_x_sb8's single-level activations on the
    int8 path (its traits row's sb8_decode)."""
    t = TRAITS.get(qtype)
    return t is not None and t.sb8_decode


def _q8_decode(qtype: QuantType, ntokens: int) -> bool:
    """Whether `ntokens` rows meet `qtype` in the single-level int8 decode kernels, one
    vector or a batch: Q4_K, Q5_K and Q6_K (their traits rows' sb8_decode, one scale per 256
    refined per 32, the row kernels and the interleaved copies alike); Q5_0 and the G64
    formats (int8's X1 formats, one scale per 32 or 64)."""
    if _path not in INT8_PATHS or not (ntokens == 1 or _mvb_prefill(qtype, ntokens)):
        return False
    return _sb8_decode(qtype) or _x1_span(qtype) != 0


def activation_block(qtype: QuantType, ntokens: int) -> int:
    """Elements per activation scale when `ntokens` rows of x meet a `qtype` matrix on
    the current path (see quantize_x_reference): 256 for the K-quant prefill GEMM of the
    int8 paths (int8.superblock, and its AMX tiles) and for the single-level Q4_K
    and Q6_K decode kernels (activation_levels), X1's span for its formats' single-level
    decode (64 for the G64 formats), else 32 (prompts of at most mvb_prefill_max tokens,
    on the batched decode kernels, included)."""
    if _q8_decode(qtype, ntokens) and _sb8_decode(qtype):
        return 256
    if _q8_decode(qtype, ntokens) and _x1_span(qtype):
        return _x1_span(qtype)
    if ntokens > 1 and _path in INT8_PATHS and qtype in _MM_SUPERBLOCK:
        return 32 if _mvb_prefill(qtype, ntokens) or _sb_bytes(qtype, ntokens) else 256
    return 32


def _sb_bytes(qtype: QuantType, ntokens: int) -> bool:
    """Whether a prompt of `ntokens` rows meets `qtype` in the vnni path's byte GEMM
    (int8.superblock_bytes: single-level x, one scale per 32)."""
    if ntokens < 2 or _path != "vnni" or qtype not in _MM_SB_BYTES or _mvb_prefill(qtype, ntokens):
        return False
    return not (_use_amx and ntokens >= _amx.MIN_TOKENS)


def activation_levels(qtype: QuantType, ntokens: int) -> int:
    """2 where the int8 paths quantize x to two levels (~15 bits), 1 where a decode kernel
    takes single-level int8 (Q4_K, Q5_K and Q6_K with power-of-two refinements per 32, Q5_0
    with a scale per 32 and the G64 formats per 64; see quantize_x_reference)."""
    return 1 if _q8_decode(qtype, ntokens) or _sb_bytes(qtype, ntokens) else 2


def quantizes_activations(qtype: QuantType, ntokens: int = 1, cols: int = 0) -> bool:
    """Whether the current path quantizes x to int8 blocks for this weight format, when
    `ntokens` rows of `cols` columns meet it (the AMX bf16 GEMM of a prefill does not)."""
    if ntokens > 1 and _amx_bf16(qtype, ntokens, cols):
        return False
    if _path not in INT8_PATHS:
        return False
    # the formats with only the int8 GEMM (no int8 matvec) quantize x for prompts only
    return qtype in _MV3_INT8 or (ntokens > 1 and qtype in _MM_INT8)


_env = numba_env.requested_kernels()
set_kernel_path(_env if _env in ("auto", *PATHS) else "auto")  # vnni asked on a non-VNNI CPU


# ------------------------------------------------------------------------- helpers
def _raw(w: QuantTensor) -> np.ndarray:
    """w.data as C-contiguous uint8 [rows, row_bytes] (a view whenever possible)."""
    rows, cols = w.shape
    data = w.data
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8)
    nbytes = row_bytes(w.qtype, cols)
    if data.ndim != 2 or data.shape != (rows, nbytes):
        if data.size != rows * nbytes:
            raise InvalidArgumentError(
                f"{w.name}: data has {data.size} bytes, {w.qtype.name} {w.shape} needs "
                f"{rows * nbytes}"
            )
        data = data.reshape(rows, nbytes)
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data


def _data(w: QuantTensor) -> np.ndarray:
    d = w.data
    # fast path: the common case of a contiguous uint8 [rows, row_bytes] view
    if (
        d.dtype == np.uint8
        and d.ndim == 2
        and d.shape[0] == w.shape[0]
        and d.flags.c_contiguous
        and d.shape[1] == _row_bytes(w.qtype, w.shape[1])
    ):
        return d
    return _raw(w)


_RB_CACHE: dict[tuple[int, int], int] = {}


def _row_bytes(qtype: QuantType, cols: int) -> int:
    key = (qtype, cols)
    n = _RB_CACHE.get(key)
    if n is None:
        n = _RB_CACHE[key] = row_bytes(qtype, cols)
    return n


def _vec(x: np.ndarray, cols: int, name: str) -> np.ndarray:
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (cols,):
        raise InvalidArgumentError(f"matvec of {name}: x has shape {x.shape}, expected ({cols},)")
    return x


def _rows(x: np.ndarray, w: QuantTensor, op: str) -> np.ndarray:
    """x as C-contiguous float32 [n, cols of w], or an error naming the tensor."""
    cols = w.shape[1]
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise InvalidArgumentError(f"{op} of {w.name}: x has shape {x.shape}, expected (n, {cols})")
    return x


def _out(out: np.ndarray | None, shape: tuple[int, ...], name: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{name}: out must be a C-contiguous float32 array of shape {shape}, "
            f"got {out.dtype} {out.shape}"
        )
    return out


# ---------------------------------------------------------------------------- API
def matvec(w: QuantTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = W @ x for a quantized W [rows, cols] and float32 x [cols] -> float32 [rows]."""
    rows, cols = w.shape
    x = _vec(x, cols, w.name)
    out = _out(out, (rows,), w.name)
    k = _mv3.get(w.qtype)
    if _interleaved(w):
        _MV16[w.qtype](w.interleaved, _NO_ROWS, _NO_ROWS, x, out, _NO_OUT, _NO_OUT)
    elif k is not None:
        k(_data(w), _NO_ROWS, _NO_ROWS, x, out, _NO_OUT, _NO_OUT)
    else:
        _MV_PORTABLE[w.qtype](_data(w), x, out)
    return out


def matvec_many(
    ws: Sequence[QuantTensor], x: np.ndarray, outs: Sequence[np.ndarray] | None = None
) -> list[np.ndarray]:
    """[W @ x for W in ws] for matrices that share x (e.g. Q, K, V or gate, up).

    On the vnni path, consecutive matrices of one format go through one kernel call
    (up to three at a time): x is quantized once and the threads are started once.
    Results are identical to separate `matvec` calls.
    """
    n = len(ws)
    if outs is not None and len(outs) != n:
        raise InvalidArgumentError(f"matvec_many: {n} matrices but {len(outs)} outputs")
    if n == 0:
        return []
    w0 = ws[0]
    cols = w0.shape[1]
    x = _vec(x, cols, w0.name)
    res = []
    for i in range(n):
        w = ws[i]
        if w.shape[1] != cols:
            raise InvalidArgumentError(
                f"matvec_many: {w.name} has {w.shape[1]} columns, {w0.name} has {cols}"
            )
        res.append(_out(None if outs is None else outs[i], (w.shape[0],), w.name))
    for i, count, k in _format_runs(ws, _mv3, _MV16):
        if k is None:
            _MV_PORTABLE[ws[i].qtype](_data(ws[i]), x, res[i])
        else:
            _call3(k, ws[i : i + count], x, res[i : i + count], _NO_OUT)
    return res


def bound_matvecs(
    ws: Sequence[QuantTensor], x: np.ndarray, outs: Sequence[np.ndarray]
) -> list[tuple[Callable, tuple]]:
    """The kernel calls `matvec_many(ws, x, outs)` makes, as (kernel, arguments) bound to
    these buffers, for a caller that reuses them every token (decode_step.py): calling
    them skips the checks and lookups, which cost a one-token decode step of a small model
    more than its kernels' own call overhead. Results equal `matvec_many`'s bit for bit.
    x, outs are checked here, once; they must stay alive as long as the calls."""
    if len(outs) != len(ws) or not ws:
        raise InvalidArgumentError(f"bound_matvecs: {len(ws)} matrices, {len(outs)} outputs")
    cols = ws[0].shape[1]
    if x.shape != (cols,) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise InvalidArgumentError(f"bound_matvecs: x must be C-contiguous float32 ({cols},)")
    for w, o in zip(ws, outs):
        if w.shape[1] != cols:
            raise InvalidArgumentError(
                f"bound_matvecs: {w.name} has {w.shape[1]} columns, {ws[0].name} has {cols}"
            )
        _out(o, (w.shape[0],), w.name)
    calls: list[tuple[Callable, tuple]] = []
    for i, count, k in _format_runs(ws, _mv3, _MV16):
        if k is None:
            calls.append((_MV_PORTABLE[ws[i].qtype], (_data(ws[i]), x, outs[i])))
        else:
            calls.append((k, _args3(ws[i : i + count], x, outs[i : i + count], _NO_OUT)))
    return calls


def bound_matvecs_batch(
    ws: Sequence[QuantTensor], x: np.ndarray, outs: Sequence[np.ndarray]
) -> list[tuple[Callable, tuple]]:
    """The kernel calls `matvec_batch_many(ws, x)` makes for x [n >= 2, cols] into outs
    [n, rows of each], bound as `bound_matvecs` binds one vector's (same results)."""
    n = x.shape[0]
    if n < 2 or len(outs) != len(ws) or not ws:
        raise InvalidArgumentError(f"bound_matvecs_batch: {n} vectors, {len(ws)} matrices")
    x = _rows(x, ws[0], "bound_matvecs_batch")
    for w, o in zip(ws, outs):
        _rows(x, w, "bound_matvecs_batch")
        _out(o, (n, w.shape[0]), w.name)
    calls: list[tuple[Callable, tuple]] = []
    if _path in INT8_PATHS:
        for i, count, k in _format_runs(ws, _MVB_INT8, _MVB16):
            if k is None:
                calls += _bound_one_batch(ws[i], x, outs[i])
            else:
                calls.append((k, _args3(ws[i : i + count], x, outs[i : i + count], _NO_OUT2)))
    else:
        for w, o in zip(ws, outs):
            calls += _bound_one_batch(w, x, o)
    return calls


def _bound_one_batch(w: QuantTensor, x: np.ndarray, out: np.ndarray) -> list:
    """matvec_batch(w, x, out)'s calls for n >= 2 vectors off the int8 3-slot kernels."""
    if _portable_batch(w.qtype):
        return [(_MVB[w.qtype], (_data(w), x, out))]
    return [c for i in range(x.shape[0]) for c in bound_matvecs((w,), x[i], (out[i],))]


def _portable_batch(qtype: QuantType) -> bool:
    """Whether a batch of decode vectors takes the portable batched kernel: on the
    portable path, and on the int8 paths for the formats whose decode is portable there
    (no int8 matvec: its rows equal the portable matvec's bit for bit)."""
    return qtype in _MVB and (_path == "portable" or qtype not in _mv3)


def _format_runs(ws: Sequence[QuantTensor], kernels: dict, kernels16: dict):
    """(first, count, kernel) over ws: runs of up to three consecutive matrices of one
    format, all interleaved (a kernel of kernels16) or none (of kernels), that have a
    three-matrix kernel; any other matrix alone, None."""
    i = 0
    while i < len(ws):
        q, il = ws[i].qtype, _interleaved(ws[i])
        k = (kernels16 if il else kernels).get(q)
        count = 1
        while (
            k is not None
            and count < 3
            and i + count < len(ws)
            and ws[i + count].qtype == q
            and _interleaved(ws[i + count]) == il
        ):
            count += 1
        yield i, count, k
        i += count


def _interleaved(w: QuantTensor) -> bool:
    """Whether decode reads w's interleaved copy (int8.rows16): on the vnni path."""
    return _rows16 and w.interleaved is not None


def _mvb_kernel(w: QuantTensor) -> Callable:
    """The batched three-slot kernel of an int8-path format, for w's layout."""
    return _MVB16[w.qtype] if _interleaved(w) else _MVB_INT8[w.qtype]


def _gets_copy(w: QuantTensor) -> bool:
    """Whether interleave(w) makes a copy: the vnni path, a format the copies' kernels
    cover, and none made yet."""
    return _path == "vnni" and w.qtype in _MV16 and w.interleaved is None


def copy_bytes(w: QuantTensor) -> int:
    """Bytes `interleave(w)` would add: 0 where w gets no copy here."""
    if not _gets_copy(w):
        return 0
    groups, row_bytes = _r16.copy_shape(w.qtype, w.shape[0], w.shape[1])
    return groups * row_bytes


def interleave(w: QuantTensor) -> QuantTensor:
    """w with a row-interleaved copy for the decode kernels (int8.rows16) where this
    process runs them (the vnni path) and they cover its format; else w itself. The copy
    takes about as many bytes as w.data; long prompts' GEMMs still read w.data."""
    if not _gets_copy(w):
        return w
    il = _r16.interleave(w.qtype, _data(w), w.shape[0], w.shape[1])
    return dataclasses.replace(w, interleaved=il)


def _args3(ws, x, outs, no_out) -> tuple:
    """A three-matrix kernel's arguments for 1-3 matrices (their interleaved copies where
    decode reads those); unused slots get 0-row arrays."""
    pad = 3 - len(ws)
    d = [w.interleaved if _interleaved(w) else _data(w) for w in ws] + [_NO_ROWS] * pad
    o = list(outs) + [no_out] * pad
    return (d[0], d[1], d[2], x, o[0], o[1], o[2])


def _call3(kernel, ws, x, outs, no_out) -> None:
    """A three-matrix kernel on 1-3 matrices."""
    kernel(*_args3(ws, x, outs, no_out))


def matmul(w: QuantTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Y = X @ W.T for float32 X [n, cols] -> float32 [n, rows] (prefill). A few rows
    take the batched decode kernels (mvb_prefill_max), more a GEMM (AMX tiles where the
    CPU has them)."""
    rows = w.shape[0]
    x = _rows(x, w, "matmul")
    n = x.shape[0]
    out = _out(out, (n, rows), w.name)
    if n == 0 or rows == 0:
        return out
    if n == 1:
        matvec(w, x[0], out[0])
        return out
    if _batched_prefill(w, n):
        _call3(_mvb_kernel(w), [w], x, [out], _NO_OUT2)
        return out
    if _use_amx and n >= _amx.MIN_TOKENS and w.qtype in _MM_SUPERBLOCK:
        parts = 4 * numba.get_num_threads()
        _amx.mm_superblock_amx(_MM_SUPERBLOCK[w.qtype], _data(w), x, out, parts)
    elif _sb_bytes(w.qtype, n):
        _sbb.mm_superblock_bytes(_MM_SB_BYTES[w.qtype], _data(w), x, out)
    elif _path in INT8_PATHS and w.qtype in _MM_SUPERBLOCK:
        _sb.mm_superblock(_MM_SUPERBLOCK[w.qtype], _data(w), x, out)
    elif _amx_bf16(w.qtype, n, x.shape[1]):
        _amx.mm_bf16_amx(_MM_INT8[w.qtype], _data(w), x, out, 4 * numba.get_num_threads())
    elif _path in INT8_PATHS and w.qtype in _MM_INT8:
        _v.mm_int8(_MM_INT8[w.qtype], _data(w), x, out)
    else:
        _MM_PORTABLE[w.qtype](_data(w), x, out)
    return out


def matvec_batch(w: QuantTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Y[v] = W @ x[v] for a few decode vectors x [n, cols] -> [n, rows].

    Each row equals `matvec(w, x[v])` bit for bit (batched decode must not change a
    session's tokens). The block formats read each weight row once for all vectors: on
    the int8 paths through int8.mvb_<fmt> (each block unpacked once for 4
    vectors), on the portable path through portable.batch (each block unpacked
    once); other formats take one matvec per vector.
    """
    rows = w.shape[0]
    x = _rows(x, w, "matvec_batch")
    n = x.shape[0]
    out = _out(out, (n, rows), w.name)
    if n > 1 and _path in INT8_PATHS and w.qtype in _MVB_INT8:
        _call3(_mvb_kernel(w), [w], x, [out], _NO_OUT2)
    elif n > 1 and _portable_batch(w.qtype):
        _MVB[w.qtype](_data(w), x, out)
    else:
        for i in range(n):
            matvec(w, x[i], out[i])
    return out


def matvec_batch_many(ws: Sequence[QuantTensor], x: np.ndarray) -> list[np.ndarray]:
    """[matvec_batch(W, x) for W in ws] for matrices that share the decode vectors x
    [n, cols] (Q, K, V or gate, up). On the int8 paths consecutive matrices of one format
    take one kernel call (up to three): x is quantized once and the threads start once,
    as matvec_many does for one vector. Rows equal `matvec(W, x[v])` bit for bit."""
    if not ws:
        return []
    w0 = ws[0]
    x = _rows(x, w0, "matvec_batch_many")
    n = x.shape[0]
    for w in ws:
        if w.shape[1] != w0.shape[1]:
            raise InvalidArgumentError(
                f"matvec_batch_many: {w.name} has {w.shape[1]} columns, {w0.name} has {w0.shape[1]}"
            )
    if n == 1:  # one launch and one x quantization for all of them, as forward does
        return [y.reshape(1, -1) for y in matvec_many(ws, x[0])]
    if _path not in INT8_PATHS:
        return [matvec_batch(w, x) for w in ws]
    res = [_out(None, (n, w.shape[0]), w.name) for w in ws]
    for i, count, k in _format_runs(ws, _MVB_INT8, _MVB16):
        if k is None:
            matvec_batch(ws[i], x, res[i])
        else:
            _call3(k, ws[i : i + count], x, res[i : i + count], _NO_OUT2)
    return res


def project(w: QuantTensor, x: np.ndarray) -> np.ndarray:
    """x [n, cols] -> [n, rows]: one token takes the matvec kernel, several the matmul.

    Looks `matvec` / `matmul` up at call time so calibration can wrap them.
    """
    if x.shape[0] == 1:
        return matvec(w, x[0]).reshape(1, -1)
    return matmul(w, x)


def project_many(ws: Sequence[QuantTensor], x: np.ndarray) -> list[np.ndarray]:
    """Several projections of the same x [n, cols]; in decode x is quantized once."""
    if x.shape[0] == 1:
        return [y.reshape(1, -1) for y in matvec_many(ws, x[0])]
    if all(_batched_prefill(w, x.shape[0]) for w in ws):  # x quantized once
        return matvec_batch_many(ws, x)
    return [matmul(w, x) for w in ws]


def embedding_rows(w: QuantTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W dequantized: float32 [len(ids), cols]; bit-exact with the reference."""
    rows, cols = w.shape
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise InvalidArgumentError(
            f"embedding_rows of {w.name}: ids must be in [0, {rows}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    out = np.empty((ids.shape[0], cols), np.float32)
    if ids.size:
        if _interleaved(w):  # a tied head's copy, the only one kept (model.interleave_weights)
            _r16.embedding_rows16(_r16.KIND_OF[w.qtype], w.interleaved, ids, out)
        else:
            _EMB[w.qtype](_data(w), ids, out)
    return out


# ---------------------------------------------------------------------- references
def quantize_x_reference(x: np.ndarray, block: int = 32, levels: int = 2) -> np.ndarray:
    """What the int8 paths compute with instead of x (see activation_block and
    activation_levels). The last axis must be a multiple of `block`.

    levels=2, per block: dx = max|x| / 127, q1 = rint(x / dx), q2 = rint((x - q1 dx) *
    128 / dx); returns (128 q1 + q2) * dx / 128 (float32), within dx / 256 of x.
    levels=1, per block dx = max|x| / 127: blocks of 256 (int8.quantize_x_sb8)
    refine it per 32 elements by the largest e <= 6 with 2^e max|x_32| <= max|x|,
    q = rint(x 2^e / dx), returning q dx / 2^e, within dx / 2^(e+1) of x; blocks of 32
    or 64 (quantize_x1) keep e = 0.
    """
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(*x.shape[:-1], -1, block)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0.0), np.float32(1.0) / d).astype(np.float32)
    if levels == 1:
        amax = np.abs(b).max(axis=-1, keepdims=True)
        s = b.reshape(*b.shape[:-1], -1, 32)
        a32 = np.abs(s).max(axis=-1, keepdims=True)
        e = np.zeros(a32.shape, np.int32)
        # as the kernel: while e < 6 and a32 2^(e+1) <= amax (blocks of 256 only)
        for _ in range(6 if block == 256 else 0):
            grow = (e < 6) & (
                a32 * np.float32(2.0) ** (e + 1).astype(np.float32) <= amax[..., None]
            )
            e += grow
        f = np.float32(2.0) ** e.astype(np.float32)
        q = np.rint(s * (inv[..., None] * f))
        out = q.astype(np.float64) * (d[..., None] / f).astype(np.float64)
        return out.astype(np.float32).reshape(x.shape)
    q1 = np.rint(b * inv)
    q2 = np.rint((b - q1 * d) * (inv * np.float32(128.0)))
    q = q1.astype(np.float64) * 128 + q2
    return (q * (d.astype(np.float64) / 128)).astype(np.float32).reshape(x.shape)


def matvec_reference(w: QuantTensor, x: np.ndarray) -> np.ndarray:
    """numpy reference: dequantize the whole matrix, float64 product -> float32 [rows]."""
    wf = dequantize(w.qtype, _raw(w)).astype(np.float64)
    return (wf @ np.asarray(x, dtype=np.float64)).astype(np.float32)


def matmul_reference(w: QuantTensor, x: np.ndarray) -> np.ndarray:
    """numpy reference: dequantize the whole matrix, float64 product -> float32 [n, rows]."""
    wf = dequantize(w.qtype, _raw(w)).astype(np.float64)
    return (np.asarray(x, dtype=np.float64) @ wf.T).astype(np.float32)
