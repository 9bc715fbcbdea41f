"""Decode attention's products read straight off q8_0 / q4_0 cache blocks (ops/kv_blocks.py).

Decode attention at a long context is bound by the bytes of the cache it reads: a q8_0
row is half an f16 one, a q4_0 row a bit over a quarter. Dequantising each chunk into a
float buffer first (kv_blocks.values) cost more than those bytes saved: a scalar loop
per value, a store and a reload. Here a block's 32 values go from memory into two
16-lane float vectors in registers (sign-extend q8_0's bytes; split q4_0's nibbles and
take 8) and meet the query or the softmax weights there, the block's f16 scale applied
once per 32 values:

- `scores16_blocks`: 16 keys' scores against one query head, as attention_decode's
  `scores16` forms them (one 16-lane product per key, a transpose-and-add tree);
- `block_axpy2`: two heads' weighted value sums take one block of one position, its
  values converted once for both.

Where the CPU has an int8 dot (_simd.int8_dot: AVX2 / AVX-512's vpmaddwd, or LLVM's
generic widening multiply-adds on ARM), the scores take `scores16_iblocks` instead: the
query rounded once per job to int16 per 32 values (`quantize_query`, a scale each: an
error of at most 2^-16 of the block's largest value), a key block's bytes widened to
int16 and multiplied in two vpmaddwd, the block's int32 sums converted once and scaled
by the two blocks' scales. Per 32 values: 2 widenings, 2 multiply-adds, an add, a
conversion and an FMA, where the float path takes 4 widenings, 4 conversions and 4
multiplies, which left q8_0 slower than f16 at a long context.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from edgerun.ops._simd import (
    _V16F,
    _acc_ptr,
    _is_c_array,
    _load16,
    _splat16,
    int8_dot,
    store_scores16,
)

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V16I8 = ir.VectorType(_I8, 16)
_V16I16, _V8I32, _V16I32 = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)
# The int8 dot this process's kernels use (None: the float block kernels only).
INT_DOT = int8_dot()
_BLOCKS = (types.int8, types.uint8)  # q8_0, q4_0 (kv_blocks: the array's element type)
_BYTES = {types.int8: 34, types.uint8: 18}


def _data(context, builder, aryty, ary):
    """An i8* to the array's first element (its elements are bytes)."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(data, _I8.as_pointer())


def _block_words(builder, base, at, q8):
    """IR: (f16 scale as float, values 0..15, values 16..31 as <16 x i16>) of the block
    at byte `at` of base (_block's values, as integers)."""
    b = builder
    hp = b.bitcast(b.gep(base, [at]), _I16.as_pointer())
    d = b.fpext(b.bitcast(b.load(hp, align=1), ir.HalfType()), ir.FloatType())
    qp = b.gep(base, [b.add(at, ir.Constant(_I64, 2))])
    if q8:
        lo = b.load(b.bitcast(qp, _V16I8.as_pointer()), align=1)
        hp2 = b.gep(base, [b.add(at, ir.Constant(_I64, 18))])
        hi = b.load(b.bitcast(hp2, _V16I8.as_pointer()), align=1)
    else:
        x = b.load(b.bitcast(qp, _V16I8.as_pointer()), align=1)
        eight = ir.Constant(_V16I8, [8] * 16)
        lo = b.sub(b.and_(x, ir.Constant(_V16I8, [15] * 16)), eight)
        hi = b.sub(b.lshr(x, ir.Constant(_V16I8, [4] * 16)), eight)
    return d, b.sext(lo, _V16I16), b.sext(hi, _V16I16)


def _madd(builder, a, x):
    """<16 x i16> a, x -> <8 x i32> lanes a[2j] x[2j] + a[2j+1] x[2j+1]: vpmaddwd on x86,
    generic widening multiply-adds elsewhere (int8.ir's madd16)."""
    b = builder
    if INT_DOT in ("avx2", "vnni"):
        m = b.module
        name = "llvm.x86.avx2.pmadd.wd"
        f = m.globals.get(name) or ir.Function(m, ir.FunctionType(_V8I32, [_V16I16] * 2), name)
        return b.call(f, [a, x])
    p = b.mul(b.sext(a, _V16I32), b.sext(x, _V16I32))
    even = ir.Constant(_V8I32, list(range(0, 16, 2)))
    odd = ir.Constant(_V8I32, list(range(1, 16, 2)))
    return b.add(b.shuffle_vector(p, p, even), b.shuffle_vector(p, p, odd))


