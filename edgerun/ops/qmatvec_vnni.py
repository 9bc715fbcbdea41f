"""int8 block kernels: int8 activations x raw GGUF blocks with `vpdpbusd` (AVX-512 VNNI)
or, on CPUs with only AVX2, `vpmaddwd` on int16 activations (`DOT`; same lanes and
int32 results).

Decode has two exceptions: off the vnni path Q4_K and Q6_K take single-level int8
activations with one scale per super-block refined per 32 by powers of two
(quantize_x_sb8, q4_k_block8), half the multiplies for ~1e-4 KL on the logits (see
q4_k_block8); on every int8 path Q5_0 takes a scale per 32 and Q3_G64/Q2_G64 one per 64
(quantize_x1, "X1's formats"): 1.1-1.5x the kernels
(benchmarks/results/decode_quality_avx2.txt has what it costs).

x is quantized once per call to two-level int8 blocks of 32: q1 = rint(x / dx) with
dx = max|x| / 127 (llama.cpp's q8 activations) plus the rounded residual
q2 = rint((x - q1 dx) * 128 / dx). Every weight block is unpacked to unsigned bytes in
registers and multiplied with `llvm.x86.avx512.vpdpbusd.512` (64 u8 x s8 products summed
in groups of 4 into 16 int32 lanes) as 128 * dot(w, q1) + dot(w, q2), exact in int32.
The residual makes the result match the float32 kernels to ~1e-4 (KL ~1e-7 on
SmolLM2's logits, against ~2e-3 for plain q8) for ~20% more compute on VNNI.
The block scales are applied per 32 (or 16) elements in float:
y = sum_b d_b dx'_b dot_b + bias_b sx_b.

The vector code lives in `@intrinsic`s that emit LLVM IR; the row and block loops are
ordinary Numba code. Accumulators are stack vectors (`acc16`, `acc4`) that LLVM
promotes to registers. Only call these kernels on a CPU with AVX-512 BW/VL + VNNI
(`has_vnni()`) or AVX2 + FMA + F16C (`has_avx2()`), or built as "int8" (generic IR, any
CPU: `int8_dot()`): defining them is harmless anywhere, running the x86 forms elsewhere
would crash.

On AVX2 the two levels are one int16 word per element, 128 q1 + q2 (|v| <= 16320), and
`_IR._dot32_words` multiplies the weight bytes, split into even and odd bytes, with
`vpmaddwd`: 2 multiplies per 32 weights where vpmaddubsw on both int8 levels took 4.
Measured on the Zen 3 EPYC (1 thread, weights in L3): a 1024x4096 matvec 425 -> 292 us
(Q4_1), 320 -> 244 us (Q4_K), 405 -> 264 us (Q8_0).

Measured on the 2-core Zen 4 (1 thread, weights in L2): ~9-10 cycles per 64 weights for
Q4_1, i.e. a 1536x576 Q4_1 matvec in ~37 us (single-level q8: ~31 us; portable float
path: ~83 us). Rows never build views (`data[r]` costs an NRT incref/decref per row):
kernels index a flat byte array with offsets.

Entry points: `mv_<fmt>(d0, d1, d2, x, o0, o1, o2)` (up to three matrices sharing x, one
x quantization, one parallel launch; pass 0-row arrays for unused slots) and
`mm_int8(kind, data, X, out)` (prefill, see the matmul section).

x layouts (`quantize_x(x, nib2, ...)`), in chunks of 64 elements [q1 | q2]:
- natural: element order.
- nib2 (Q4_0/Q4_1/Q5_0): blocks in pairs, bytes [x_a[0:16], x_b[0:16], x_a[16:32],
  x_b[16:32]], so that [low nibbles of a and b | high nibbles of a and b] lines up with
  it with a single 256-bit insert; an odd last block stays natural.
- AVX2 word layout: each such region of n positions (n = 64, or 32 for the odd last
  block) as n int16 words, per 32 positions the 16 even ones then the 16 odd ones
  (`_to_words`).
"""

from __future__ import annotations

from edgerun import _numba_env

_numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from llvmlite.binding import llvm_version_info  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops._simd import int8_dot, tree_sum16  # noqa: E402
from edgerun.ops.qmatvec_portable import _f16at, _q4k_sm  # noqa: E402

F0 = np.float32(0.0)
# The int8 dot these kernels are built on: AVX-512 VNNI's vpdpbusd where the CPU has it,
# else AVX2's vpmaddwd on int16 activations (same lanes, same int32 results), or "int8":
# the same int16 multiply-adds in LLVM's generic vector operations, for any LLVM target
# (x86 lowers them to vpmaddwd, AArch64 to NEON widening multiply-adds): the default on
# 64-bit ARM, elsewhere with EDGERUN_KERNELS=int8 (see _simd.int8_dot).
DOT = int8_dot() or "avx2"

# Q4_K decode (mv_q4_k, mvb_q4_k, sparse_ffn's rows) off the vnni path takes single-level
# int8 activations with one scale per super-block refined by powers of two
# (quantize_x_sb8, q4_k_block8): vpmaddubsw plus a vpmaddwd that applies the sub-block
# scales, half the multiplies of the two-level int16 words and no float scaling per
# sub-block. What it measured, in speed and in logits, is at q4_k_block8.
# Measured and not kept on the vnni path (session 31, 2-vCPU Xeon with AVX-512 VNNI, the
# same kernels on ymm vpmaddubsw / vpmaddwd; `kernel_ab.py --base <rev> -t 1`): Q4_K one
# vector 1.24-1.26x, batched 0.89-1.15x; Q6_K one vector 1.01-1.05x, 4 vectors
# 0.56-0.69x; vpdpwssd fusing the scale multiply-add 1.00x. Whole 1.5B decode, edgerun
# bench alternating, 1 thread: ~1.06x, and `vs_llamacpp.py` gave the same ratio for both
# (tg128 1.65x / 1.67x against 1.66x / 1.70x at 1 / 2 threads): decode is bound by DRAM
# there, so the vnni path keeps the more exact two-level activations.
SB8_DECODE = DOT != "vnni"

# Q5_0 and edgerun's Q3_G64 / Q2_G64 (X1's formats) decode on single-level int8
# activations, one scale per 32 as llama.cpp's q8_0 (quantize_x1, _IR.dot_x1): per 64
# nibble weights two vpmaddubsw and one vpmaddwd where the two-level int16 words took four
# vpmaddwd and the shifts and masks that make words of the bytes. Zen 3, one thread,
# alternating with the two-level kernels (`python benchmarks/kernel_ab.py --base <rev>
# --formats Q5_0 Q4_1 --rows R --cols C -t 1`, 4864x896, 896x4864, 262144x640): Q5_0
# 1.15-1.18x (4 vectors 1.53x), Q3_G64 1.11x, Q2_G64 1.20x. Measured and not kept:
# - Q4_1 / Q4_0 the same way, 1.24-1.33x (4 vectors 1.44-1.50x) and SmolLM2 (all Q4_1)
#   decoding 1.47x llama.cpp instead of 1.24x; but that model's logits moved by up to ~1
#   (KL 2e-3 against float activations where the two levels give 2e-7), its greedy chat
#   answers changed, and an f16 KV cache's rounding then moved them by 0.94: the
#   smallest model keeps the two levels. (Q5_0 on the 0.5B: KL 2e-4, top-1 99.5%.)
# - Q8_0 with |w| times x carrying w's sign (llama.cpp's): 0.96-1.04x.
# Session 29: the G64 formats' x takes one scale per 64, the block's own span (its 64
# weights share d and m), so the two halves' vpmaddubsw sums add in int16 and a block is
# one vpmaddwd, one conversion and one 8-lane FMA, not two of each and a lane insert
# (_SV_SHARED): against the per-32 kernels, same benchmark, 4864x896, one thread, 1, 2 and
# 4 vectors: Q2_G64 1.20 / 1.22 / 1.35x, Q3_G64 1.18 / 1.28 / 1.30x. Measured and not
# kept: the 16 bytes of ql broadcast to both lanes and shifted by 0 and 2 with one vpsrlvd
# (and qh broadcast as a quadword, shifted per quarter), 5 instead of 11 unpack ops for
# Q2 and 17 instead of 23 for Q3: Q2 1.00x, Q3 0.89x against the xmm unpack here.
# Session 31: the vnni path too (it had kept two levels), each 32 or 64 bytes one
# vpdpbusd on quantize_x1's bytes, the avx2 path's exact int32 sums, so every int8 path
# computes these formats alike. 2-vCPU Xeon with AVX-512 VNNI, kernels 4864x896, one
# thread, 1 / 2 / 4 vectors: Q5_0 1.14 / 1.16 / 1.24x, Q3_G64 1.08 / 1.17 / 1.22x, Q2_G64
# 1.13 / 1.20 / 1.30x; Qwen2.5-0.5B's decode (`benchmarks/concurrency.py -s 1,4`, 4 rounds
# alternating) 1.05x for one session and 1.13x for four, 4 sessions 2.53x one (median)
# against 2.39x. Logits against float activations (`benchmarks/decode_quality.py`): 0.5B
# KL 1.4e-4, top-1 100% -> 99.5%; Gemma 3 270M KL 1.1e-3, top-1 99.5% (two levels: ~2e-7).
# Their x is one byte an element (x_bytes).

I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
F32 = ir.FloatType()
HALF = ir.HalfType()


def _v(t, n):
    return ir.VectorType(t, n)


V16F, V8F, V4F, V2F = _v(F32, 16), _v(F32, 8), _v(F32, 4), _v(F32, 2)
V16I32, V8I32 = _v(I32, 16), _v(I32, 8)
V64I8, V32I8, V16I8 = _v(I8, 64), _v(I8, 32), _v(I8, 16)


