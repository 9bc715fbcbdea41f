"""The LLVM IR the int8 kernels are written in: which int8 dot this CPU gets (DOT) and the
single-level decode switches that follow from it, vector types, the `_IR` builder with its
dot products (vpdpbusd, vpmaddwd, generic), stack accumulators (acc16, acc4, hsum16).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops._simd import int8_dot, tree_sum16  # noqa: E402

F0 = np.float32(0.0)
# The int8 dot these kernels are built on: AVX-512 VNNI's vpdpbusd where the CPU has it,
# else AVX2's vpmaddwd on int16 activations (same lanes, same int32 results), or "int8":
# the same int16 multiply-adds in LLVM's generic vector operations, for any LLVM target
# (x86 lowers them to vpmaddwd, AArch64 to NEON widening multiply-adds): the default on
# 64-bit ARM, elsewhere with EDGERUN_KERNELS=int8 (see _simd.int8_dot).
DOT = int8_dot() or "avx2"


# Q5_0 and edgerun's Q3_G64 / Q2_G64 (X1's formats) decode on single-level int8
# activations on every int8 path, one scale per 32 as llama.cpp's q8_0 (quantize_x1,
# _IR.dot_x1; on vnni one vpdpbusd per 32 or 64 bytes, the avx2 path's exact int32 sums):
# per 64 nibble weights two vpmaddubsw and one vpmaddwd where the two-level int16 words
# take four vpmaddwd and the shifts and masks that make words of the bytes. The G64
# formats' x takes one scale per 64, the block's own span (its 64 weights share d and m),
# so the halves' vpmaddubsw sums add in int16 and a block is one vpmaddwd, one conversion
# and one 8-lane FMA (_SV_SHARED). Against two-level kernels, 4864x896, one thread, 1 / 4
# vectors: Q5_0 1.15 / 1.53x, Q3_G64 1.18 / 1.30x, Q2_G64 1.20 / 1.35x on avx2, 1.08-1.30x
# on vnni (`python benchmarks/kernel_ab.py --base <rev> --formats Q5_0 --rows 4864 --cols
# 896 -t 1`). Logits against float activations (`python benchmarks/decode_quality.py -m
# qwen2.5-coder-0.5b`): 0.5B KL 1.4e-4, top-1 99.5%; Gemma 3 270M KL 1.1e-3 (two levels:
# ~2e-7). Their x is one byte an element (x_bytes).
# Tried: Q4_1 / Q4_0 the same way (1.24-1.33x, but SmolLM2's logits move by up to ~1, KL
# 2e-3, and its greedy answers change: the smallest model keeps two levels); Q8_0 with
# |w| times sign-carrying x (0.96-1.04x); a broadcast-and-vpsrlvd unpack of the G64
# formats' ql / qh (Q2 1.00x, Q3 0.89x against the xmm unpack).

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
        if DOT != "int8":  # AVX-512 CPUs have AVX2's instructions
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
        if DOT != "int8":
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


# Row unpackers for the matmul: store unsigned weight bytes into U (uint8) at uo.
def _store(r, i, off, v):
    builder = r.b
    builder.store(v, r.ptr(i, off, v.type), align=1)