@njit(inline="always")
def quantize_query(q, q0, n, qw, qd):
    """q[q0:q0 + n] (float32) -> qw[:n] int16 and qd[:n / 32] float32, per 32 values:
    qd = their largest magnitude / 32767, qw = round(q / qd) (half away from zero)."""
    for blk in range(n // 32):
        o = q0 + blk * 32
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(q[o + j]))
        d = amax / np.float32(32767.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        qd[blk] = d
        for j in range(32):
            v = q[o + j] * inv
            qw[blk * 32 + j] = np.int16(
                np.floor(v + np.float32(0.5)) if v >= 0 else -np.floor(np.float32(0.5) - v)
            )


@intrinsic
def scores16_iblocks(typingctx, hd, qw, qi, qd, qdi, k, kb, nvalid, scale, out, oi):
    """out.flat[oi:oi+16] = scale * sum over blocks b of qd[qdi + b] * d_b * (qw's int16
    values qi + 32 b .. + 32 of the query) . (key row j's block b) for j < nvalid, -inf
    for the other lanes. qw int16, qd float32 (quantize_query's); k: q8_0 (int8) or q4_0
    (uint8) blocks, key row j from byte kb + j * row bytes; hd: a literal multiple of 64.
    Each block's int32 sum is exact (|sum| <= 32 * 32767 * 128 < 2^31)."""
    if not isinstance(hd, types.IntegerLiteral) or hd.literal_value % 64:
        return None
    if not (
        _is_c_array(qw, (types.int16,))
        and _is_c_array(qd, (types.float32,))
        and _is_c_array(k, _BLOCKS)
        and _is_c_array(out, (types.float32,))
    ):
        return None
    nblk = hd.literal_value // 32
    bb = _BYTES[k.dtype]
    q8 = k.dtype == types.int8

    def codegen(context, builder, sig, args):
        b = builder
        _, qwa, qi_, qda, qdi_, ka, kb_, nv, sc, oa, oi_ = args
        idx = zip((qi_, qdi_, kb_, oi_, nv), (sig.args[i] for i in (2, 4, 6, 10, 7)))
        qi_, qdi_, kb_, oi_, nv = (context.cast(b, v, t, types.int64) for v, t in idx)
        qwd = context.make_array(sig.args[1])(context, b, qwa).data
        qdd = context.make_array(sig.args[3])(context, b, qda).data
        qv, qs = [], []
        for c in range(2 * nblk):
            p = b.gep(qwd, [b.add(qi_, ir.Constant(_I64, 16 * c))])
            qv.append(b.load(b.bitcast(p, _V16I16.as_pointer()), align=2))
        for blk in range(nblk):
            qs.append(b.load(b.gep(qdd, [b.add(qdi_, ir.Constant(_I64, blk))])))
        base = _data(context, b, sig.args[5], ka)
        last = b.sub(nv, ir.Constant(_I64, 1))
        v2 = ir.VectorType(ir.FloatType(), 2)
        halves = ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8)
        both = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
        accs = []
        for j in range(16):
            jc = ir.Constant(_I64, j)
            row = b.select(b.icmp_signed("<", jc, nv), jc, last)
            at = b.add(kb_, b.mul(row, ir.Constant(_I64, nblk * bb)))
            acc = None
            for pair in range(0, nblk, 2):
                sums, scales = [], ir.Constant(v2, None)
                for i, blk in enumerate((pair, pair + 1)):
                    bat = b.add(at, ir.Constant(_I64, blk * bb))
                    d, lo, hi = _block_words(b, base, bat, q8)
                    s = b.add(_madd(b, lo, qv[2 * blk]), _madd(b, hi, qv[2 * blk + 1]))
                    sums.append(s)
                    scales = b.insert_element(scales, b.fmul(d, qs[blk]), ir.Constant(_I32, i))
                f = b.sitofp(b.shuffle_vector(sums[0], sums[1], both), _V16F)
                dv = b.shuffle_vector(scales, scales, halves)
                p = b.fmul(f, dv, flags=("contract",))
                acc = p if acc is None else b.fadd(acc, p, flags=("contract",))
            accs.append(acc)
        store_scores16(context, b, sig.args[9], oa, oi_, accs, sc, nv)
        return context.get_dummy_value()

    sig = types.none(hd, qw, qi, qd, qdi, k, kb, nvalid, types.float32, out, oi)
    return sig, codegen


def _block(builder, base, at, q8):
    """IR: (scale, values 0..15, values 16..31) of the block at byte `at` of base: the
    scale as float, the values as <16 x float> integers (q8_0: its bytes; q4_0: the
    nibbles minus 8, value j in byte j's low nibble, value j + 16 in its high one)."""
    b = builder
    hp = b.bitcast(b.gep(base, [at]), _I16.as_pointer())
    d = b.fpext(b.bitcast(b.load(hp, align=1), ir.HalfType()), ir.FloatType())
    qp = b.gep(base, [b.add(at, ir.Constant(_I64, 2))])
    if q8:
        lo = b.load(b.bitcast(qp, _V16I8.as_pointer()), align=1)
        hp2 = b.gep(base, [b.add(at, ir.Constant(_I64, 18))])
        hi = b.load(b.bitcast(hp2, _V16I8.as_pointer()), align=1)
    else:
        x = b.load(b.bitcast(qp, _V16I8.as_pointer()), align=1)
        eight = ir.Constant(_V16I8, [8] * 16)
        lo = b.sub(b.and_(x, ir.Constant(_V16I8, [15] * 16)), eight)
        hi = b.sub(b.lshr(x, ir.Constant(_V16I8, [4] * 16)), eight)
    return d, b.sitofp(lo, _V16F), b.sitofp(hi, _V16F)