# ------------------------------------------------------------------------ IR helpers
class _IR:
    def __init__(self, context, builder, sig, args):
        self.c, self.b, self.sig, self.args = context, builder, sig, args

    def fn(self, name, ret, argtys):
        m = self.b.module
        f = m.globals.get(name)
        if f is None:
            f = ir.Function(m, ir.FunctionType(ret, argtys), name)
        return f

    def ptr(self, i, off, elty):
        """Pointer to element `off` of array argument i, cast to elty*."""
        a = self.c.make_array(self.sig.args[i])(self.c, self.b, self.args[i])
        return self.b.bitcast(self.b.gep(a.data, [off]), elty.as_pointer())

    def load(self, i, off, ty, extra=0):
        if extra:
            off = self.b.add(off, ir.Constant(off.type, extra))
        return self.b.load(self.ptr(i, off, ty), align=1)

    def const(self, ty, vals):
        return ir.Constant(ty, vals)

    def splat_i8(self, n, v):
        return ir.Constant(_v(I8, n), [v] * n)

    def shuf(self, a, b, idx):
        return self.b.shuffle_vector(a, b, ir.Constant(_v(I32, len(idx)), list(idx)))

    def concat(self, a, b):
        n = a.type.count
        return self.shuf(a, b, range(2 * n))

    def pack2(self, a, c):
        """<2 x T> [a, c] of two scalars of type T."""
        vt = _v(a.type, 2)
        v = self.b.insert_element(ir.Constant(vt, ir.Undefined), a, ir.Constant(I32, 0))
        return self.b.insert_element(v, c, ir.Constant(I32, 1))

    def splat(self, v, n):
        vt = _v(v.type, n)
        u = self.b.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(I32, 0))
        return self.shuf(u, ir.Constant(vt, ir.Undefined), [0] * n)

    def dpx(self, w, i, xo, n):
        """Dot of u8 weights w (<n x i8>, n = 64 or 32) with the two-level activations of
        array arg i at byte offset xo; returns 128*dot(w, q1) + dot(w, q2) in int32 lanes
        (lane j: w bytes 4j..4j+3, vpdpbusd's layout). VNNI: q1 at xo, q2 at xo + n,
        vpdpbusd, shift, vpdpbusd accumulating. AVX2: the activations are int16 words
        (quantize_x's word layout) and each 32 bytes of w take two vpmaddwd."""
        if DOT != "vnni":
            if n == 32:
                return self._dot32_words(w, i, xo)
            lo, hi = range(32), range(32, 64)
            xo_hi = self.b.add(xo, ir.Constant(xo.type, 64))
            return self.concat(
                self._dot32_words(self.shuf(w, w, lo), i, xo),
                self._dot32_words(self.shuf(w, w, hi), i, xo_hi),
            )
        vt = _v(I8, n)
        x1 = self.load(i, xo, vt)
        x2 = self.load(i, xo, vt, n)
        if n == 64:
            f = self.fn("llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
            it, k = V16I32, 16
        else:
            f = self.fn("llvm.x86.avx512.vpdpbusd.256", V8I32, [V8I32, V8I32, V8I32])
            it, k = V8I32, 8
        wb = self.b.bitcast(w, it)
        d1 = self.b.call(f, [ir.Constant(it, [0] * k), wb, self.b.bitcast(x1, it)])
        d1 = self.b.shl(d1, ir.Constant(it, [7] * k))
        return self.b.call(f, [d1, wb, self.b.bitcast(x2, it)])

    def _dot32_words(self, w, i, xo):
        """dot(w, 128 q1 + q2) of 32 u8 weights in 8 int32 lanes (lane j: bytes 4j..4j+3)
        from two vpmaddwd on int16 activations: the even bytes of w (zero-extended in
        place, an and) times the words at xo (the activations of w's even bytes), the odd
        bytes (a 16-bit shift) times the words at xo + 32. Exact for any u8 weight (pair
        sums <= 2 * 255 * 16320), at half the multiplies of vpmaddubsw + vpmaddwd on the
        two int8 levels."""
        b = self.b
        V16I16 = _v(I16, 16)
        v = b.bitcast(w, V16I16)
        even = b.and_(v, ir.Constant(V16I16, [255] * 16))
        odd = b.lshr(v, ir.Constant(V16I16, [8] * 16))
        x_even = self.load(i, xo, V16I16)
        x_odd = self.load(i, xo, V16I16, 32)
        return b.add(self.madd16(even, x_even), self.madd16(odd, x_odd))

    def madd16(self, a, x):
        """vpmaddwd: <16 x i16> a, x -> <8 x i32> lanes a[2j] x[2j] + a[2j+1] x[2j+1].
        The "int8" path spells it in generic IR (widen, multiply, add the even and odd
        products), which x86 lowers to vpmaddwd and other targets to their widening
        multiply-adds (ARM: smull/smlal)."""
        b = self.b
        if DOT == "avx2":
            V16I16 = _v(I16, 16)
            return b.call(self.fn("llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16]), [a, x])
        p = b.mul(b.sext(a, V16I32), b.sext(x, V16I32))
        return b.add(self.shuf(p, p, range(0, 16, 2)), self.shuf(p, p, range(1, 16, 2)))

    def maddubs(self, w, x):
        """vpmaddubsw: <32 x i8> unsigned w, signed x -> <16 x i16> lanes w[2j] x[2j] +
        w[2j+1] x[2j+1] (callers keep the pair sums inside int16: no saturation). The
        "int8" path spells it in generic IR."""
        b = self.b
        V16I16, V32I16 = _v(I16, 16), _v(I16, 32)
        if DOT == "avx2":
            f = self.fn("llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
            return b.call(f, [w, x])
        p = b.mul(b.zext(w, V32I16), b.sext(x, V32I16))
        return b.add(self.shuf(p, p, range(0, 32, 2)), self.shuf(p, p, range(1, 32, 2)))

    def dot_x1(self, w, i, xo, n, fold):
        """dpx on quantize_x1's single-level bytes: dot of n (64 or 32) weight bytes w
        with the int8 activations at byte xo of array arg i, int32 lane j = bytes
        4j..4j+3 (dpx's layout), from vpmaddubsw and a vpmaddwd by ones per 32 bytes.
        fold (the nib2 pairs, _folds): the two halves' int16 sums are added before the
        vpmaddwd (<= 2 * 2 * 31 * 127 for the unsigned 5-bit formats), giving the 8
        folded lanes directly."""
        if DOT == "vnni":  # one vpdpbusd: the same lanes, the same exact int32 sums
            it = V16I32 if n == 64 else V8I32
            f = self.fn(f"llvm.x86.avx512.vpdpbusd.{8 * n}", it, [it, it, it])
            xv = self.b.bitcast(self.load(i, xo, _v(I8, n)), it)
            d = self.b.call(f, [ir.Constant(it, [0] * (n // 4)), self.b.bitcast(w, it), xv])
            if fold and n == 64:
                return self.b.add(self.shuf(d, d, range(8)), self.shuf(d, d, range(8, 16)))
            return d
        ones = ir.Constant(_v(I16, 16), [1] * 16)
        parts = []
        for h in range(n // 32):
            wh = w if n == 32 else self.shuf(w, w, range(32 * h, 32 * h + 32))
            xh = self.load(i, xo, V32I8, 32 * h)
            parts.append(self.maddubs(wh, xh))
        if fold and len(parts) == 2:
            return self.madd16(self.b.add(parts[0], parts[1]), ones)
        dots = [self.madd16(p, ones) for p in parts]
        return dots[0] if len(dots) == 1 else self.concat(dots[0], dots[1])

    def fma(self, a, b, c):
        n = a.type.count
        f = self.fn(f"llvm.fma.v{n}f32", _v(F32, n), [_v(F32, n)] * 3)
        return self.b.call(f, [a, b, c])

    def f16x(self, i, off, n, extra=0):
        """n consecutive fp16 at byte offset off of array arg i -> <n x float>."""
        h = self.load(i, off, _v(HALF, n), extra)
        return self.b.fpext(h, _v(F32, n))

    def f16(self, i, off, extra=0):
        h = self.load(i, off, HALF, extra)
        return self.b.fpext(h, F32)


def _acc_factory(n):
    vt = _v(F32, n)

    def acc(typingctx):
        def codegen(context, builder, sig, args):
            p = cgutils.alloca_once(builder, vt)
            builder.store(ir.Constant(vt, [0.0] * n), p)
            return builder.bitcast(p, F32.as_pointer())

        return types.CPointer(types.float32)(), codegen

    return acc


acc16 = intrinsic(_acc_factory(16))
acc4 = intrinsic(_acc_factory(4))


@intrinsic
def hsum16(typingctx, p):
    """Sum of the 16 float32 at p, as a tree (4 vector adds, not 15 dependent ones)."""

    def codegen(context, builder, sig, args):
        return tree_sum16(builder, args[0])

    return types.float32(p), codegen


def _aptr(ir_, i, vt):
    return ir_.b.bitcast(ir_.args[i], vt.as_pointer())


def _acc_add(ir_, i, vt, fn):
    p = _aptr(ir_, i, vt)
    ir_.b.store(fn(ir_.b.load(p)), p)


# ----------------------------------------------------------------- block intrinsics
# Conventions: (a16, a4) are acc16()/acc4() pointers; row is the uint8 row of W; off a
# byte offset into it; xq the int8 activations, xo a byte offset; xds the float32
# [dx_0, sx_0, dx_1, sx_1, ...] (sx = dx * sum(q_x) of a block), so = index of dx_b.
# a4 collects [d dx, bias sx, d dx, bias sx] per block pair; lanes 1 and 3 are the bias
# sums the caller scales by the format's constant (m: 1, Q4_0: -8, Q5_0: -16, Q8_0: -128).

_SV_NIB2 = [0] * 4 + [2] * 4 + [0] * 4 + [2] * 4  # lanes of a nib2 dot -> block a/b
_SV_NAT2 = [0] * 8 + [2] * 8  # lanes of a natural 2-block dot -> block a/b
_SV_SHARED = [0] * 16  # a G64 block on X1's x: one d and one dx for all 64 (quantize_x1)


def _folds(sv_idx) -> bool:
    """Whether a pair's 16 dot lanes are summed to 8 in integers before the float scale:
    on the vpmaddwd paths (AVX2, int8) the nib2 lane map puts the same blocks in lanes
    0-7 and 8-15 ([a a a a b b b b] twice), so their exact int32 sum takes one conversion
    and one 8-lane FMA where 16 lanes took two of each (VNNI's 16 lanes are one zmm op).
    A G64 block on X1's activations (_SV_SHARED) folds its two halves the same way."""
    return DOT != "vnni" and list(sv_idx) in (_SV_NIB2, _SV_SHARED)


def _fold16(ir_, dot):
    if dot.type.count == 8:  # dot_x1 folded it in int16
        return dot
    return ir_.b.add(ir_.shuf(dot, dot, range(8)), ir_.shuf(dot, dot, range(8, 16)))


def _pair_common(ir_, dot, dm, sx, sv_idx):
    prod = ir_.b.fmul(dm, sx)  # [d_a dx_a, bias_a sx_a, d_b dx_b, bias_b sx_b]
    if _folds(sv_idx):
        sv = ir_.shuf(prod, prod, sv_idx[:8])
        df = ir_.b.sitofp(_fold16(ir_, dot), V8F)
        _acc_add(ir_, 0, V8F, lambda a: ir_.fma(df, sv, a))  # acc16's first 8 lanes
    else:
        sv = ir_.shuf(prod, prod, sv_idx)
        df = ir_.b.sitofp(dot, V16F)
        _acc_add(ir_, 0, V16F, lambda a: ir_.fma(df, sv, a))
    _acc_add(ir_, 1, V4F, lambda a: ir_.b.fadd(a, prod))


def _single_common(ir_, dot8, dm2, sx2):
    prod = ir_.b.fmul(dm2, sx2)  # [d dx, bias sx]
    sv = ir_.shuf(prod, prod, [0] * 8 + [2] * 8)  # lanes 8..15 multiply zeros
    df = ir_.shuf(ir_.b.sitofp(dot8, V8F), ir.Constant(V8F, [0.0] * 8), range(16))
    _acc_add(ir_, 0, V16F, lambda a: ir_.fma(df, sv, a))
    p4 = ir_.shuf(prod, ir.Constant(V2F, [0.0, 0.0]), [0, 1, 2, 3])
    _acc_add(ir_, 1, V4F, lambda a: ir_.b.fadd(a, p4))


def _nib_pair(ir_, q32):
    """<32 x i8> [qs_a | qs_b] -> <64 x u8> [lo_a lo_b | hi_a hi_b]."""
    lo = ir_.b.and_(q32, ir_.splat_i8(32, 15))
    hi = ir_.b.lshr(q32, ir_.splat_i8(32, 4))
    return ir_.concat(lo, hi)


def _nib_single(ir_, q16):
    lo = ir_.b.and_(q16, ir_.splat_i8(16, 15))
    hi = ir_.b.lshr(q16, ir_.splat_i8(16, 4))
    return ir_.concat(lo, hi)


def _sig(a16, a4, row, off, xq, xo, xds, so):
    return types.void(a16, a4, row, off, xq, xo, xds, so)


def _unpack_q4_1(r, off):
    """A Q4_1 block pair at off -> (64 weight bytes in the nib2 order, [d_a, m_a, d_b,
    m_b], the dot lanes' block map)."""
    b = r.b
    q = r.concat(r.load(2, off, V16I8, 4), r.load(2, off, V16I8, 24))
    # both (d, m) pairs as one <2 x i32> -> <4 x half> -> one vcvtph2ps
    w2 = r.pack2(r.load(2, off, I32), r.load(2, off, I32, 20))
    dm = b.fpext(b.bitcast(w2, _v(HALF, 4)), V4F)
    return _nib_pair(r, q), dm, _SV_NIB2


def _block_dot(r, w, xo, n, x1, lanes):
    """A block (pair)'s integer dot at x byte offset xo: dpx on quantize_x's two levels,
    or (x1: X1's formats) dot_x1 on quantize_x1's bytes."""
    if x1:
        return r.dot_x1(w, 4, xo, n, _folds(lanes))
    return r.dpx(w, 4, xo, n)


def _pair_intrinsic(unpack, name, nbytes, x1=False):
    """The block-pair intrinsic of a format whose `unpack(r, off)` gives (weight bytes,
    4 scale lanes, lane map) of the nbytes at off: one dot (_block_dot), then
    _pair_common. x1: one of X1's formats, whose activations are quantize_x1's."""

    def pair(typingctx, a16, a4, row, off, xq, xo, xds, so):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            _prefetch_ahead(r, args[3], nbytes)
            w, dm, lanes = unpack(r, args[3])
            dot = _block_dot(r, w, args[5], 64, x1, lanes)
            _pair_common(r, dot, dm, r.load(6, args[7], V4F), lanes)
            return context.get_dummy_value()

        return _sig(a16, a4, row, off, xq, xo, xds, so), codegen

    pair.__name__ = name
    fn = intrinsic(pair)
    # for the batched blocks (_pair_batch)
    fn.unpack, fn.nbytes, fn.x1 = unpack, nbytes, x1
    return fn


q4_1_pair = _pair_intrinsic(_unpack_q4_1, "q4_1_pair", 40)


def _single_intrinsic(unpack, name, x1=False):
    """The odd-last-block intrinsic of a format whose `unpack(r, off)` gives its 32
    weight bytes and [d, m] (or [d, d]): one 32-byte dot, then _single_common."""

    def single(typingctx, a16, a4, row, off, xq, xo, xds, so):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            w, dm = unpack(r, args[3])
            dot = _block_dot(r, w, args[5], 32, x1, ())
            _single_common(r, dot, dm, r.load(6, args[7], V2F))
            return context.get_dummy_value()

        return _sig(a16, a4, row, off, xq, xo, xds, so), codegen

    single.__name__ = name
    return intrinsic(single)


def _unpack1_q4_1(r, off):
    return _nib_single(r, r.load(2, off, V16I8, 4)), r.f16x(2, off, 2)


q4_1_single = _single_intrinsic(_unpack1_q4_1, "q4_1_single")


def _dd(r, off, extra):
    d = r.f16(2, off, extra)
    return r.splat(d, 2)


def _dd2(r, off, stride):
    """fp16 d of blocks a (at off) and b (at off + stride) -> <4 x float> [da, da, db, db]
    with one conversion."""
    h = r.pack2(r.load(2, off, I16), r.load(2, off, I16, stride))
    f = r.b.fpext(r.b.bitcast(h, _v(HALF, 2)), V2F)
    return r.shuf(f, f, [0, 0, 1, 1])


def _unpack_q4_0(r, off):
    q = r.concat(r.load(2, off, V16I8, 2), r.load(2, off, V16I8, 20))
    return _nib_pair(r, q), _dd2(r, off, 18), _SV_NIB2


q4_0_pair = _pair_intrinsic(_unpack_q4_0, "q4_0_pair", 36)


def _unpack1_q4_0(r, off):
    return _nib_single(r, r.load(2, off, V16I8, 2)), _dd(r, off, 0)


q4_0_single = _single_intrinsic(_unpack1_q4_0, "q4_0_single")


def _hbits(r, off, extra):
    return r.load(2, off, I32, extra)


def _bit_bytes(r, bits, n, value):
    """<n x i8>: `value` in lane j where bit j of the n-bit integer `bits` is set, else 0.
    AVX-512 moves the bits into a mask register (select on <n x i1>). Without it, LLVM
    spreads that select over scalar bit tests (Q5_0 matvec at 2.4 GB/s on Zen 3 against
    15 for Q4_K), so there each lane takes its byte of `bits` (one byte shuffle), keeps its
    bit (an and) and compares."""
    b = r.b
    if DOT == "vnni":
        return b.select(b.bitcast(bits, _v(I1, n)), r.splat_i8(n, value), r.splat_i8(n, 0))
    by = b.bitcast(bits, _v(I8, n // 8))
    spread = r.shuf(by, by, [j >> 3 for j in range(n)])
    bit = r.const(_v(I8, n), [1 << (j & 7) for j in range(n)])
    on = b.icmp_unsigned("!=", b.and_(spread, bit), r.splat_i8(n, 0))
    return b.select(on, r.splat_i8(n, value), r.splat_i8(n, 0))


def _unpack_q5_0(r, off):
    b = r.b
    q = r.concat(r.load(2, off, V16I8, 6), r.load(2, off, V16I8, 28))
    w = _nib_pair(r, q)  # [lo_a lo_b | hi_a hi_b]
    # the high bits in the same order, [a 0:16, b 0:16, a 16:32, b 16:32]: one 16-bit
    # lane shuffle of the two 32-bit qh (scalar shifts and ors took ~10 instructions)
    h4 = b.bitcast(r.pack2(_hbits(r, off, 2), _hbits(r, off, 24)), _v(I16, 4))
    mask = b.bitcast(r.shuf(h4, h4, [0, 2, 1, 3]), I64)
    hv = _bit_bytes(r, mask, 64, 16)
    return b.or_(w, hv), _dd2(r, off, 22), _SV_NIB2


q5_0_pair = _pair_intrinsic(_unpack_q5_0, "q5_0_pair", 44, x1=True)


def _unpack1_q5_0(r, off):
    b = r.b
    w = _nib_single(r, r.load(2, off, V16I8, 6))
    hv = _bit_bytes(r, _hbits(r, off, 2), 32, 16)
    return b.or_(w, hv), _dd(r, off, 0)


q5_0_single = _single_intrinsic(_unpack1_q5_0, "q5_0_single", x1=True)


def _unpack_q8_0(r, off):
    w = r.concat(r.load(2, off, V32I8, 2), r.load(2, off, V32I8, 36))
    w = r.b.xor(w, r.splat_i8(64, 0x80))  # signed -> unsigned (+128)
    return w, _dd2(r, off, 34), _SV_NAT2


q8_0_pair = _pair_intrinsic(_unpack_q8_0, "q8_0_pair", 68)


def _unpack1_q8_0(r, off):
    return r.b.xor(r.load(2, off, V32I8, 2), r.splat_i8(32, 0x80)), _dd(r, off, 0)


q8_0_single = _single_intrinsic(_unpack1_q8_0, "q8_0_single")


@intrinsic
def q4_k_block(typingctx, a16, a8, row, off, xq, xo, xds, so):
    """One 256-element Q4_K super-block; a8 (an acc16 pointer, lanes 0..7 used) collects
    dmin * m_j * sx_j, which the caller subtracts."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        off = args[3]
        _prefetch_ahead(r, off, 144)
        dsc, dmn = _q4k_scales(r, off)
        xs16 = r.load(6, args[7], V16F)  # [dx_0, sx_0, ..., dx_7, sx_7]
        dx8 = r.shuf(xs16, xs16, range(0, 16, 2))
        sx8 = r.shuf(xs16, xs16, range(1, 16, 2))
        ds = b.fmul(dsc, dx8)  # d * sc_j * dx_j
        mterm = b.fmul(dmn, sx8)
        _acc_add(r, 1, V8F, lambda a: b.fadd(a, mterm))
        for g in range(4):
            xo = b.add(args[5], ir.Constant(args[5].type, 128 * g))
            dot = r.dpx(_q4k_chunk(r, off, g), 4, xo, 64)
            sv = r.shuf(ds, ds, [2 * g] * 8 + [2 * g + 1] * 8)
            df = b.sitofp(dot, V16F)
            _acc_add(r, 0, V16F, lambda a, df=df, sv=sv: r.fma(df, sv, a))
        return context.get_dummy_value()

    return _sig(a16, a8, row, off, xq, xo, xds, so), codegen


@intrinsic
def q4_k_block8(typingctx, a8, am, row, off, xb, xo, xsb, xp, s):
    """One 256-element Q4_K super-block on quantize_x_sb8's activations (the avx2 / int8
    decode path): per 32 weights one vpmaddubsw (nibbles x int8) and one vpmaddwd by the
    sub-block scale times 2^(6 - e) (<= 4032), summed in int32 lanes over the
    super-block; one convert and fma at its end. a8 lanes 0..7 collect the scaled dots,
    am lanes 0..7 the dmin m_j sx_j the caller subtracts. xsb[9 s .. 9 s + 8]: dx 2^-e
    sum(q) of each 32 elements, then dx / 64; xp[8 s .. 8 s + 8]: the 2^(6 - e).

    A super-block on q4_k_block's two-level int16 words is 16 vpmaddwd, the shifts and
    masks that make words of the nibbles, and per 64 weights two converts, two fmas and
    the scale broadcasts; here it is 8 vpmaddubsw on the nibble bytes, 8 vpmaddwd, one
    convert and one fma. Zen 3 EPYC, one thread, alternating with the
    two-level kernel in one process (`python benchmarks/kernel_ab.py --base <rev> --rows R
    --cols C --formats Q4_K -t 1`, medians of 15): 1536x1536 1.38x, 8960x1536 1.59x,
    1536x8960 1.43x; batches of 2 / 4 vectors 1.19-1.34x. The logits it costs,
    teacher-forced against float activations (`benchmarks/decode_quality.py`,
    `benchmarks/results/decode_quality_avx2.txt`): Qwen2.5-1.5B top-1 100%, KL 2.4e-4,
    NLL unchanged; Gemma 3 270M top-1 99.5%, KL 5.4e-4 (one scale per 256 without the
    powers of two, llama.cpp's q8_K: 97.8%, KL 2.1e-3)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        off, xo = args[3], args[5]
        _prefetch_ahead(r, off, 144)
        dm, sc8, mn8 = q4k_scale_bytes(r, 2, off)
        d = b.extract_element(dm, ir.Constant(I32, 0))
        dmin = b.extract_element(dm, ir.Constant(I32, 1))
        so = b.mul(args[8], ir.Constant(args[8].type, 9))
        sx = r.load(6, so, V8F)
        dx = r.load(6, so, F32, 8)
        mterm = b.fmul(b.fmul(r.splat(dmin, 8), b.uitofp(mn8, V8F)), sx)
        _acc_add(r, 1, V8F, lambda a: b.fadd(a, mterm))
        pw = r.load(7, b.mul(args[8], ir.Constant(args[8].type, 8)), _v(I16, 8))
        sc = b.mul(b.zext(sc8, _v(I16, 8)), pw)  # sc_j 2^(6 - e_j) <= 4032
        acc = None
        for g in range(4):
            for k, q in enumerate(q4k_nibbles(r, 2, off, g)):  # sub-block 2g + k
                xv = r.load(4, b.add(xo, ir.Constant(xo.type, 64 * g + 32 * k)), V32I8)
                dot = r.madd16(r.maddubs(q, xv), r.shuf(sc, sc, [2 * g + k] * 16))
                acc = dot if acc is None else b.add(acc, dot)
        df = b.sitofp(acc, V8F)
        sv = r.splat(b.fmul(d, dx), 8)
        _acc_add(r, 0, V8F, lambda a: r.fma(df, sv, a))
        return context.get_dummy_value()

    return types.void(a8, am, row, off, xb, xo, xsb, xp, s), codegen


# Software prefetch distance of the matvec block intrinsics, in bytes of the weight row.
# Rows of 8960 columns (the 1.5B's down projection: 5 KB a row, 22 KB of activations)
# streamed at ~17 GB/s against ~36 for its 1536-column gate and up: with the activations
# filling L1, the hardware prefetchers keep too few weight lines in flight. Fetching each
# block's lines ahead measured (Zen 5 EPYC, 2 threads, alternating in one process):
# - 2 KB: the 1.5B's 14 Q4_K down matrices 16-18 -> 26-28 GB/s, its Q6_K ones 31 -> 37,
#   the 1536-column gate 35 -> 37; decode 27.5 -> 31.4 tok/s (1.14x; 1 thread 1.03x),
#   Qwen2.5-0.5B 1.08x, SmolLM2 1.08x, Gemma 3 270M 1.04x;
# - 1, 2, 4, 8, 12, 16 KB on the 1.5B's down: Q4_K 21, 26.5, 30-35, 33-39, 39.5, 38.6
#   GB/s, Q6_K (2-16 KB) 28, 37, 42, 44, 46; its gate and Qwen2.5-0.5B's flat within
#   noise. 8 KB against 2 KB in decode: 1.5B 1.06x, 0.5B 1.05x, Gemma 1.07x, SmolLM2
#   0.95-1.04x (noise).
# - Intel Xeon (KVM, 2 vCPUs, DRAM ~20 GB/s), whole decode steps alternating in one
#   process between kernels built at each distance (ms per token, medians): the 1.5B
#   68.2 / 57.0 / 59.2 at 8 / 16 / 32 KB, and 59.7 / 57.8 / 59.2 / 59.7 at 12 / 16 /
#   20 / 24 KB; Qwen2.5-0.5B 25.0 -> 22.9 (8 -> 16 KB), SmolLM2 5.59 -> 5.72 and Gemma
#   22.7 -> 22.6 (noise). So 16 KB.
PREFETCH_BYTES = 16384
# the intrinsic's name carries its pointer type: opaque from LLVM 17, typed before
_PREFETCH = "llvm.prefetch.p0" if llvm_version_info >= (17,) else "llvm.prefetch.p0i8"


def _prefetch_ahead(r, off, nbytes):
    """Prefetch (for reading, into all cache levels) the lines of the nbytes at row byte
    off + PREFETCH_BYTES. A prefetch never faults, so past the array's end is harmless."""
    b = r.b
    f = r.fn(_PREFETCH, ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    p = r.ptr(2, off, I8)
    for k in range(0, nbytes, 64):
        q = b.gep(p, [ir.Constant(I64, PREFETCH_BYTES + k)])
        b.call(f, [q, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _q4k_scales(r, off):
    """A Q4_K super-block's 8 sub-block scales and mins, as floats already multiplied by
    d and dmin: (d sc_j, dmin m_j), <8 x float> each."""
    b = r.b
    dm, sc8, mn8 = q4k_scale_bytes(r, 2, off)
    sc = b.uitofp(sc8, V8F)
    mn = b.uitofp(mn8, V8F)
    d = b.extract_element(dm, ir.Constant(I32, 0))
    dmin = b.extract_element(dm, ir.Constant(I32, 1))
    return b.fmul(r.splat(d, 8), sc), b.fmul(r.splat(dmin, 8), mn)


def q6k_group_sums(r, dots):
    """The 4 dots of a Q6_K super-block (<16 x i32> each, 64 weights, lane j: weights
    4j .. 4j + 3) -> <16 x i32> of the sums of each 4 consecutive lanes (one 16-weight
    scale group), scale Q6K_SUM_ORDER[l] in lane l: two rounds of lane-pair shuffles and
    adds, the order they leave the sums in."""
    b = r.b
    add = b.add
    l1 = [
        add(r.shuf(d, d, [0, 8, 2, 10, 4, 12, 6, 14]), r.shuf(d, d, [1, 9, 3, 11, 5, 13, 7, 15]))
        for d in dots
    ]
    lo, hi = (
        add(r.shuf(a, c, [0, 1, 8, 9, 4, 5, 12, 13]), r.shuf(a, c, [2, 3, 10, 11, 6, 7, 14, 15]))
        for a, c in ((l1[0], l1[1]), (l1[2], l1[3]))
    )
    return r.concat(lo, hi)


Q6K_SUM_ORDER = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def q4k_scale_bytes(r, i, off):
    """The Q4_K super-block at byte off of array arg i -> ([d, dmin] <2 x float>, its 8
    6-bit sub-block scales and its 8 mins as <8 x i8>)."""
    b = r.b
    dm = r.f16x(i, off, 2)  # [d, dmin]
    s = r.load(i, off, V16I8, 4)  # 12 scale bytes (+4 ignored)
    A = r.shuf(s, s, [0, 1, 2, 3])
    B = r.shuf(s, s, [4, 5, 6, 7])
    C = r.shuf(s, s, [8, 9, 10, 11])
    c63, c15 = ir.Constant(_v(I8, 4), [63] * 4), ir.Constant(_v(I8, 4), [15] * 4)
    c6, c4 = ir.Constant(_v(I8, 4), [6] * 4), ir.Constant(_v(I8, 4), [4] * 4)
    sc_lo = b.and_(A, c63)
    sc_hi = b.or_(b.and_(C, c15), b.shl(b.lshr(A, c6), c4))
    mn_lo = b.and_(B, c63)
    mn_hi = b.or_(b.lshr(C, c4), b.shl(b.lshr(B, c6), c4))
    return dm, r.concat(sc_lo, sc_hi), r.concat(mn_lo, mn_hi)


def q4k_nibbles(r, i, off, g):
    """Of the Q4_K super-block at byte off of array arg i, sub-blocks 2g and 2g + 1 as
    <32 x u8> each: the low and the high nibbles of its 32 quant bytes at 16 + 32 g."""
    q = r.load(i, off, V32I8, 16 + 32 * g)
    return r.b.and_(q, r.splat_i8(32, 15)), r.b.lshr(q, r.splat_i8(32, 4))


def _q4k_chunk(r, off, g):
    """Weights 64 g .. 64 g + 63 of a Q4_K super-block (arg 2) as <64 x u8>."""
    return r.concat(*q4k_nibbles(r, 2, off, g))


def _q6k_super_scale(r, off):
    """Prefetch ahead of the Q6_K super-block at byte off of the row (arg 2) and return
    its scale d (the f16 at byte 208) as a float."""
    _prefetch_ahead(r, off, 210)
    return r.f16(2, off, 208)


@intrinsic
def q6_k_block(typingctx, a16, a8, row, off, xq, xo, xds, so, xs16, so16):
    """One 256-element Q6_K super-block. xs16[so16 + k] = dx * sum(q_x) over the k-th 16
    elements; a8 (an acc16 pointer, lanes 0..3 used) collects d*sc*xs16 for the -32 bias."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        off, xo, so = args[3], args[5], args[7]
        d = _q6k_super_scale(r, off)
        if Q6K_GROUP_SUMS:
            dsc = q6k_scales(r, off, d)
            bias = b.fmul(dsc, r.load(8, args[9], V16F))
            _acc_add(r, 1, V16F, lambda a: b.fadd(a, bias))
            dx = r.load(6, so, V16F)  # [dx_0, sx_0, ..., dx_7, sx_7]
            sv = b.fmul(r.shuf(dsc, dsc, Q6K_SUM_ORDER), r.shuf(dx, dx, Q6K_DX_ORDER))
            dots = [
                r.dpx(w, 4, b.add(xo, ir.Constant(xo.type, 128 * c)), 64)
                for c, w in enumerate(q6k_chunks(r, off))
            ]
            df = b.sitofp(q6k_group_sums(r, dots), V16F)
            _acc_add(r, 0, V16F, lambda a: r.fma(df, sv, a))
            return context.get_dummy_value()
        dv4 = r.splat(d, 4)
        for h in range(2):
            ql = r.load(2, off, V64I8, 64 * h)
            qh = r.load(2, off, V32I8, 128 + 32 * h)
            for p in range(2):
                w = _q6k_chunk(r, ql, qh, p)
                xoff = b.add(xo, ir.Constant(xo.type, 256 * h + 128 * p))
                dot = r.dpx(w, 4, xoff, 64)
                k = 8 * h + 4 * p  # first of 4 scales (16 elements each)
                sc = b.sitofp(r.load(2, off, _v(I8, 4), 192 + k), V4F)
                dsc = b.fmul(dv4, sc)
                # dx of the two 32-blocks: xds[so + 2*(4h + 2p)], xds[so + 2*(4h + 2p + 1)]
                blk = 4 * h + 2 * p
                xd4 = r.load(6, b.add(so, ir.Constant(so.type, 2 * blk)), V4F)
                dxv = r.shuf(xd4, xd4, [0, 0, 2, 2])
                sv4 = b.fmul(dsc, dxv)
                sv = r.shuf(sv4, sv4, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)
                df = b.sitofp(dot, V16F)
                _acc_add(r, 0, V16F, lambda a, df=df, sv=sv: r.fma(df, sv, a))
                x16 = r.load(8, b.add(args[9], ir.Constant(args[9].type, k)), V4F)
                bias = b.fmul(dsc, x16)
                bias8 = r.shuf(bias, ir.Constant(V4F, [0.0] * 4), range(8))
                _acc_add(r, 1, V8F, lambda a, bias8=bias8: b.fadd(a, bias8))
        return context.get_dummy_value()

    return types.void(a16, a8, row, off, xq, xo, xds, so, xs16, so16), codegen


@intrinsic
def q6_k_block8(typingctx, a8, am, row, off, xb, xo, xsb, xp, s, bs):
    """One 256-element Q6_K super-block on quantize_x_sb8's activations (the avx2 / int8
    decode path, Q6K_SB8), as q4_k_block8: per 32 weights one vpmaddubsw (6-bit weights
    0..63 x int8, pair sums <= 16002) and one vpmaddwd by the two 16-element sub-block
    scales times 2^(6 - e) (|sc 2^(6-e)| <= 8192), summed in int32 lanes over the
    super-block (<= 8 x 262M); one convert and FMA at its end. The -32 offset: am
    collects 32 d dx/64 sum_j sc_j 2^(6 - e) bs_j, one vpmaddwd of the scales with the
    per-16 sums of q (bs int16 [16 s ..], sums16_sb8), which the caller subtracts.
    xsb, xp as q4_k_block8's."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        off, xo, s_ = args[3], args[5], args[8]
        d = _q6k_super_scale(r, off)
        V16I16 = _v(I16, 16)
        sc16 = b.sext(r.load(2, off, V16I8, 192), V16I16)
        pw8 = r.load(7, b.mul(s_, ir.Constant(s_.type, 8)), _v(I16, 8))
        scp = b.mul(sc16, r.shuf(pw8, pw8, [i // 2 for i in range(16)]))
        acc = None
        for c, w in enumerate(q6k_chunks(r, off)):
            for k in range(2):
                j = 2 * c + k  # 32-element block of the super-block
                w32 = r.shuf(w, w, range(32 * k, 32 * k + 32))
                x32 = r.load(4, b.add(xo, ir.Constant(xo.type, 32 * j)), V32I8)
                sv = r.shuf(scp, scp, [2 * j] * 8 + [2 * j + 1] * 8)
                dot = r.madd16(r.maddubs(w32, x32), sv)
                acc = dot if acc is None else b.add(acc, dot)
        bsum = r.madd16(scp, r.load(9, b.mul(s_, ir.Constant(s_.type, 16)), V16I16))
        so = b.add(b.mul(s_, ir.Constant(s_.type, 9)), ir.Constant(s_.type, 8))
        sv = r.splat(b.fmul(d, r.load(6, so, F32)), 8)  # d dx / 64
        df = b.sitofp(acc, V8F)
        _acc_add(r, 0, V8F, lambda a: r.fma(df, sv, a))
        bf = b.fmul(b.sitofp(bsum, V8F), ir.Constant(V8F, [32.0] * 8))
        _acc_add(r, 1, V8F, lambda a: r.fma(bf, sv, a))
        return context.get_dummy_value()

    return types.void(a8, am, row, off, xb, xo, xsb, xp, s, bs), codegen


# Q6_K on AVX2 / generic int8: each 16-weight scale group's dot lanes summed in integers
# (shuffles and adds), then one 16-lane conversion and FMA a super-block and one bias
# multiply, instead of four of each plus their scale shuffles. Zen 3, one thread, the
# two versions alternating in one process (medians of 15): 1536 x 1536 1.11x, 256 x 1536
# 1.12x, 4 vectors batched 1.16-1.21x. The same for Q4_K (8 sub-block sums) measured
# 0.95-1.19x single and 0.88-1.0x batched, so Q4_K keeps scaling lanes in float; so did
# llvm.x86.avx2.phadd.d for the sums (slower than the shuffles) and integer multiplies
# by the scales.
Q6K_GROUP_SUMS = DOT != "vnni"
# Q6_K decode off the vnni path on quantize_x_sb8's single-level activations (q6_k_block8),
# as Q4_K's (SB8_DECODE). Zen 3, one thread, against the two-level kernel with the group
# sums above: 1536x8960 1.40x, 8960x1536 1.35x, 1536x1536 1.40x (a prototype's run).
Q6K_SB8 = DOT != "vnni"
Q6K_DX_ORDER = tuple(2 * (s // 2) for s in Q6K_SUM_ORDER)  # dx of scale s: xds[2 (s // 2)]


def q6k_scales(r, off, d):
    """A Q6_K super-block's 16 scales times d, <16 x float> in natural order."""
    return r.b.fmul(r.splat(d, 16), r.b.sitofp(r.load(2, off, V16I8, 192), V16F))


def q6k_chunks(r, off):
    """The super-block's 4 chunks of 64 weights (u8 0..63) in element order."""
    out = []
    for h in range(2):
        ql = r.load(2, off, V64I8, 64 * h)
        qh = r.load(2, off, V32I8, 128 + 32 * h)
        out += [_q6k_chunk(r, ql, qh, p) for p in range(2)]
    return out


def _q6k_chunk(r, ql, qh, p):
    """Of one half of a Q6_K super-block (ql: its 64 low-nibble bytes, qh: its 32
    high-bit bytes), the 6-bit weights of 32-element chunks 2p and 2p + 1 as u8 0..63."""
    b = r.b
    if p == 0:
        lo = b.and_(ql, r.splat_i8(64, 15))
        qhv = r.concat(qh, b.lshr(qh, r.splat_i8(32, 2)))
    else:
        lo = b.lshr(ql, r.splat_i8(64, 4))
        qhv = r.concat(b.lshr(qh, r.splat_i8(32, 4)), b.lshr(qh, r.splat_i8(32, 6)))
    qhv = b.shl(b.and_(qhv, r.splat_i8(64, 3)), r.splat_i8(64, 4))
    return b.or_(lo, qhv)


def _lowbit_bytes(r, off, bits):
    """edgerun's Q2_G64 / Q3_G64 block at byte off of arg 2 -> its 64 values as
    <64 x i8> in element order (element 16 s + l: bits 2s..2s+1 of ql[l], for 3 bits
    | bit 2s + (l >> 3) of qh[l & 7] as bit 2; edgerun.quant.lowbit)."""
    b = r.b
    ql = r.load(2, off, V16I8, 4)
    if bits == 3:
        qh = r.load(2, off, _v(I8, 8), 20)
        h16 = r.concat(qh, b.lshr(qh, r.splat_i8(8, 1)))  # lane l: qh[l & 7] >> (l >> 3)
    parts = []
    for s_ in range(4):
        p = b.and_(b.lshr(ql, r.splat_i8(16, 2 * s_)) if s_ else ql, r.splat_i8(16, 3))
        if bits == 3:  # bit 2s of h16 -> bit 2
            h = {0: b.shl(h16, r.splat_i8(16, 2)), 1: h16}.get(s_)
            if h is None:
                h = b.lshr(h16, r.splat_i8(16, 2 * s_ - 2))
            p = b.or_(p, b.and_(h, r.splat_i8(16, 4)))
        parts.append(p)
    return r.concat(r.concat(parts[0], parts[1]), r.concat(parts[2], parts[3]))


def _unpack_g64(bits):
    def unpack(r, off):
        """One 64-element block (x = d q + m): as a Q4_1 pair of two 32-element x blocks
        sharing d and m."""
        dm = r.f16x(2, off, 2)  # [d, m]
        lanes = _SV_SHARED  # one dx per 64 (quantize_x1)
        return _lowbit_bytes(r, off, bits), r.shuf(dm, dm, [0, 1, 0, 1]), lanes

    return unpack


def _lowbit_block(bits):
    nbytes = 20 if bits == 2 else 28
    return _pair_intrinsic(_unpack_g64(bits), f"q{bits}_g64_block", nbytes, x1=True)


q2_g64_block = _lowbit_block(2)
q3_g64_block = _lowbit_block(3)


# ------------------------------------------------------------------ x quantization
@intrinsic
def amax32(typingctx, x, xo):
    """max |x[xo:xo+32]| (float32 array x)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        fabs = r.fn("llvm.fabs.v16f32", V16F, [V16F])
        a = b.call(fabs, [r.load(0, args[1], V16F)])
        c = b.call(fabs, [r.load(0, args[1], V16F, 16)])
        v = b.select(b.fcmp_ordered(">", a, c), a, c)
        n = 16
        while n > 1:
            h = n // 2
            lo = r.shuf(v, v, range(h))
            hi = r.shuf(v, v, range(h, n))
            v = b.select(b.fcmp_ordered(">", lo, hi), lo, hi)
            n = h
        return b.extract_element(v, ir.Constant(I32, 0))

    return types.float32(x, xo), codegen


@intrinsic
def qhalf(typingctx, x, xo, xq, o1, o2, d, inv, inv2):
    """16 elements x[xo:xo+16] -> q1 = rint(x * inv) at xq[o1:], q2 = rint((x - q1 * d)
    * inv2) at xq[o2:] (int8); returns sum(128 * q1 + q2) (int32)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        rint = r.fn("llvm.rint.v16f32", V16F, [V16F])
        v = r.load(0, args[1], V16F)
        dv, iv, i2 = (r.splat(args[k], 16) for k in (5, 6, 7))
        a = b.call(rint, [b.fmul(v, iv)])
        c = b.call(rint, [b.fmul(b.fsub(v, b.fmul(a, dv)), i2)])
        qa = b.fptosi(a, V16I32)
        qc = b.fptosi(c, V16I32)
        _store(r, 2, args[3], b.trunc(qa, _v(I8, 16)))
        _store(r, 2, args[4], b.trunc(qc, _v(I8, 16)))
        t = b.add(b.shl(qa, ir.Constant(V16I32, [7] * 16)), qc)
        red = r.fn("llvm.vector.reduce.add.v16i32", I32, [V16I32])
        return b.sext(b.call(red, [t]), I64)

    return types.int64(x, xo, xq, o1, o2, d, inv, inv2), codegen


@njit(cache=True, nogil=True)
def quantize_x(x, nib2, xq, xds, xs16):
    """Two-level int8 activations: x ~= (128 * q1 + q2) * dx / 128 per block of 32, with
    q1 = rint(x / dx), dx = max|x| / 127, and q2 = rint((x - q1 dx) * 128 / dx) the
    rounded residual (|q2| <= 64). Kernels compute 128 * dot(w, q1) + dot(w, q2) exactly
    in int32, so the only approximation left is ~2^-15 of max|x| per block: the result
    matches float32 kernels to ~1e-5 instead of the ~1e-2 of plain int8.

    x float32 [cols] -> xq int8 [2 * cols], in chunks of 64 elements: [q1 (64 B) | q2
    (64 B)] (an odd last block of 32: [q1 (32 B) | q2 (32 B)]); inside a chunk natural
    order, or with nib2 the pair order [a0:16, b0:16, a16:32, b16:32].
    xds float32 [2 * nb]: [dx', dx' * sum(128 q1 + q2)] per block (dx' = dx / 128);
    xs16 float32 [cols // 16]: dx' * sum(128 q1 + q2) per 16 elements.
    """
    nb = x.shape[0] // 32
    for b in range(nb):
        amax = amax32(x, b * 32)
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != F0 else F0
        inv2 = inv * np.float32(128.0)
        full = (b // 2) * 2 + 1 < nb  # block b is in a full 64-element chunk
        if full:
            q1o = (b // 2) * 128
            q2o = q1o + 64
        else:
            q1o = b * 64
            q2o = q1o + 32
        if full and nib2:
            o0 = (b & 1) * 16
            o1 = o0 + 32
        elif full:
            o0 = (b & 1) * 32
            o1 = o0 + 16
        else:
            o0 = 0
            o1 = 16
        s0 = qhalf(x, b * 32, xq, q1o + o0, q2o + o0, d, inv, inv2)
        s1 = qhalf(x, b * 32 + 16, xq, q1o + o1, q2o + o1, d, inv, inv2)
        d2 = d / np.float32(128.0)
        xds[2 * b] = d2
        xds[2 * b + 1] = d2 * np.float32(s0 + s1)
        xs16[2 * b] = d2 * np.float32(s0)
        xs16[2 * b + 1] = d2 * np.float32(s1)
    if DOT != "vnni":
        _to_words(xq, nb)


def _q8_codegen(r, n, xo, bo, inv):
    """rint(x[xo:xo+n] * inv) as int8 at xb[bo:bo+n] (args 0 and 2); their sum (int64)."""
    b = r.b
    VF, VI = _v(F32, n), _v(I32, n)
    rint = r.fn(f"llvm.rint.v{n}f32", VF, [VF])
    q = b.fptosi(b.call(rint, [b.fmul(r.load(0, xo, VF), r.splat(inv, n))]), VI)
    _store(r, 2, bo, b.trunc(q, _v(I8, n)))
    red = r.fn(f"llvm.vector.reduce.add.v{n}i32", I32, [VI])
    return b.sext(b.call(red, [q]), I64)


@intrinsic
def q8_32(typingctx, x, xo, xb, inv):
    """32 elements x[xo:xo+32] -> rint(x * inv) as int8 at xb[xo:xo+32]; returns their
    sum (int64)."""

    def codegen(context, builder, sig, args):
        return _q8_codegen(_IR(context, builder, sig, args), 32, args[1], args[1], args[3])

    return types.int64(x, xo, xb, inv), codegen


@intrinsic
def q8_16(typingctx, x, xo, xb, bo, inv):
    """16 elements x[xo:xo+16] -> rint(x * inv) as int8 at xb[bo:bo+16]; their sum."""

    def codegen(context, builder, sig, args):
        return _q8_codegen(_IR(context, builder, sig, args), 16, args[1], args[3], args[4])

    return types.int64(x, xo, xb, bo, inv), codegen


@njit(cache=True, nogil=True)
def quantize_x1(x, nib2, xq, xds, span):
    """Single-level int8 activations of X1's formats (Q5_0, Q3_G64, Q2_G64):
    per span of 32 or 64 elements, q = rint(x / dx) with dx = max|x| / 127 (span 32:
    llama.cpp's q8_0, for Q5_0; 64: the G64 formats, whose 64 weights share d and m, so
    the kernel adds the block's two halves in int16 before one vpmaddwd, conversion and
    FMA), one byte per element in quantize_x's block order: chunks of 64 elements,
    natural or with nib2 [x_a[0:16], x_b[0:16], x_a[16:32], x_b[16:32]], an odd last
    block natural. xds float32 [2 nb]: [dx, dx sum(q)] per block of 32 (quantize_x's
    meaning; the two blocks of a 64-span carry the same dx)."""
    nb = x.shape[0] // 32
    per = span // 32  # blocks of 32 sharing a scale
    for b0 in range(0, nb, per):
        b1 = min(b0 + per, nb)
        amax = amax32(x, b0 * 32)
        for b in range(b0 + 1, b1):
            amax = max(amax, amax32(x, b * 32))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != F0 else F0
        for b in range(b0, b1):
            o0 = b * 32
            o1 = o0 + 16
            if nib2 and (b // 2) * 2 + 1 < nb:  # block b is in a full 64-element chunk
                o0 = (b // 2) * 64 + (b & 1) * 16
                o1 = o0 + 32
            s = q8_16(x, b * 32, xq, o0, inv) + q8_16(x, b * 32 + 16, xq, o1, inv)
            xds[2 * b] = d
            xds[2 * b + 1] = d * np.float32(s)


@njit(inline="always")
def quantize_xn(x, x1, nib2, xq, xds, xs16):
    """The activations of a format's kernels: quantize_x1 with scales per x1 elements
    for the formats of X1 (x1: 32 for Q5_0, 64 for the G64 formats, x1_span), else
    (x1 = 0) quantize_x."""
    if x1:
        quantize_x1(x, nib2, xq, xds, x1)
    else:
        quantize_x(x, nib2, xq, xds, xs16)


SB8_EMAX = 6  # most halvings of a 32-element block's scale (quantize_x_sb8)


@njit(cache=True, nogil=True)
def quantize_x_sb8(x, xb, xsb, xp):
    """Single-level int8 activations for q4_k_block8, in element order in xb int8 [cols]:
    one scale dx = max|x| / 127 per 256-element super-block, refined per 32 elements by
    a power of two, q = rint(x 2^e / dx) with e (0..SB8_EMAX) the largest that keeps
    |q| <= 127. The kernel folds 2^(6 - e) into the sub-block scales it multiplies with
    (vpmaddwd), so the refinement costs one int16 multiply a super-block, and a block of
    small values beside an outlier keeps up to 6 more bits than one scale per 256
    (llama.cpp's q8_K) leaves it. xp int16 [8 * cols // 256]: 2^(6 - e) of each 32;
    xsb float32 [9 * cols // 256]: per super-block dx 2^-e sum(q) of each 32 elements,
    then dx / 64."""
    a32 = np.empty(8, np.float32)  # one allocation a call, not one a super-block
    for s in range(x.shape[0] // 256):
        amax = F0
        for j in range(8):
            a32[j] = amax32(x, s * 256 + 32 * j)
            amax = max(amax, a32[j])
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != F0 else F0
        for j in range(8):
            e = 0
            while e < SB8_EMAX and a32[j] * np.float32(2 ** (e + 1)) <= amax:
                e += 1
            f = np.float32(2**e)
            xp[8 * s + j] = np.int16(2 ** (SB8_EMAX - e))
            xsb[9 * s + j] = d / f * np.float32(q8_32(x, s * 256 + 32 * j, xb, inv * f))
        xsb[9 * s + 8] = d / np.float32(2**SB8_EMAX)


@njit(inline="always")
def _region_to_words(xq, base, n):
    """One [q1 (n B) | q2 (n B)] region of xq -> n int16 words 128 q1 + q2, per 32
    positions the 16 even ones then the 16 odd ones (dpx's AVX2 order)."""
    v = np.empty(64, np.int16)
    for k in range(n):
        v[k] = np.int16(128) * np.int16(xq[base + k]) + np.int16(xq[base + n + k])
    for h in range(n // 32):
        for j in range(16):
            for par in range(2):
                w = v[32 * h + 2 * j + par]
                o = base + 64 * h + 32 * par + 2 * j
                xq[o] = np.int8(w & 0xFF)  # little endian: low byte first
                xq[o + 1] = np.int8(w >> 8)


@njit(inline="always")
def _to_words(xq, nb):
    """quantize_x's byte layout -> its word layout, region by region (full chunks of 64
    elements, and an odd last block of 32)."""
    for c in range(nb // 2):
        _region_to_words(xq, c * 128, 64)
    if nb & 1:
        _region_to_words(xq, (nb - 1) * 64, 32)


@njit(inline="always")
def _hsum(p, n):
    """Sum of the first n (16, 8 or 4) floats of an acc16/acc4 vector."""
    if n == 16:
        return hsum16(p)
    a = numba.carray(p, n)
    t = F0
    for i in range(n):
        t += a[i]
    return t


@njit(inline="always")
def _scratch(cols):
    nb = cols // 32
    return (
        np.empty(2 * cols, np.int8),
        np.empty(2 * nb, np.float32),
        np.empty(2 * nb, np.float32),
    )


@njit(inline="always")
def scratch_sb8(cols):
    """quantize_x_sb8's outputs for x of `cols` elements: (xb, xsb, xp), and sums16_sb8's
    (bs)."""
    n = cols // 256
    return (
        np.empty(cols, np.int8),
        np.empty(9 * n, np.float32),
        np.empty(8 * n, np.int16),
        np.empty(16 * n, np.int16),
    )


@njit(inline="always")
def quantize_k8(kind, x, xb, xsb, xp, bs):
    """x -> quantize_x_sb8's activations for a Q4_K / Q6_K kernel, and for Q6_K the
    sums per 16 its -32 offset takes (sums16_sb8 into bs)."""
    quantize_x_sb8(x, xb, xsb, xp)
    if kind == KIND_Q6_K:
        sums16_sb8(xb, bs)


@njit(inline="always")
def x_k8(kind, x):
    """x on quantize_x_sb8's activations for one Q4_K / Q6_K matvec: (xb, xsb, xp, bs),
    bs (sums16_sb8) filled for Q6_K only."""
    xb, xsb, xp, bs = scratch_sb8(x.shape[0])
    quantize_k8(kind, x, xb, xsb, xp, bs)
    return xb, xsb, xp, bs


@njit(cache=True, nogil=True)
def sums16_sb8(xb, bs):
    """The sums of each 16 of quantize_x_sb8's bytes (|sum| <= 2032) into bs int16, for
    q6_k_block8's -32 offset."""
    for i in range(bs.shape[0]):
        t = np.int32(0)
        for k in range(16):
            t += np.int32(xb[16 * i + k])
        bs[i] = np.int16(t)


# --------------------------------------------------------------------------- matvec
@njit(inline="always")
def _row_q4_1(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q4_1_pair(a16, a4, row, base + p * 40, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q4_1_single(a16, a4, row, base + b * 20, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


@njit(inline="always")
def _row_q4_0(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q4_0_pair(a16, a4, row, base + p * 36, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q4_0_single(a16, a4, row, base + b * 18, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(8.0) * (s[1] + s[3])


@njit(inline="always")
def _row_q5_0(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q5_0_pair(a16, a4, row, base + p * 44, xq, p * 64, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q5_0_single(a16, a4, row, base + b * 22, xq, b * 32, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(16.0) * (s[1] + s[3])


@njit(inline="always")
def _row_q8_0(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q8_0_pair(a16, a4, row, base + p * 68, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q8_0_single(a16, a4, row, base + b * 34, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(128.0) * (s[1] + s[3])


@njit(inline="always")
def _row_q4_k(row, base, nsb, xq, xds, xs16):
    a16 = acc16()
    am = acc16()
    for b in range(nsb):
        q4_k_block(a16, am, row, base + b * 144, xq, b * 512, xds, b * 16)
    return _hsum(a16, 16) - _hsum(am, 8)


@njit(inline="always")
def _k8_block(kind, a, m, row, off, xb, xo, xsb, xp, s, bs):
    """A K-quant super-block on quantize_x_sb8's activations (kind a literal)."""
    if kind == KIND_Q4_K:
        q4_k_block8(a, m, row, off, xb, xo, xsb, xp, s)
    else:
        q6_k_block8(a, m, row, off, xb, xo, xsb, xp, s, bs)


@njit(inline="always")
def _k8_bytes(kind):
    return 144 if kind == KIND_Q4_K else 210


@njit(inline="always")
def _row_k8(kind, row, base, nsb, xb, xsb, xp, bs):
    """One row of a Q4_K or Q6_K matrix on quantize_x_sb8's activations."""
    a = acc16()
    m = acc16()
    nbytes = _k8_bytes(kind)
    for s in range(nsb):
        _k8_block(kind, a, m, row, base + s * nbytes, xb, s * 256, xsb, xp, s, bs)
    return _hsum(a, 8) - _hsum(m, 8)


@njit(inline="always")
def _row_q6_k(row, base, nsb, xq, xds, xs16):
    a16 = acc16()
    ab = acc16()
    for b in range(nsb):
        q6_k_block(a16, ab, row, base + b * 210, xq, b * 512, xds, b * 16, xs16, b * 16)
    return _hsum(a16, 16) - np.float32(32.0) * _hsum(ab, 16 if Q6K_GROUP_SUMS else 4)


@njit(inline="always")
def _row_q2_g64(row, base, nblk, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for b in range(nblk):
        q2_g64_block(a16, a4, row, base + b * 20, xq, b * 64, xds, b * 4)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


@njit(inline="always")
def _row_q3_g64(row, base, nblk, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for b in range(nblk):
        q3_g64_block(a16, a4, row, base + b * 28, xq, b * 64, xds, b * 4)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


# Every matvec kernel takes up to three matrices that share x (Q/K/V, gate/up): one
# x quantization and one parallel launch for all of them; unused slots get 0-row arrays.


@njit(inline="always")
def _row_of(kind, row, base, n, xq, xds, xs16):
    """One row's dot on quantize_x's (or, for X1's formats, quantize_x1's) activations:
    kind is a constant at every call site, so the branch folds away."""
    if kind == KIND_Q4_1:
        return _row_q4_1(row, base, n, xq, xds, xs16)
    if kind == KIND_Q4_0:
        return _row_q4_0(row, base, n, xq, xds, xs16)
    if kind == KIND_Q5_0:
        return _row_q5_0(row, base, n, xq, xds, xs16)
    if kind == KIND_Q8_0:
        return _row_q8_0(row, base, n, xq, xds, xs16)
    if kind == KIND_Q4_K:
        return _row_q4_k(row, base, n, xq, xds, xs16)
    if kind == KIND_Q6_K:
        return _row_q6_k(row, base, n, xq, xds, xs16)
    if kind == KIND_Q2_G64:
        return _row_q2_g64(row, base, n, xq, xds, xs16)
    return _row_q3_g64(row, base, n, xq, xds, xs16)


@njit(inline="always")
def _set_row(i, o0, o1, o2, r, v):
    """Row r of the output that loop row i belongs to (_batch_row's) = v. The store names
    o0, o1, o2 themselves: a prange body that assigns into the array _batch_row returned
    loses the write (Numba 0.68's parfor pass, silently; a nested loop or a call hides it,
    as in _mvb)."""
    if i < o0.shape[0]:
        o0[r] = v
    elif i < o0.shape[0] + o1.shape[0]:
        o1[r] = v
    else:
        o2[r] = v


@njit(inline="always")
def _mv(kind, d0, d1, d2, x, o0, o1, o2):
    """o_k = W_k @ x for up to three matrices of one format (d0, d1, d2) on one quantized
    x (quantize_x, or quantize_x1 for X1's formats), their rows in one parallel loop."""
    cols = x.shape[0]
    unit, nib2 = row_layout(kind)
    n = cols // unit
    xq, xds, xs16 = _scratch(cols)
    quantize_xn(x, x1_span(kind), nib2, xq, xds, xs16)
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    for i in prange(d0.shape[0] + d1.shape[0] + d2.shape[0]):
        flat, base, _, r = _batch_row(i, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        _set_row(i, o0, o1, o2, r, _row_of(kind, flat, base, n, xq, xds, xs16))


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_1(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_Q4_1, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_0(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_Q4_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q5_0(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_Q5_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q8_0(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_Q8_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_k(d0, d1, d2, x, o0, o1, o2):
    if SB8_DECODE:
        _mv_k8(KIND_Q4_K, d0, d1, d2, x, o0, o1, o2)
        return
    _mv(KIND_Q4_K, d0, d1, d2, x, o0, o1, o2)


@njit(inline="always")
def _mv_k8(kind, d0, d1, d2, x, o0, o1, o2):
    """mv_q4_k / mv_q6_k on quantize_x_sb8's activations (SB8_DECODE, Q6K_SB8)."""
    cols = x.shape[0]
    n = cols // 256
    xb, xsb, xp, bs = x_k8(kind, x)
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    for i in prange(d0.shape[0] + d1.shape[0] + d2.shape[0]):
        flat, base, _, r = _batch_row(i, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        _set_row(i, o0, o1, o2, r, _row_k8(kind, flat, base, n, xb, xsb, xp, bs))


@njit(parallel=True, cache=True, nogil=True)
def mv_q6_k(d0, d1, d2, x, o0, o1, o2):
    if Q6K_SB8:
        _mv_k8(KIND_Q6_K, d0, d1, d2, x, o0, o1, o2)
        return
    _mv(KIND_Q6_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q2_g64(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_Q2_G64, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q3_g64(d0, d1, d2, x, o0, o1, o2):
    _mv(KIND_Q3_G64, d0, d1, d2, x, o0, o1, o2)


# --------------------------------------------------------------- batched decode blocks
# A batch of G decode vectors runs each block intrinsic once per vector with that
# vector's activations, scales and accumulators: the same IR, so every vector gets the
# single kernel's float operations (bit-identical rows). The G copies load and unpack the
# same weight bytes, and LLVM merges them (the accumulators are registers, nothing
# stores in between): each block is unpacked once for all vectors. Block pairs (and
# the G64 blocks) go further (_pair_batch): one unpack, and the scale products and bias
# sums of all the vectors in one vector operation each.
KIND_Q8_0, KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q4_K, KIND_Q6_K = 3, 4, 5, 6, 7, 8
KIND_Q3_G64, KIND_Q2_G64 = 9, 10  # edgerun's own formats (edgerun.quant.lowbit)
_ACC = 32  # floats of accumulator per vector (acc16 + a second acc16)


@intrinsic
def acc_vectors(typingctx, g):
    """Pointer to g * (_ACC + 8) zeroed float32 on the stack: g vectors' accumulators,
    then the bias lanes of batched blocks (up to 8 per vector, _bias_lanes)."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    n = 1 << (g.literal_value * (_ACC + 8) - 1).bit_length()  # a power of two: SROA
    vt = _v(F32, n)

    def codegen(context, builder, sig, args):
        p = cgutils.alloca_once(builder, vt)
        builder.store(ir.Constant(vt, [0.0] * n), p)
        return builder.bitcast(p, F32.as_pointer())

    return types.CPointer(types.float32)(g), codegen


def _i64(builder, v):
    return v if v.type == I64 else builder.sext(v, I64)


def _block_of(kind, part):
    """The single-vector block intrinsic of a non-K format: part 0 its pair, 1 its odd
    last block (the 64-element low-bit formats have none: part 1 is typed in a branch
    that never runs)."""
    table = {
        KIND_Q4_1: (q4_1_pair, q4_1_single),
        KIND_Q4_0: (q4_0_pair, q4_0_single),
        KIND_Q5_0: (q5_0_pair, q5_0_single),
        KIND_Q8_0: (q8_0_pair, q8_0_single),
        KIND_Q2_G64: (q2_g64_block, q2_g64_block),
        KIND_Q3_G64: (q3_g64_block, q3_g64_block),
    }
    return table[kind][part]


_PAIR_UNPACK = {  # the pair intrinsics, whose unpack and nbytes _pair_batch uses
    KIND_Q4_1: q4_1_pair,
    KIND_Q4_0: q4_0_pair,
    KIND_Q5_0: q5_0_pair,
    KIND_Q8_0: q8_0_pair,
    KIND_Q2_G64: q2_g64_block,
    KIND_Q3_G64: q3_g64_block,
}


_K_KINDS = (KIND_Q4_K, KIND_Q6_K)
_X1_KINDS = (KIND_Q5_0, KIND_Q3_G64, KIND_Q2_G64)  # X1's formats


@njit(inline="always")
def x1_span(kind):
    """Elements per activation scale of X1's formats (_X1_KINDS; quantize_x1's span), 0
    for the others."""
    if kind == KIND_Q5_0:
        return 32
    return 64 if kind == KIND_Q3_G64 or kind == KIND_Q2_G64 else 0


@njit(inline="always")
def x1_kind(kind):
    """Whether a format is one of X1's: its x is quantize_xn's single level."""
    return x1_span(kind) != 0


@njit(inline="always")
def x_bytes(kind):
    """Bytes of one vector's activations per element for a format's kernels."""
    return 1 if x1_kind(kind) else 2


def _pairs_batched(kind: int, g: int) -> bool:
    """Whether a g-vector pass runs the format's block pairs through _pair_batch (block_g
    and vector_results must agree on where the bias lanes are)."""
    return kind in _PAIR_UNPACK and g >= 2


def _bias_lanes(kind: int) -> int:
    """Bias lanes per vector after a batch's accumulators (Q4_K: its 8 mins terms)."""
    return 8 if kind == KIND_Q4_K else 4


def _bias_add(r, g, vals):
    """The bias lanes after g vectors' accumulators (r.args[0]) += vals."""
    b = r.b
    p = b.bitcast(b.gep(r.args[0], [ir.Constant(I64, _ACC * g)]), vals.type.as_pointer())
    b.store(b.fadd(b.load(p), vals), p)


def _acc_fma(r, v, df, sv):
    """Vector v's acc16 (its first df.type.count lanes) += df * sv."""
    b = r.b
    vt = df.type
    a = b.bitcast(b.gep(r.args[0], [ir.Constant(I64, _ACC * v)]), vt.as_pointer())
    b.store(r.fma(df, sv, b.load(a)), a)


def _x_at(r, xstride, v, extra):
    """Byte offset of vector v's activations + extra (r.args[5]: vector 0's)."""
    b = r.b
    return b.add(r.args[5], b.add(b.mul(xstride, ir.Constant(I64, v)), ir.Constant(I64, extra)))


def _q4k_batch(r, g, xstride):
    """One Q4_K super-block for g vectors (args as _pair_batch; aux at soi: the g
    vectors' 8 dx, then at soi + 32 their 8 sx, _mvb). Scales and mins are unpacked
    once; d sc dx of all vectors is one 8g-lane multiply and their mins terms one
    multiply and add into the bias lanes. Per vector: the 4 dots, conversions, lane
    shuffles and FMAs. The same products and sums per lane as q4_k_block."""
    b = r.b
    off = r.args[3]
    _prefetch_ahead(r, off, 144)
    dsc, dmn = _q4k_scales(r, off)
    n = 8 * g
    lanes = list(range(8)) * g
    ds = b.fmul(r.shuf(dsc, dsc, lanes), r.load(8, r.args[9], _v(F32, n)))
    _bias_add(r, g, b.fmul(r.shuf(dmn, dmn, lanes), r.load(8, r.args[9], _v(F32, n), 32)))
    for c in range(4):
        w = _q4k_chunk(r, off, c)
        for v in range(g):
            df = b.sitofp(r.dpx(w, 4, _x_at(r, xstride, v, 128 * c), 64), V16F)
            _acc_fma(r, v, df, r.shuf(ds, ds, [8 * v + 2 * c] * 8 + [8 * v + 2 * c + 1] * 8))


def _q6k_batch(r, g, xstride):
    """One Q6_K super-block for g vectors (args as _pair_batch; aux at soi + 32 c for
    chunk pair c: the g vectors' [dx_a, dx_a, dx_b, dx_b], then at + 16 their four
    16-element sums, _mvb). Per chunk pair one 4g-lane multiply gives every vector's
    scales and one multiply and add its -32 bias terms; per vector the dot, its
    conversion, a lane shuffle and the FMA. The same products and sums per lane as
    q6_k_block."""
    b = r.b
    off = r.args[3]
    _prefetch_ahead(r, off, 210)
    if Q6K_GROUP_SUMS:  # aux per vector at soi + 32 v: its dx in sum order, its 16 sums
        dsc = q6k_scales(r, off, r.f16(2, off, 208))
        dscp = r.shuf(dsc, dsc, Q6K_SUM_ORDER)
        chunks = q6k_chunks(r, off)
        for v in range(g):
            at = b.add(r.args[9], ir.Constant(I64, 32 * v))
            bias = b.fmul(dsc, r.load(8, at, V16F, 16))
            t = b.bitcast(b.gep(r.args[0], [ir.Constant(I64, _ACC * v + 16)]), V16F.as_pointer())
            b.store(b.fadd(b.load(t), bias), t)
            sv = b.fmul(dscp, r.load(8, at, V16F))
            dots = [r.dpx(w, 4, _x_at(r, xstride, v, 128 * c), 64) for c, w in enumerate(chunks)]
            _acc_fma(r, v, b.sitofp(q6k_group_sums(r, dots), V16F), sv)
        return
    dv4 = r.splat(r.f16(2, off, 208), 4)
    n = 4 * g
    for h in range(2):
        ql = r.load(2, off, V64I8, 64 * h)
        qh = r.load(2, off, V32I8, 128 + 32 * h)
        for p in range(2):
            w = _q6k_chunk(r, ql, qh, p)
            k, c = 8 * h + 4 * p, 2 * h + p
            dsc = b.fmul(dv4, b.sitofp(r.load(2, off, _v(I8, 4), 192 + k), V4F))
            dsc = r.shuf(dsc, dsc, [0, 1, 2, 3] * g)
            sv4 = b.fmul(dsc, r.load(8, r.args[9], _v(F32, n), 32 * c))
            _bias_add(r, g, b.fmul(dsc, r.load(8, r.args[9], _v(F32, n), 32 * c + 16)))
            for v in range(g):
                xo = _x_at(r, xstride, v, 256 * h + 128 * p)
                df = b.sitofp(r.dpx(w, 4, xo, 64), V16F)
                sv = r.shuf(sv4, sv4, [4 * v + i for i in range(4) for _ in range(4)])
                _acc_fma(r, v, df, sv)


def _pair_batch(r, g, pair, xstride):
    """One block pair (or 64-element low-bit block) for g vectors, r's args laid out as
    (acc, acc, row, off, xq, xo, xds, so, xsi, soi). The weights are unpacked once; the
    scale products of all g vectors are one 4g-lane multiply of [d_a, m_a, d_b, m_b]
    repeated by xsi[soi:soi + 4g] (each vector's [dx_a, sx_a, dx_b, sx_b], interleaved by
    _mvb) and their bias sums one add into the lanes after the g accumulators. Each lane
    is the product and sum _pair_common forms for one vector, so rows stay bit-identical;
    per vector only the dot, its conversion, one lane shuffle and the FMA remain (the
    single path repeats the scale load, multiply and bias add for every vector)."""
    b = r.b
    _prefetch_ahead(r, r.args[3], pair.nbytes)
    w, dm, lanes = pair.unpack(r, r.args[3])
    n = 4 * g
    prod = b.fmul(r.shuf(dm, dm, [0, 1, 2, 3] * g), r.load(8, r.args[9], _v(F32, n)))
    _bias_add(r, g, prod)
    fold = _folds(lanes)
    for v in range(g):
        dot = _block_dot(r, w, _x_at(r, xstride, v, 0), 64, pair.x1, lanes)
        if fold:  # as _pair_common
            df = b.sitofp(_fold16(r, dot), V8F)
            _acc_fma(r, v, df, r.shuf(prod, prod, [4 * v + i for i in lanes[:8]]))
        else:
            _acc_fma(r, v, b.sitofp(dot, V16F), r.shuf(prod, prod, [4 * v + i for i in lanes]))


@intrinsic
def block_g(typingctx, g, kind, part, cols, acc, row, off, xq, xo, xds, so, xs16, so16):
    """The format's block run for g vectors (g, kind, part literals): batched
    (_q4k_batch, _q6k_batch, _pair_batch; xs16[so16] the group's interleaved scales) or
    the single-vector intrinsic (`_block_of(kind, part)`) once per vector, with vector
    v's accumulators at acc + _ACC v (two acc16), its x at xq[xo + 2 cols v] and its
    scales at xds[so + cols/16 v]."""
    lits = (g, kind, part)
    if not all(isinstance(t, types.IntegerLiteral) for t in lits):
        return None
    i64, fp = types.int64, types.CPointer(types.float32)
    k = kind.literal_value
    batch_fn = {KIND_Q4_K: _q4k_batch, KIND_Q6_K: _q6k_batch}.get(k)
    rest = (row, i64, xq, i64, xds, i64)
    if batch_fn is not None:  # every K pass is batched (their part 1 is typed, never run)
        batched = True
    else:
        ssig, scg = _block_of(k, part.literal_value)._defn(typingctx, fp, fp, *rest)
        batched = part.literal_value == 0 and _pairs_batched(k, g.literal_value)

    def codegen(context, builder, sig, args):
        cols_v = _i64(builder, args[3])
        xb = 1 if k in _X1_KINDS else 2  # bytes of one vector's x per element
        xstride = builder.mul(cols_v, ir.Constant(I64, xb))
        sstride = builder.sdiv(cols_v, ir.Constant(I64, 16))  # its xds / xs16
        if batched:
            tys = (fp, fp, row, i64, xq, i64, xds, i64, xs16, i64)
            vals = [args[4], args[4]] + [
                context.cast(builder, a, t0, t1)
                for a, t0, t1 in zip(args[5:], sig.args[5:], tys[2:])
            ]
            r = _IR(context, builder, types.void(*tys), vals)
            if batch_fn is not None:
                batch_fn(r, g.literal_value, xstride)
            else:
                _pair_batch(r, g.literal_value, _PAIR_UNPACK[k], xstride)
            return context.get_dummy_value()
        base = [context.cast(builder, a, t0, t1) for a, t0, t1 in zip(args[5:], sig.args[5:], rest)]
        for v in range(g.literal_value):
            accs = [builder.gep(args[4], [ir.Constant(I64, _ACC * v + 16 * k)]) for k in (0, 1)]
            vargs = list(base)
            for i, stride in ((3, xstride), (5, sstride)):
                vargs[i] = builder.add(vargs[i], builder.mul(stride, ir.Constant(I64, v)))
            scg(context, builder, ssig, accs + vargs)
        return context.get_dummy_value()

    return types.void(g, kind, part, cols, acc, row, off, xq, xo, xds, so, xs16, so16), codegen


@intrinsic
def vector_results(typingctx, g, kind, acc, res):
    """res[v] = vector v's row result from its accumulators, for v < g (literals), in the
    single row function's float order (_row_<fmt>)."""
    if not isinstance(g, types.IntegerLiteral) or not isinstance(kind, types.IntegerLiteral):
        return None
    k = kind.literal_value

    def codegen(context, builder, sig, args):
        b = builder
        out = b.bitcast(args[3], F32.as_pointer())
        for v in range(g.literal_value):
            a = b.gep(args[2], [ir.Constant(I64, _ACC * v)])
            t = b.gep(args[2], [ir.Constant(I64, _ACC * v + 16)])
            h = tree_sum16(b, a)

            def lane(i, t=t):
                return b.load(b.gep(t, [ir.Constant(I64, i)]))

            if k == KIND_Q6_K and Q6K_GROUP_SUMS:  # the second acc16: _hsum(ab, 16)
                tail = tree_sum16(b, t)
            elif k in _K_KINDS:  # _hsum(p, n) for n < 16: from 0.0, in order
                tail = ir.Constant(F32, 0.0)
                nl = _bias_lanes(k)
                for i in range(nl):
                    at = _ACC * g.literal_value + nl * v + i
                    tail = b.fadd(tail, b.load(b.gep(args[2], [ir.Constant(I64, at)])))
            elif _pairs_batched(k, g.literal_value):
                # the batched pairs' bias lanes, then the odd last block's (0.0 if none):
                # the order in which the single path's acc4 summed them
                def both(i, v=v):
                    gl = b.load(
                        b.gep(args[2], [ir.Constant(I64, _ACC * g.literal_value + 4 * v + i)])
                    )
                    return b.fadd(gl, lane(i))

                tail = b.fadd(both(1), both(3))
            else:
                tail = b.fadd(lane(1), lane(3))  # the pair accumulator's bias lanes
            plus = (KIND_Q4_1, KIND_Q3_G64, KIND_Q2_G64)  # x = d q + m: + m sum(x)
            c = {k_: None for k_ in plus} | {KIND_Q4_0: 8.0, KIND_Q5_0: 16.0, KIND_Q8_0: 128.0}
            c = c.get(k, 1.0 if k == KIND_Q4_K else 32.0)
            if c is None:
                r = b.fadd(h, tail)
            elif k == KIND_Q4_K:
                r = b.fsub(h, tail)
            else:
                r = b.fsub(h, b.fmul(ir.Constant(F32, c), tail))
            b.store(r, b.gep(out, [ir.Constant(I64, v)]))
        return context.get_dummy_value()

    return types.void(g, kind, acc, res), codegen


# ----------------------------------------------------------------- row dispatch, batch


@njit(inline="always")
def row_layout(kind):
    """(elements per block, nib2 x layout) of a block format's rows."""
    if kind == KIND_Q4_K or kind == KIND_Q6_K:
        return 256, False
    if kind == KIND_Q3_G64 or kind == KIND_Q2_G64:
        return 64, False
    return 32, kind != KIND_Q8_0


GROUP = 4  # vectors per pass over a row (4 x two acc16 fill most of AVX2's registers)


@njit(inline="always")
def _unit_bytes(kind):
    if kind == KIND_Q4_K:
        return 144
    if kind == KIND_Q6_K:
        return 210
    if kind == KIND_Q8_0:
        return 34
    if kind == KIND_Q5_0:
        return 22
    if kind == KIND_Q4_1 or kind == KIND_Q2_G64:
        return 20
    if kind == KIND_Q3_G64:
        return 28
    return 18


@njit(inline="always")
def _rows_g(g, kind, flat, base, nunit, cols, xq, xo, xds, so, xs16, res):
    """One row . g vectors (the g from vector v0, whose x starts at xq[xo], its scales at
    xds[so]) -> res[0:g]: the block loop of _row_<fmt>, every block for all g. xs16: the
    group's interleaved scales (_mvb; _pair_batch, _q4k_batch, _q6k_batch)."""
    acc = acc_vectors(g)
    ub = _unit_bytes(kind)
    if kind == KIND_Q4_K or kind == KIND_Q6_K:  # xs16: the group's K scales (_mvb)
        ka = 1 if kind == KIND_Q4_K else 2
        for b in range(nunit):
            o, w = so + b * 16, base + b * ub
            a = ka * (so + 64 * b)
            block_g(g, kind, 0, cols, acc, flat, w, xq, xo + b * 512, xds, o, xs16, a)
    elif kind == KIND_Q3_G64 or kind == KIND_Q2_G64:
        for b in range(nunit):
            o = so + b * 4
            w = base + b * ub
            xp = xo + b * 64 * x_bytes(kind)
            block_g(g, kind, 0, cols, acc, flat, w, xq, xp, xds, o, xs16, so + b * 16)
    else:  # xs16: the interleaved scales of _mvb's vector group (_pair_batch)
        xb = x_bytes(kind)
        for p in range(nunit // 2):
            o, w = so + p * 4, base + p * 2 * ub
            xp = xo + p * 64 * xb
            block_g(g, kind, 0, cols, acc, flat, w, xq, xp, xds, o, xs16, so + p * 16)
        if nunit & 1:
            b = nunit - 1
            o, xp = so + b * 2, xo + b * 32 * xb
            block_g(g, kind, 1, cols, acc, flat, base + b * ub, xq, xp, xds, o, xs16, o)
    vector_results(g, kind, acc, res)


@njit(inline="always")
def _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2):
    """Row `row` of the batched kernels' parallel loop over the rows of up to three
    matrices -> (its matrix's flat bytes, the row's byte offset, the output, its row)."""
    i = np.int64(row)  # one integer type for r in every branch
    n0, n01 = d0.shape[0], d0.shape[0] + d1.shape[0]
    if i < n0:
        return f0, i * d0.shape[1], o0, i
    if i < n01:
        return f1, (i - n0) * d1.shape[1], o1, i - n0
    return f2, (i - n01) * d2.shape[1], o2, i - n01


@njit(inline="always")
def _mvb(kind, d0, d1, d2, X, o0, o1, o2):
    """o_k[v] = W_k @ X[v] for up to three matrices W_k (d0, d1, d2) that share X: X is
    quantized once and the rows of all of them share one parallel loop (Q/K/V, gate/up;
    unused slots get 0-row arrays), as the mv_* kernels do for one vector."""
    nv, cols = X.shape
    unit, nib2 = row_layout(kind)
    nunit = cols // unit
    nb = cols // 32
    xs = 2 * nb  # scales per vector
    # A last group of 3 runs as 4 (the 4th a copy of the 3rd, its result dropped): the
    # 4-vector pass costs less than the 3-vector one (SmolLM2's 576x576 Q4_1: 2.0x
    # against 3.4x one vector's time)
    npad = nv + 1 if nv % GROUP == 3 else nv
    xq = np.empty(npad * 2 * cols, np.int8)
    xds = np.empty(npad * xs, np.float32)
    xs16 = np.empty(npad * xs, np.float32)
    xb = x_bytes(kind)  # bytes of x per element
    for v in range(nv):
        xv, sv = xq[xb * cols * v :], xds[v * xs : v * xs + xs]
        quantize_xn(X[v], x1_span(kind), nib2, xv, sv, xs16[v * xs :])
    if npad > nv:
        q = xb * cols * nv
        xq[q : q + xb * cols] = xq[q - xb * cols : q]
        xds[nv * xs : npad * xs] = xds[(nv - 1) * xs : nv * xs]
        xs16[nv * xs : npad * xs] = xs16[(nv - 1) * xs : nv * xs]
    # each group of GROUP vectors' scales side by side, so that a block's scale products
    # for all of them are one vector multiply (_pair_batch, _q4k_batch, _q6k_batch)
    ng = (npad + GROUP - 1) // GROUP
    if kind == KIND_Q4_K:  # per super-block b at xs * v0 + 64 b: 8 dx per vector, then 8 sx
        aux = np.zeros(ng * GROUP * xs, np.float32)
        for v in range(npad):
            at, x0 = (v - v % GROUP) * xs + (v % GROUP) * 8, v * xs
            for b in range(nunit):
                for j in range(8):
                    aux[at + 64 * b + j] = xds[x0 + 16 * b + 2 * j]
                    aux[at + 64 * b + 32 + j] = xds[x0 + 16 * b + 2 * j + 1]
    elif kind == KIND_Q6_K and Q6K_GROUP_SUMS:  # per super-block b and vector v at
        aux = np.zeros(ng * GROUP * 2 * xs, np.float32)  # 2 xs v0 + 128 b + 32 (v - v0):
        order = Q6K_DX_ORDER  # its 16 dx in sum order, then its 16 sums
        for v in range(npad):
            at, x0 = (v - v % GROUP) * 2 * xs + (v % GROUP) * 32, v * xs
            for b in range(nunit):
                o = at + 128 * b
                for j in range(16):
                    aux[o + j] = xds[x0 + 16 * b + order[j]]
                    aux[o + 16 + j] = xs16[x0 + 16 * b + j]
    elif kind == KIND_Q6_K:  # per super-block b at 2 xs v0 + 128 b, chunk pair c at + 32 c:
        aux = np.zeros(ng * GROUP * 2 * xs, np.float32)  # [dx_a dx_a dx_b dx_b] per vector,
        for v in range(npad):  # then 4 sums of 16 elements per vector
            at, x0 = (v - v % GROUP) * 2 * xs + (v % GROUP) * 4, v * xs
            for b in range(nunit):
                for c in range(4):
                    o = at + 128 * b + 32 * c
                    for j in range(4):
                        aux[o + j] = xds[x0 + 16 * b + 4 * c + 2 * (j // 2)]
                        aux[o + 16 + j] = xs16[x0 + 16 * b + 4 * c + j]
    else:
        # block pairs: each group of GROUP vectors' [dx_a, sx_a, dx_b, sx_b] of pair q
        # side by side at xs * v0 + 16 q (_pair_batch loads them as one vector)
        aux = np.zeros(ng * GROUP * xs, np.float32)
        for v in range(npad):
            at = (v - v % GROUP) * xs + (v % GROUP) * 4
            for q in range(xs // 4):
                for j in range(4):
                    aux[at + 16 * q + j] = xds[v * xs + 4 * q + j]
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    n0, n1 = d0.shape[0], d1.shape[0]
    n01 = n0 + n1
    for row in prange(n01 + d2.shape[0]):
        res = acc_vectors(1)  # >= GROUP floats
        rv = numba.carray(res, GROUP)
        flat, base, out, r = _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            xo = xb * cols * v0
            so = xs * v0
            if g >= 3:
                _rows_g(4, kind, flat, base, nunit, cols, xq, xo, xds, so, aux, res)
            elif g == 2:
                _rows_g(2, kind, flat, base, nunit, cols, xq, xo, xds, so, aux, res)
            else:
                _rows_g(1, kind, flat, base, nunit, cols, xq, xo, xds, so, aux, res)
            for v in range(g):
                out[v0 + v, r] = rv[v]


# Batched decode, one kernel per format: o_k[v] = W_k @ X[v] for a few vectors and up to
# three matrices sharing them, each row read and unpacked once for GROUP vectors at a
# time. Row v equals the format's mv_* kernel on X[v] bit for bit (the same x
# quantization, the same per-vector IR).
@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_0(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q4_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_1(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q4_1, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q5_0(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q5_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q8_0(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q8_0, d0, d1, d2, X, o0, o1, o2)


@njit(inline="always")
def _k8_rows4(kind, flat, base, nsb, cols, xb, xsb, xp, bs, v0, nv, rv):
    """One Q4_K / Q6_K row . vectors v0 .. v0 + 3 (clamped to nv - 1; a clamped copy's
    result is dropped) on quantize_x_sb8 activations: the block intrinsic for each
    vector in turn, the same IR as _row_k8's, so each result equals the single matvec's
    bit for bit; the four calls load and unpack the same weights, and LLVM does that
    once."""
    va, vb, vc, vd = v0, min(v0 + 1, nv - 1), min(v0 + 2, nv - 1), min(v0 + 3, nv - 1)
    a0, m0, a1, m1 = acc16(), acc16(), acc16(), acc16()
    a2, m2, a3, m3 = acc16(), acc16(), acc16(), acc16()
    nbytes = _k8_bytes(kind)
    for s in range(nsb):
        w, o = base + s * nbytes, s * 256
        _k8_block(kind, a0, m0, flat, w, xb, va * cols + o, xsb, xp, va * nsb + s, bs)
        _k8_block(kind, a1, m1, flat, w, xb, vb * cols + o, xsb, xp, vb * nsb + s, bs)
        _k8_block(kind, a2, m2, flat, w, xb, vc * cols + o, xsb, xp, vc * nsb + s, bs)
        _k8_block(kind, a3, m3, flat, w, xb, vd * cols + o, xsb, xp, vd * nsb + s, bs)
    rv[0] = _hsum(a0, 8) - _hsum(m0, 8)
    rv[1] = _hsum(a1, 8) - _hsum(m1, 8)
    rv[2] = _hsum(a2, 8) - _hsum(m2, 8)
    rv[3] = _hsum(a3, 8) - _hsum(m3, 8)


@njit(inline="always")
def _k8_rows2(kind, flat, base, nsb, cols, xb, xsb, xp, bs, v0, rv):
    a0, m0, a1, m1 = acc16(), acc16(), acc16(), acc16()
    v1 = v0 + 1
    nbytes = _k8_bytes(kind)
    for s in range(nsb):
        w, o = base + s * nbytes, s * 256
        _k8_block(kind, a0, m0, flat, w, xb, v0 * cols + o, xsb, xp, v0 * nsb + s, bs)
        _k8_block(kind, a1, m1, flat, w, xb, v1 * cols + o, xsb, xp, v1 * nsb + s, bs)
    rv[0] = _hsum(a0, 8) - _hsum(m0, 8)
    rv[1] = _hsum(a1, 8) - _hsum(m1, 8)


@njit(inline="always")
def _mvb_k8(kind, d0, d1, d2, X, o0, o1, o2):
    """_mvb for Q4_K / Q6_K on quantize_x_sb8 activations (SB8_DECODE, Q6K_SB8): rows
    equal mv_q4_k's / mv_q6_k's."""
    nv, cols = X.shape
    n = cols // 256
    xb = np.empty(nv * cols, np.int8)
    xsb = np.empty(nv * 9 * n, np.float32)
    xp = np.empty(nv * 8 * n, np.int16)
    bs = np.empty(nv * 16 * n, np.int16)
    for v in range(nv):
        quantize_k8(
            kind,
            X[v],
            xb[v * cols : (v + 1) * cols],
            xsb[v * 9 * n : (v + 1) * 9 * n],
            xp[v * 8 * n : (v + 1) * 8 * n],
            bs[v * 16 * n : (v + 1) * 16 * n],
        )
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    n0, n1 = d0.shape[0], d1.shape[0]
    n01 = n0 + n1
    for row in prange(n01 + d2.shape[0]):
        res = acc_vectors(1)  # >= GROUP floats
        rv = numba.carray(res, GROUP)
        flat, base, out, r = _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            if g >= 3:
                _k8_rows4(kind, flat, base, n, cols, xb, xsb, xp, bs, v0, nv, rv)
            elif g == 2:
                _k8_rows2(kind, flat, base, n, cols, xb, xsb, xp, bs, v0, rv)
            else:
                rv[0] = _row_k8(
                    kind,
                    flat,
                    base,
                    n,
                    xb[v0 * cols :],
                    xsb[v0 * 9 * n :],
                    xp[v0 * 8 * n :],
                    bs[v0 * 16 * n :],
                )
            for v in range(g):
                out[v0 + v, r] = rv[v]


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_k(d0, d1, d2, X, o0, o1, o2):
    if SB8_DECODE:
        _mvb_k8(KIND_Q4_K, d0, d1, d2, X, o0, o1, o2)
    else:
        _mvb(KIND_Q4_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q6_k(d0, d1, d2, X, o0, o1, o2):
    if Q6K_SB8:
        _mvb_k8(KIND_Q6_K, d0, d1, d2, X, o0, o1, o2)
    else:
        _mvb(KIND_Q6_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q3_g64(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q3_G64, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q2_g64(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q2_G64, d0, d1, d2, X, o0, o1, o2)


# --------------------------------------------------------------------------- matmul
# Prefill: each weight row is unpacked once (to unsigned bytes U [cols], a float scale
# per int32 lane of a vpdpbusd and a bias per 16 elements), then multiplied with all
# tokens, 4 at a time (4 zmm accumulators share each 64-byte load of U):
#   y[t, r] = sum_lanes cvt(dot(U, xq_t)) * ws_lane * dx_t,lane + sum_g bias_g * sx_t,g
# This turns every format into one int8 GEMM inner loop: ~4 instructions per 64 MACs
# per token.
_RB = 16


@intrinsic
def gemm4(typingctx, a0, a1, a2, a3, u, uo, wsl, wo, xq, xo, xstride, xsl, so, sstride):
    """a_t += cvt(dpbusd(u[uo:uo+64], xq[xo + t*xstride:][:64])) * wsl[wo:wo+16]
    * xsl[so + t*sstride:][:16] for t = 0..3."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        uv = r.load(4, args[5], V64I8)
        wv = r.load(6, args[7], V16F)
        xo, xs, so, ss = args[9], args[10], args[12], args[13]
        for t in range(4):
            xt = b.add(xo, b.mul(xs, ir.Constant(xs.type, t)))
            sx = r.load(11, b.add(so, b.mul(ss, ir.Constant(ss.type, t))), V16F)
            df = b.sitofp(r.dpx(uv, 8, xt, 64), V16F)
            sc = b.fmul(wv, sx)
            _acc_add(r, t, V16F, lambda a, df=df, sc=sc: r.fma(df, sc, a))
        return context.get_dummy_value()

    return types.void(a0, a1, a2, a3, u, uo, wsl, wo, xq, xo, xstride, xsl, so, sstride), codegen


@intrinsic
def fma16(typingctx, acc, a, ao, b, bo):
    """acc[0:16] += a[ao:ao+16] * b[bo:bo+16] (float32)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        prod = builder.fmul(r.load(1, args[2], V16F), r.load(3, args[4], V16F))
        _acc_add(r, 0, V16F, lambda v: builder.fadd(v, prod))
        return context.get_dummy_value()

    return types.void(acc, a, ao, b, bo), codegen


@intrinsic
def hsum4x16(typingctx, a0, a1, a2, a3, res):
    """res[0:4] = [sum(a0[0:16]), sum(a1[0:16]), sum(a2[0:16]), sum(a3[0:16])]."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        v = [b.load(b.bitcast(args[i], V16F.as_pointer())) for i in range(4)]

        def fold(x, y, k, m):
            """x (and y): k tokens x m lanes, token-major -> (2)k tokens x m/2 lanes."""
            h = m // 2
            lo = [i * m + j for i in range(k) for j in range(h)]
            hi = [i * m + h + j for i in range(k) for j in range(h)]
            if y is None:
                return b.fadd(r.shuf(x, x, lo), r.shuf(x, x, hi))
            n = k * m
            return b.fadd(
                r.shuf(x, y, lo + [n + i for i in lo]), r.shuf(x, y, hi + [n + i for i in hi])
            )

        s01 = fold(v[0], v[1], 1, 16)  # 2 tokens x 8
        s23 = fold(v[2], v[3], 1, 16)
        u = fold(s01, s23, 2, 8)  # 4 tokens x 4
        w = fold(u, None, 4, 4)  # 4 x 2
        res4 = fold(w, None, 4, 2)  # 4 x 1
        b.store(res4, b.bitcast(args[4], V4F.as_pointer()))
        return context.get_dummy_value()

    return types.void(a0, a1, a2, a3, res), codegen


# Row unpackers for the matmul: store unsigned weight bytes into U (uint8) at uo.
def _store(r, i, off, v):
    builder = r.b
    builder.store(v, r.ptr(i, off, v.type), align=1)


@intrinsic
def st_nib(typingctx, U, uo, flat, qo):
    """U[uo:uo+32] = low nibbles, then high nibbles, of flat[qo:qo+16]."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        _store(r, 0, args[1], _nib_single(r, r.load(2, args[3], V16I8)))
        return context.get_dummy_value()

    return types.void(U, uo, flat, qo), codegen


@intrinsic
def st_nib5(typingctx, U, uo, flat, qo, ho):
    """Q5_0: U[uo:uo+32] = nibbles of flat[qo:qo+16] | (bit j of u32 flat[ho:ho+4]) << 4."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        w = _nib_single(r, r.load(2, args[3], V16I8))
        _store(r, 0, args[1], b.or_(w, _bit_bytes(r, r.load(2, args[4], I32), 32, 16)))
        return context.get_dummy_value()

    return types.void(U, uo, flat, qo, ho), codegen


@intrinsic
def st_xor(typingctx, U, uo, flat, qo):
    """Q8_0: U[uo:uo+32] = flat[qo:qo+32] ^ 0x80 (int8 -> uint8 + 128)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        _store(r, 0, args[1], builder.xor(r.load(2, args[3], V32I8), r.splat_i8(32, 0x80)))
        return context.get_dummy_value()

    return types.void(U, uo, flat, qo), codegen


@intrinsic
def st_nib64(typingctx, U, uo, flat, qo):
    """Q4_K group: U[uo:uo+64] = low nibbles of flat[qo:qo+32], then high nibbles."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        q = r.load(2, args[3], V32I8)
        lo = builder.and_(q, r.splat_i8(32, 15))
        hi = builder.lshr(q, r.splat_i8(32, 4))
        _store(r, 0, args[1], r.concat(lo, hi))
        return context.get_dummy_value()

    return types.void(U, uo, flat, qo), codegen


@intrinsic
def st_q6(typingctx, U, uo, flat, qlo, qho):
    """Q6_K half: U[uo:uo+128] = 6-bit values from ql flat[qlo:+64] and qh flat[qho:+32]."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        _store(r, 0, args[1], q6_half_bytes(r, 2, args[3], 0, args[4], 0))
        return context.get_dummy_value()

    return types.void(U, uo, flat, qlo, qho), codegen


def q6_half_bytes(r, i, qlo, qlo_extra, qho, qho_extra):
    """IR: the 128 6-bit values (element order, 0..63) of a Q6_K half from its 64 ql
    bytes at qlo + qlo_extra and 32 qh bytes at qho + qho_extra of array arg i."""
    b = r.b
    ql = r.load(i, qlo, V64I8, qlo_extra)
    qh = r.load(i, qho, V32I8, qho_extra)
    lo = b.and_(ql, r.splat_i8(64, 15))
    hi = b.lshr(ql, r.splat_i8(64, 4))
    h01 = r.concat(qh, b.lshr(qh, r.splat_i8(32, 2)))
    h23 = r.concat(b.lshr(qh, r.splat_i8(32, 4)), b.lshr(qh, r.splat_i8(32, 6)))
    h01 = b.shl(b.and_(h01, r.splat_i8(64, 3)), r.splat_i8(64, 4))
    h23 = b.shl(b.and_(h23, r.splat_i8(64, 3)), r.splat_i8(64, 4))
    return r.concat(b.or_(lo, h01), b.or_(hi, h23))


def _st_lowbit(bits):
    def st(typingctx, U, uo, flat, off):
        """U[uo:uo+64] = the values of the low-bit block at flat[off] (element order)."""

        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            _store(r, 0, args[1], _lowbit_bytes(r, args[3], bits))
            return context.get_dummy_value()

        return types.void(U, uo, flat, off), codegen

    st.__name__ = f"st_q{bits}_g64"
    return intrinsic(st)


st_q2_g64 = _st_lowbit(2)
st_q3_g64 = _st_lowbit(3)


@intrinsic
def st_splat(typingctx, a, off, v, n):
    """a[off:off+n] = v for float32 a, n in (4, 8) (a literal)."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        _store(r, 0, args[1], r.splat(args[2], n.literal_value))
        return context.get_dummy_value()

    return types.void(a, off, v, n), codegen


@njit(inline="always")
def _prep_nib32(flat, base, nb, bs, qo, U, wsl, b16, kind):
    for b in range(nb):
        o = base + b * bs
        d = _f16at(flat, o)
        if kind == KIND_Q4_1:
            bias = _f16at(flat, o + 2)
        elif kind == KIND_Q4_0:
            bias = np.float32(-8.0) * d
        else:
            bias = np.float32(-16.0) * d
        if kind == KIND_Q5_0:
            st_nib5(U, b * 32, flat, o + qo, o + 2)
        else:
            st_nib(U, b * 32, flat, o + qo)
        st_splat(wsl, b * 8, d, 8)
        b16[2 * b] = bias
        b16[2 * b + 1] = bias


@njit(cache=True, nogil=True)
def prep_row(kind, flat, base, cols, U, wsl, b16):
    """Unpack one weight row: U[j] unsigned bytes, wsl[j // 4] the scale of the int32
    lane holding element j, b16[j // 16] the per-element bias of element j's 16-group."""
    nb = cols // 32
    if kind == KIND_Q4_1:
        _prep_nib32(flat, base, nb, 20, 4, U, wsl, b16, KIND_Q4_1)
    elif kind == KIND_Q4_0:
        _prep_nib32(flat, base, nb, 18, 2, U, wsl, b16, KIND_Q4_0)
    elif kind == KIND_Q5_0:
        _prep_nib32(flat, base, nb, 22, 6, U, wsl, b16, KIND_Q5_0)
    elif kind == KIND_Q8_0:
        for b in range(nb):
            o = base + b * 34
            d = _f16at(flat, o)
            st_xor(U, b * 32, flat, o + 2)
            st_splat(wsl, b * 8, d, 8)
            b16[2 * b] = np.float32(-128.0) * d
            b16[2 * b + 1] = np.float32(-128.0) * d
    elif kind == KIND_Q4_K:
        for b in range(cols // 256):
            o = base + b * 144
            d = _f16at(flat, o)
            dmin = _f16at(flat, o + 2)
            sm = flat[o + 4 : o + 16]
            for j in range(8):
                s_, m_ = _q4k_sm(sm, j)
                st_splat(wsl, b * 64 + j * 8, d * np.float32(s_), 8)
                bias = -(dmin * np.float32(m_))
                b16[b * 16 + 2 * j] = bias
                b16[b * 16 + 2 * j + 1] = bias
            for g in range(4):
                st_nib64(U, b * 256 + 64 * g, flat, o + 16 + 32 * g)
    elif kind == KIND_Q6_K:
        for b in range(cols // 256):
            o = base + b * 210
            d = _f16at(flat, o + 208)
            for k in range(16):
                ds = d * np.float32(np.int8(flat[o + 192 + k]))
                st_splat(wsl, b * 64 + k * 4, ds, 4)
                b16[b * 16 + k] = np.float32(-32.0) * ds
            for h in range(2):
                st_q6(U, b * 256 + 128 * h, flat, o + 64 * h, o + 128 + 32 * h)
    elif kind == KIND_Q3_G64 or kind == KIND_Q2_G64:
        bs = 28 if kind == KIND_Q3_G64 else 20
        for b in range(cols // 64):
            o = base + b * bs
            if kind == KIND_Q3_G64:
                st_q3_g64(U, b * 64, flat, o)
            else:
                st_q2_g64(U, b * 64, flat, o)
            d = _f16at(flat, o)
            st_splat(wsl, b * 16, d, 8)
            st_splat(wsl, b * 16 + 8, d, 8)
            m = _f16at(flat, o + 2)
            for g in range(4):
                b16[b * 4 + g] = m


@njit(parallel=True, cache=True, nogil=True)
def quantize_tokens(X, n4, c64):
    """Two-level int8 rows xq [n4, 2 * c64] (quantize_x's natural chunk layout of the
    row zero-padded to c64 columns; padding tokens are zero), lane scales xsl
    [n4, c64 // 4] (dx' of each int32 lane) and 16-group sums xs16 [n4, >= c64 // 16]
    (zero padded to a multiple of 16)."""
    n, cols = X.shape
    nb = c64 // 32
    xq = np.zeros((n4, 2 * c64), np.int8)
    xsl = np.zeros((n4, c64 // 4), np.float32)
    xs16 = np.zeros((n4, (c64 // 16 + 15) // 16 * 16), np.float32)
    for t in prange(n):
        xp = np.zeros(c64, np.float32)
        xp[:cols] = X[t]
        xds = np.empty(2 * nb, np.float32)
        quantize_x(xp, False, xq[t], xds, xs16[t, : 2 * nb])
        for b in range(nb):
            for l in range(8):
                xsl[t, b * 8 + l] = xds[2 * b]
    return xq, xsl, xs16


@njit(parallel=True, cache=True, nogil=True)
def mm_int8(kind, data, X, out):
    n, cols = X.shape
    c64 = (cols + 63) // 64 * 64
    n4 = (n + 3) // 4 * 4
    xq2, xsl2, xs16 = quantize_tokens(X, n4, c64)
    xq = xq2.reshape(-1)
    xsl = xsl2.reshape(-1)
    rows = data.shape[0]
    flat = data.reshape(-1)
    rb = data.shape[1]
    nch = c64 // 64
    c4 = c64 // 4
    x16w = xs16.shape[1]
    ng = x16w // 16
    xs16f = xs16.reshape(-1)
    for c in prange((rows + _RB - 1) // _RB):
        res = acc4()
        rv = numba.carray(res, 4)
        r0 = c * _RB
        nr = min(_RB, rows - r0)
        U = np.zeros((_RB, c64), np.uint8)
        wsl = np.zeros((_RB, c4), np.float32)
        b16 = np.zeros((_RB, x16w), np.float32)
        for i in range(nr):
            prep_row(kind, flat, (r0 + i) * rb, cols, U[i], wsl[i], b16[i])
        Uf = U.reshape(-1)
        wf = wsl.reshape(-1)
        bf = b16.reshape(-1)
        # token tiles outside, rows inside: the tile's int8 x (4 x c64 bytes) stays in L1
        for tt in range(n4 // 4):
            t0 = tt * 4
            for i in range(nr):
                a0 = acc16()
                a1 = acc16()
                a2 = acc16()
                a3 = acc16()
                for k in range(nch):
                    gemm4(
                        a0,
                        a1,
                        a2,
                        a3,
                        Uf,
                        i * c64 + k * 64,
                        wf,
                        i * c4 + k * 16,
                        xq,
                        t0 * 2 * c64 + k * 128,
                        2 * c64,
                        xsl,
                        t0 * c4 + k * 16,
                        c4,
                    )
                for g in range(ng):
                    bo = i * x16w + g * 16
                    fma16(a0, bf, bo, xs16f, t0 * x16w + g * 16)
                    fma16(a1, bf, bo, xs16f, (t0 + 1) * x16w + g * 16)
                    fma16(a2, bf, bo, xs16f, (t0 + 2) * x16w + g * 16)
                    fma16(a3, bf, bo, xs16f, (t0 + 3) * x16w + g * 16)
                hsum4x16(a0, a1, a2, a3, res)
                for t in range(min(4, n - t0)):
                    out[t0 + t, r0 + i] = rv[t]
