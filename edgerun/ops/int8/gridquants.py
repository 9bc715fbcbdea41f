"""int8 decode kernels of GGML's grid formats IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S
(layouts: edgerun.quant.gridquants; float kernels: ops.portable.gridquants).

A super-block of 256 weights is unpacked once into signed int8 weights on the stack: each
group of 8 is one 64-bit grid row (two 32-bit rows for the 4-level IQ3 grids) with its
signs applied as a byte mask m (0xFF where negative), (g ^ m) + (m & 0x01..01): the
grid levels are never 0, so no byte carries into the next. The int8 weights then meet
single-level int8 activations (int8.activations.quantize_x_sb8: one scale per 256
refined per 32 by a power of two, finer than llama.cpp's q8_K) in int32 dot products per
32 (per 16 for IQ2_XS, whose scales are per 16), as ggml-cpu's
ggml_vec_dot_iq*_q8_K do; the sub-block scales (integers 2s+1 for the IQ2/IQ3_XXS
types, 1+2s for IQ3_S) and the activations' per-32 refinement 2^(6-e) multiply the dot
in integers, and one float multiply per super-block applies d and the activations' scale.

Entry points, as int8.matvec's and int8.batch's: `mv_<fmt>(d0, d1, d2, x, o0, o1, o2)`
(up to three matrices sharing x, one x quantization, one parallel loop; 0-row arrays for
unused slots) and `mvb_<fmt>(d0, d1, d2, X, o0, o1, o2)` for a few vectors or a prompt:
each super-block unpacked once for up to VGROUP vectors. Row v of a batch equals mv_<fmt>
on X[v] bit for bit: both run _row_sums, whose float operations per vector are the same
sequence.

The unpacking is plain Numba and the dot one intrinsic per super-block (sb_dot), so they
run on every int8 path (vnni, avx2, the generic int8 build).

ops/traits.py's grid rows do not take them: on Qwen2.5-Coder-1.5B's 8960x1536 IQ3_S ffn
matrix (vnni CPU, shared host) one vector takes 35 / 26 ms (1 / 2 threads) against the
portable mv_grid's 32 / 24 ms, as the scalar unpack through the stack (8-byte stores read
back as 32-byte loads) bounds it, while 32 vectors take 297 / 210 ms against the portable
GEMM's 608 / 420 ms. A decode row must equal its batched row bit for bit, so mv and mvb
enter the rows together once one vector's unpack stays in registers; the prompt kernel
alone needs a prefill entry of its own in the traits.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops.int8.activations import quantize_x_sb8  # noqa: E402
from edgerun.ops.int8.ir import _IR, DOT, I8, I32, I64, V8I32, _v  # noqa: E402
from edgerun.ops.int8.matvec import _batch_row, _set_row  # noqa: E402
from edgerun.ops.portable.gridquants import (  # noqa: E402
    KIND_IQ2_XS,
    KIND_IQ2_XXS,
    KIND_IQ3_S,
    KIND_IQ3_XXS,
    f16_at,
    u32_at,
)
from edgerun.quant.iq_grids import (  # noqa: E402
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    KSIGNS,
)

__all__ = [
    "GRID_INT8_KINDS",
    "mv_iq2_xs",
    "mv_iq2_xxs",
    "mv_iq3_s",
    "mv_iq3_xxs",
    "mvb_iq2_xs",
    "mvb_iq2_xxs",
    "mvb_iq3_s",
    "mvb_iq3_xxs",
]

GRID_INT8_KINDS = (KIND_IQ2_XXS, KIND_IQ2_XS, KIND_IQ3_XXS, KIND_IQ3_S)

VGROUP = 8  # vectors a batched kernel runs per unpacked super-block (their x stays in L1/L2)


def _packed(grid: np.ndarray) -> np.ndarray:
    """grid uint8 [n, k] -> uint64 [n]: row i's k bytes little-endian (byte j = level j)."""
    shifts = np.arange(grid.shape[1], dtype=np.uint64) * np.uint64(8)
    return (grid.astype(np.uint64) << shifts).sum(axis=1).astype(np.uint64)


G2XXS = _packed(IQ2XXS_GRID)
G2XS = _packed(IQ2XS_GRID)
G3XXS = _packed(IQ3XXS_GRID)
G3S = _packed(IQ3S_GRID)
# SMASK[b]: byte j = 0xFF where bit j of b is set (a negative weight); KMASK: the same for
# KSIGNS's 128 patterns (the 7-bit sign indices of IQ2_XXS, IQ2_XS and IQ3_XXS)
_BITS = (np.arange(256)[:, None] >> np.arange(8)) & 1
SMASK = _packed((_BITS * 255).astype(np.uint8))
KMASK = SMASK[KSIGNS]
LOW32 = np.uint64(32)

F0 = np.float32(0.0)


# a row's scratch in uint64 words: 32 of grid bytes, 32 of sign masks, 8 of scales (16
# int32), 8 of multipliers (16 int32), 8 of sums (16 float32, VGROUP of them used)
STACK_WORDS = 88