@intrinsic
def scores16_blocks(typingctx, hd, q, qi, k, kb, nvalid, scale, out, oi):
    """out.flat[oi:oi+16] = scale * q.flat[qi:qi+hd] . (key row j: the hd / 32 blocks
    from byte kb + j * row bytes of k) for j < nvalid, -inf for the other lanes (their
    rows are not read). k: q8_0 (int8) or q4_0 (uint8) blocks; hd: a literal multiple of
    32; q, out: C-contiguous float32. Each key: sum over blocks of scale_b * (q_b . v_b)."""
    if not isinstance(hd, types.IntegerLiteral) or hd.literal_value % 32:
        return None
    if not (
        _is_c_array(q, (types.float32,))
        and _is_c_array(k, _BLOCKS)
        and _is_c_array(out, (types.float32,))
    ):
        return None
    nblk = hd.literal_value // 32
    bb = _BYTES[k.dtype]
    q8 = k.dtype == types.int8

    def codegen(context, builder, sig, args):
        b = builder
        _, qa, qi_, ka, kb_, nv, sc, oa, oi_ = args
        idx = zip((qi_, kb_, oi_, nv), (sig.args[i] for i in (2, 4, 8, 5)))
        qi_, kb_, oi_, nv = (context.cast(b, v, t, types.int64) for v, t in idx)
        qv = [
            _load16(context, b, sig.args[1], qa, b.add(qi_, ir.Constant(_I64, 16 * c)))
            for c in range(2 * nblk)
        ]
        base = _data(context, b, sig.args[3], ka)
        last = b.sub(nv, ir.Constant(_I64, 1))
        accs = []
        for j in range(16):
            jc = ir.Constant(_I64, j)
            row = b.select(b.icmp_signed("<", jc, nv), jc, last)
            at = b.add(kb_, b.mul(row, ir.Constant(_I64, nblk * bb)))
            acc = None
            for blk in range(nblk):
                d, lo, hi = _block(b, base, b.add(at, ir.Constant(_I64, blk * bb)), q8)
                p = b.fmul(qv[2 * blk], lo, flags=("contract",))
                p = b.fadd(p, b.fmul(qv[2 * blk + 1], hi, flags=("contract",)), flags=("contract",))
                p = b.fmul(p, _splat16(b, d), flags=("contract",))
                acc = p if acc is None else b.fadd(acc, p, flags=("contract",))
            accs.append(acc)
        store_scores16(context, b, sig.args[7], oa, oi_, accs, sc, nv)
        return context.get_dummy_value()

    sig = types.none(hd, q, qi, k, kb, nvalid, types.float32, out, oi)
    return sig, codegen


def _block_axpy(context, b, accs, ws, v_type, va, at):
    """IR: accs[2 h], accs[2 h + 1] (values 0..15, 16..31) += ws[h] * (the block at byte
    `at` of va), the block's values converted once for every head h."""
    d, lo, hi = _block(b, _data(context, b, v_type, va), at, q8=v_type.dtype == types.int8)
    for h, w in enumerate(ws):
        wd = _splat16(b, b.fmul(w, d))
        for acc, x in ((accs[2 * h], lo), (accs[2 * h + 1], hi)):
            p = _acc_ptr(b, acc)
            prod = b.fmul(wd, x, flags=("contract",))
            b.store(b.fadd(b.load(p, align=4), prod, flags=("contract",)), p, align=4)


@intrinsic
def block_axpy2(typingctx, a0, a1, b0, b1, wa, wb, v, at):
    """a0, a1 (values 0..15, 16..31) += wa * (the block at byte `at` of v); b0, b1 the
    same with wb: two heads' weighted sums take one block, converted once. a*, b*:
    stack16() accumulators; v: q8_0 (int8) or q4_0 (uint8) blocks, C-contiguous."""
    if not _is_c_array(v, _BLOCKS):
        return None

    def codegen(context, builder, sig, args):
        at_ = context.cast(builder, args[7], sig.args[7], types.int64)
        _block_axpy(context, builder, args[:4], args[4:6], sig.args[6], args[6], at_)
        return context.get_dummy_value()

    return types.none(a0, a1, b0, b1, types.float32, types.float32, v, at), codegen


@intrinsic
def block_axpy3(typingctx, a0, a1, b0, b1, c0, c1, wa, wb, wc, v, at):
    """block_axpy2 for three heads (c0, c1 += wc * the block): a GQA group of 3 or 6
    converts each value block once a pass where pairs convert it group / 2 times (12 of
    AVX2's 16 vector registers hold the accumulators)."""
    if not _is_c_array(v, _BLOCKS):
        return None

    def codegen(context, builder, sig, args):
        at_ = context.cast(builder, args[10], sig.args[10], types.int64)
        _block_axpy(context, builder, args[:6], args[6:9], sig.args[9], args[9], at_)
        return context.get_dummy_value()

    f32 = types.float32
    return types.none(a0, a1, b0, b1, c0, c1, f32, f32, f32, v, at), codegen
