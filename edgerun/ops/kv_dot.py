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

The query stays float32 (it is not rounded to int8): the scores are the float products
of the query with the blocks' exact values, so they agree with the dequantised
reference to float rounding.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgerun.ops._simd import _V16F, _acc_ptr, _is_c_array, _load16, _splat16, store_scores16

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V16I8 = ir.VectorType(_I8, 16)
_BLOCKS = (types.int8, types.uint8)  # q8_0, q4_0 (kv_blocks: the array's element type)
_BYTES = {types.int8: 34, types.uint8: 18}


def _data(context, builder, aryty, ary):
    """An i8* to the array's first element (its elements are bytes)."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(data, _I8.as_pointer())


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


@intrinsic
def block_axpy2(typingctx, a0, a1, b0, b1, wa, wb, v, at):
    """a0, a1 (values 0..15, 16..31) += wa * (the block at byte `at` of v); b0, b1 the
    same with wb: two heads' weighted sums take one block, converted once. a*, b*:
    stack16() accumulators; v: q8_0 (int8) or q4_0 (uint8) blocks, C-contiguous."""
    if not _is_c_array(v, _BLOCKS):
        return None
    q8 = v.dtype == types.int8

    def codegen(context, builder, sig, args):
        b = builder
        acc0, acc1, acc2, acc3, wa_, wb_, va, at_ = args
        at_ = context.cast(b, at_, sig.args[7], types.int64)
        d, lo, hi = _block(b, _data(context, b, sig.args[6], va), at_, q8)
        for acc, w, x in ((acc0, wa_, lo), (acc1, wa_, hi), (acc2, wb_, lo), (acc3, wb_, hi)):
            p = _acc_ptr(b, acc)
            wd = _splat16(b, b.fmul(w, d))
            prod = b.fmul(wd, x, flags=("contract",))
            b.store(b.fadd(b.load(p, align=4), prod, flags=("contract",)), p, align=4)
        return context.get_dummy_value()

    return types.none(a0, a1, b0, b1, types.float32, types.float32, v, at), codegen