@intrinsic
def _stack_u64(typingctx):
    """Pointer to STACK_WORDS uninitialised uint64 in the function's entry block."""

    def codegen(context, builder, sig, args):
        n = ir.Constant(ir.IntType(64), STACK_WORDS)
        return cgutils.alloca_once(builder, ir.IntType(64), size=n)

    return types.CPointer(types.uint64)(), codegen


@intrinsic
def _as_i8(typingctx, p):
    """The same memory as int8."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(8).as_pointer())

    return types.CPointer(types.int8)(p), codegen


@intrinsic
def _as_i32(typingctx, p):
    """The same memory as int32."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32).as_pointer())

    return types.CPointer(types.int32)(p), codegen


@intrinsic
def _as_f32(typingctx, p):
    """The same memory as float32."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType().as_pointer())

    return types.CPointer(types.float32)(p), codegen


@njit(inline="always")
def _put(w, j, g, m):
    """Group j of 8 weights: grid bytes g (unsigned levels) at w[j], sign mask m (0xFF
    per negative weight) at w[32 + j]."""
    w[j] = g
    w[32 + j] = m


@njit(inline="always")
def _sb_bytes(kind):
    """Bytes per super-block."""
    if kind == KIND_IQ2_XXS:
        return 66
    if kind == KIND_IQ2_XS:
        return 74
    if kind == KIND_IQ3_XXS:
        return 98
    return 110


@njit(inline="always")
def _sc2(sc, k, v):
    """Scale v for both halves of sub-block k (the formats with one scale per 32)."""
    sc[2 * k] = v
    sc[2 * k + 1] = v


@njit(inline="always")
def _unpack(kind, a, p, w, sc):
    """The super-block at byte p of a -> its grid bytes and sign masks (w: 64 uint64,
    _put's layout) and integer scales per 16 weights (sc: 16 int32); returns the float
    factor d * c they all share (weight = d c sc level sign)."""
    if kind == KIND_IQ2_XXS:
        for ib in range(8):
            q = p + 2 + 8 * ib
            aux = u32_at(a, q + 4)
            _sc2(sc, ib, np.int32(2 * (aux >> np.uint32(28)) + 1))
            for l in range(4):
                m = KMASK[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                _put(w, 4 * ib + l, G2XXS[a[q + l]], m)
        return f16_at(a, p) * np.float32(0.125)
    if kind == KIND_IQ2_XS:
        for k in range(16):
            sc[k] = np.int32(2 * ((a[p + 66 + (k >> 1)] >> (4 * (k & 1))) & 15) + 1)
            for l in range(2):
                o = p + 2 + 4 * k + 2 * l
                q = np.int32(a[o]) | (np.int32(a[o + 1]) << 8)
                _put(w, 2 * k + l, G2XS[q & 511], KMASK[q >> 9])
        return f16_at(a, p) * np.float32(0.125)
    if kind == KIND_IQ3_XXS:
        for ib in range(8):
            aux = u32_at(a, p + 66 + 4 * ib)
            _sc2(sc, ib, np.int32(2 * (aux >> np.uint32(28)) + 1))
            for l in range(4):
                o = p + 2 + 8 * ib + 2 * l
                g = G3XXS[a[o]] | (G3XXS[a[o + 1]] << LOW32)
                m = KMASK[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                _put(w, 4 * ib + l, g, m)
        return f16_at(a, p) * np.float32(0.25)
    # IQ3_S
    for ib in range(8):
        _sc2(sc, ib, np.int32(1 + 2 * ((a[p + 106 + (ib >> 1)] >> (4 * (ib & 1))) & 15)))
        for l in range(4):
            i = 8 * ib + 2 * l
            qh = np.int32(a[p + 66 + (i >> 3)]) >> (i & 7)
            q0 = np.int32(a[p + 2 + i]) | ((qh & 1) << 8)
            q1 = np.int32(a[p + 3 + i]) | ((qh & 2) << 7)
            _put(w, 4 * ib + l, G3S[q0] | (G3S[q1] << LOW32), SMASK[a[p + 74 + 4 * ib + l]])
    return f16_at(a, p)


@intrinsic
def sb_dot(typingctx, wm, xb, xo, mul):
    """One super-block's integer sum: sum_h mul[h] * dot(levels, signs * x) over its 16
    halves of 16 weights. wm int8 [512]: the 256 grid bytes (unsigned), then 256 sign
    masks (-1 per negative weight); xb int8 activations from index xo; mul int32 [16]:
    per 16 weights its scale times the activations' refinement. The signs go onto x
    ((x ^ m) - m, exact for |x| <= 127), the unsigned levels meet it in vpdpbusd (vnni)
    or vpmaddubsw + vpmaddwd (avx2, generic IR on the int8 path): int32 lane j holds
    bytes 4j..4j+3 of each 32, so lanes 0-3 take mul[2k], 4-7 mul[2k+1]. The lanes stay
    within int32 (<= 4 * 62 * 127 * 31 * 64 * 8); their sum is taken in int64."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        x0 = args[2]
        zero8 = ir.Constant(V8I32, [0] * 8)
        ones = ir.Constant(_v(ir.IntType(16), 16), [1] * 16)
        mulv = r.load(3, ir.Constant(I64, 0), _v(I32, 16))
        acc = zero8
        for k in range(8):
            w = r.load(0, ir.Constant(I64, 32 * k), _v(I8, 32))
            m = r.load(0, ir.Constant(I64, 256 + 32 * k), _v(I8, 32))
            x = r.load(1, x0, _v(I8, 32), 32 * k)
            xs = b.sub(b.xor(x, m), m)
            if DOT == "vnni":
                f = r.fn("llvm.x86.avx512.vpdpbusd.256", V8I32, [V8I32] * 3)
                d = b.call(f, [zero8, b.bitcast(w, V8I32), b.bitcast(xs, V8I32)])
            else:
                d = r.madd16(r.maddubs(w, xs), ones)
            mk = r.shuf(mulv, mulv, [2 * k] * 4 + [2 * k + 1] * 4)
            acc = b.add(acc, b.mul(d, mk))
        wide = b.sext(acc, _v(I64, 8))
        t = b.extract_element(wide, ir.Constant(I32, 0))
        for j in range(1, 8):
            t = b.add(t, b.extract_element(wide, ir.Constant(I32, j)))
        return t

    return types.int64(wm, xb, xo, mul), codegen


@njit(inline="always")
def _row_sums(kind, a, base, nsb, cols, xb, xsb, xp, v0, nv, acc, w, wm, sc, mul):
    """acc[v] = row . x_v for vectors v0 .. v0+nv-1 of the quantized activations (vector v
    at xb[v cols], xsb[9 v nsb], xp[8 v nsb]); each super-block unpacked once."""
    sb = _sb_bytes(kind)
    for v in range(nv):
        acc[v] = F0
    for s in range(nsb):
        dw = _unpack(kind, a, base + s * sb, w, sc)
        for v in range(nv):
            vv = v0 + v
            po = vv * 8 * nsb + 8 * s
            for h in range(16):
                mul[h] = sc[h] * np.int32(xp[po + (h >> 1)])
            t = sb_dot(wm, xb, np.int64(vv * cols + 256 * s), mul)
            acc[v] += (dw * xsb[vv * 9 * nsb + 9 * s + 8]) * np.float32(t)


@njit(inline="always")
def _views(p):
    """A row's scratch (STACK_WORDS at p) -> (w, wm, sc, mul, acc)."""
    w = numba.carray(p, 64)
    wm = numba.carray(_as_i8(p), 512)
    i32 = numba.carray(_as_i32(p), 2 * STACK_WORDS)
    acc = numba.carray(_as_f32(p), 2 * STACK_WORDS)[160:]
    return w, wm, i32[128:144], i32[144:160], acc


@njit(inline="always")
def _mv(kind, d0, d1, d2, x, o0, o1, o2):
    """o_k = W_k @ x for up to three matrices of one grid format on one quantized x."""
    cols = x.shape[0]
    nsb = cols // 256
    xb = np.empty(cols, np.int8)
    xsb = np.empty(9 * nsb, np.float32)
    xp = np.empty(8 * nsb, np.int16)
    quantize_x_sb8(x, xb, xsb, xp)
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    for i in prange(d0.shape[0] + d1.shape[0] + d2.shape[0]):
        w, wm, sc, mul, acc = _views(_stack_u64())
        flat, base, _, r = _batch_row(i, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        _row_sums(kind, flat, base, nsb, cols, xb, xsb, xp, 0, 1, acc, w, wm, sc, mul)
        _set_row(i, o0, o1, o2, r, acc[0])


@njit(inline="always")
def _mvb(kind, d0, d1, d2, X, o0, o1, o2):
    """o_k[v] = W_k @ X[v] for up to three matrices sharing X (rows as _mv's)."""
    nv, cols = X.shape
    nsb = cols // 256
    xb = np.empty(nv * cols, np.int8)
    xsb = np.empty(nv * 9 * nsb, np.float32)
    xp = np.empty(nv * 8 * nsb, np.int16)
    for v in range(nv):
        quantize_x_sb8(
            X[v], xb[v * cols :], xsb[v * 9 * nsb : (v + 1) * 9 * nsb], xp[v * 8 * nsb :]
        )
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    for row in prange(d0.shape[0] + d1.shape[0] + d2.shape[0]):
        w, wm, sc, mul, acc = _views(_stack_u64())
        flat, base, out, r = _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        for v0 in range(0, nv, VGROUP):
            g = min(VGROUP, nv - v0)
            _row_sums(kind, flat, base, nsb, cols, xb, xsb, xp, v0, g, acc, w, wm, sc, mul)
            for v in range(g):
                out[v0 + v, r] = acc[v]


@njit(parallel=True, cache=True, nogil=True)
def mv_iq2_xxs(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_IQ2_XXS, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_iq2_xs(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_IQ2_XS, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_iq3_xxs(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_IQ3_XXS, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_iq3_s(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_IQ3_S, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_iq2_xxs(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_IQ2_XXS, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_iq2_xs(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_IQ2_XS, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_iq3_xxs(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_IQ3_XXS, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_iq3_s(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_IQ3_S, d0, d1, d2, X, o0, o1, o2)
