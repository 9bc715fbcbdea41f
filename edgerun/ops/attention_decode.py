"""Decode attention: one new query token per sequence against its KV cache, split over
the cache's positions and grouped by KV head.

The one-row kernel (attention._attend_row) scores each (query head, key) with a 16-lane
multiply-add chain and a horizontal sum, takes the softmax's exponentials one libm call
at a time, and has every query head of a GQA group read the group's keys and values
again: at a 1,000-token context, over a third of a SmolLM2-135M decode step.
Here a job is (sequence, KV head, chunk of CHUNK positions):

- the group's query heads score 16 keys at a time (`scores16`): one 16-lane product
  per key and 16 columns, then a transpose-and-add tree turns the 16 keys' lanes into
  one vector of 16 scores (15 adds, 30 shuffles, instead of a 4-level sum per key); the
  16 key rows stay in L1 while every head of the group scores them;
- the softmax's exponentials run 16 lanes at a time (_simd.exp_shift16);
- each head's weighted sum of the chunk's values runs 64 columns at a time;
- the chunks' partial results (max, sum, unnormalised output) are merged per head as in
  flash-decoding, so a long context spreads over every thread even when a model has one
  or two KV heads.

Chunks are cut from each sequence's own attended range, so a sequence's result does not
depend on which others share the step: batched decode equals single decode bit for bit.
Head sizes 64, 128 and 256 take it (`supports`).

Keys and values are addressed in values (position * head_dim + column) whatever the
cache holds: f32 and f16 rows are read in place; q8_0 / q4_0 blocks (ops/kv_blocks.py)
are read in place too (ops/kv_dot.py): keys scored in int16 multiply-adds against the
job's query rounded to int16 where the CPU has an int8 dot, else in float; value blocks
widened in registers, once for two or three heads of the group.
Those blocks hold rotated rows (kv_blocks: R k, R v): the query is rotated once before
the jobs and the merged output turned back once after them.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from edgerun.ops._simd import (
    _is_c_array,
    _load16,
    axpy16,
    exp_shift16,
    max16,
    stack16,
    store16,
    store_scores16,
    vsum16,
    zero16,
)
from edgerun.ops.kv_blocks import (
    BLOCK,
    BLOCK_BYTES,
    rotated_queries,
    scratch,
    unrotate_output,
    values,
)
from edgerun.ops.kv_dot import (
    INT_DOT,
    block_axpy2,
    block_axpy3,
    quantize_query,
    scores16_blocks,
    scores16_iblocks,
)

CHUNK = 256  # most positions a job scores (a multiple of 16)
JOBS = 8  # fewest jobs a sequence is cut into, where each gets MIN_CHUNK positions
MIN_CHUNK = 32
_I32, _I64 = ir.IntType(32), ir.IntType(64)
HEAD_DIMS = (64, 128, 256)  # each compiles its own copy; others take the one-row kernel


def supports(head_dim: int) -> bool:
    """Whether this kernel takes a head size (every registry model's does)."""
    return head_dim in HEAD_DIMS


@njit(inline="always")
def takes(head_dim):
    """`supports` inside compiled code (token_step, attention's batched rows)."""
    return head_dim in HEAD_DIMS


@intrinsic
def scores16(typingctx, hd, q, qi, k, ki, nvalid, scale, out, oi):
    """out.flat[oi:oi+16] = scale * q.flat[qi:qi+hd] . k row j (the hd elements at
    k.flat[ki + j hd]) for j < nvalid, -inf for the other lanes (their rows are not
    read). hd: a literal multiple of 16; q, out: C-contiguous float32; k: float32 or fp16
    bits."""
    if not isinstance(hd, types.IntegerLiteral) or hd.literal_value % 16:
        return None
    if not (
        _is_c_array(q, (types.float32,)) and _is_c_array(k) and _is_c_array(out, (types.float32,))
    ):
        return None
    n16 = hd.literal_value // 16

    def codegen(context, builder, sig, args):
        b = builder
        _, qa, qi_, ka, ki_, nv, sc, oa, oi_ = args
        idx = zip((qi_, ki_, oi_, nv), (sig.args[i] for i in (2, 4, 8, 5)))
        qi_, ki_, oi_, nv = (context.cast(b, v, t, types.int64) for v, t in idx)
        qv = [
            _load16(context, b, sig.args[1], qa, b.add(qi_, ir.Constant(_I64, 16 * c)))
            for c in range(n16)
        ]
        last = b.sub(nv, ir.Constant(_I64, 1))
        accs = []
        for j in range(16):
            jc = ir.Constant(_I64, j)
            row = b.select(b.icmp_signed("<", jc, nv), jc, last)
            base = b.add(ki_, b.mul(row, ir.Constant(_I64, hd.literal_value)))
            acc = None
            for c in range(n16):
                kv = _load16(context, b, sig.args[3], ka, b.add(base, ir.Constant(_I64, 16 * c)))
                p = b.fmul(qv[c], kv, flags=("contract",))
                acc = p if acc is None else b.fadd(acc, p, flags=("contract",))
            accs.append(acc)
        store_scores16(context, b, sig.args[7], oa, oi_, accs, sc, nv)
        return context.get_dummy_value()

    sig = types.none(hd, q, qi, k, ki, nvalid, types.float32, out, oi)
    return sig, codegen


@njit(inline="always")
def _softmax_chunk(sc, s0, nk):
    """sc[s0:s0 + nk] = e^(s - max) over the chunk's scores (the lanes after nk up to a
    multiple of 16 hold -inf and come out 0, below SOFTMAX_FLUSH); returns (max, sum)."""
    acc = stack16()
    accv = numba.carray(acc, 16)
    for j in range(16):
        accv[j] = sc[s0 + j]
    for t in range(16, nk, 16):
        max16(acc, sc, s0 + t)
    m = np.float32(-np.inf)
    for j in range(16):
        m = max(m, accv[j])
    zero16(acc)
    for t in range(0, nk, 16):
        exp_shift16(acc, sc, s0 + t, m)
    return m, vsum16(acc)


@njit(inline="always")
def weighted_rows(o, oi, p, pi, v, vi, nk, stride, cols, inv):
    """o.flat[oi:oi + cols] = inv * sum_t p[pi + t] v.flat[vi + t stride : + cols] for
    t < nk (cols a multiple of 16), 64 columns at a time (four 16-lane chains in
    registers), then 16; every column sums over t in order."""
    a0, a1, a2, a3 = stack16(), stack16(), stack16(), stack16()
    c = 0
    while c + 64 <= cols:
        zero16(a0)
        zero16(a1)
        zero16(a2)
        zero16(a3)
        for t in range(nk):
            w = p[pi + t]
            base = vi + t * stride + c
            axpy16(a0, w, v, base)
            axpy16(a1, w, v, base + 16)
            axpy16(a2, w, v, base + 32)
            axpy16(a3, w, v, base + 48)
        store16(o, oi + c, a0, inv)
        store16(o, oi + c + 16, a1, inv)
        store16(o, oi + c + 32, a2, inv)
        store16(o, oi + c + 48, a3, inv)
        c += 64
    while c < cols:
        zero16(a0)
        for t in range(nk):
            axpy16(a0, p[pi + t], v, vi + t * stride + c)
        store16(o, oi + c, a0, inv)
        c += 16


@njit(inline="always")
def _weighted_rows2(o, oa, ob, p, pa, pb, v, vi, nk, hd):
    """weighted_rows for two heads at once: each value row loaded once for both, and
    eight independent 16-lane chains (four leave the FMA units waiting on latency)."""
    a0, a1, a2, a3 = stack16(), stack16(), stack16(), stack16()
    b0, b1, b2, b3 = stack16(), stack16(), stack16(), stack16()
    one = np.float32(1.0)
    for c in range(0, hd, 64):
        for a in (a0, a1, a2, a3, b0, b1, b2, b3):
            zero16(a)
        for t in range(nk):
            wa, wb = p[pa + t], p[pb + t]
            base = vi + t * hd + c
            axpy16(a0, wa, v, base)
            axpy16(b0, wb, v, base)
            axpy16(a1, wa, v, base + 16)
            axpy16(b1, wb, v, base + 16)
            axpy16(a2, wa, v, base + 32)
            axpy16(b2, wb, v, base + 32)
            axpy16(a3, wa, v, base + 48)
            axpy16(b3, wb, v, base + 48)
        store16(o, oa + c, a0, one)
        store16(o, oa + c + 16, a1, one)
        store16(o, oa + c + 32, a2, one)
        store16(o, oa + c + 48, a3, one)
        store16(o, ob + c, b0, one)
        store16(o, ob + c + 16, b1, one)
        store16(o, ob + c + 32, b2, one)
        store16(o, ob + c + 48, b3, one)


def _score_keys(HD, q, qb, group, kf, kr, nk, chunk, scale, sc):
    """sc[g * chunk + t] = scale * (head qb / hd + g of flat q) . key kr / hd + t of kf,
    for t < nk (then -inf up to a multiple of 16)."""


@overload(_score_keys, inline="always", prefer_literal=True)
def _score_keys_impl(HD, q, qb, group, kf, kr, nk, chunk, scale, sc):
    if (
        kf.dtype in (types.int8, types.uint8)
        and INT_DOT
        and getattr(HD, "literal_value", 1) % 64 == 0
    ):
        bb = BLOCK_BYTES[np.dtype(kf.dtype.name)]

        def int_blocks(HD, q, qb, group, kf, kr, nk, chunk, scale, sc):
            hd = HD
            nb = hd // BLOCK
            rb = nb * bb  # a row's bytes
            kb = kr // BLOCK * bb
            qw = np.empty(group * hd, np.int16)
            qd = np.empty(group * nb, np.float32)
            for g in range(group):
                quantize_query(q, qb + g * hd, hd, qw[g * hd :], qd[g * nb :])
            for tb in range(0, nk, 16):
                nv = min(16, nk - tb)
                for g in range(group):
                    scores16_iblocks(HD, qw, g * hd, qd, g * nb, kf, kb + tb * rb, nv, scale,
                                     sc, g * chunk + tb)  # fmt: skip

        return int_blocks
    if kf.dtype in (types.int8, types.uint8):  # q8_0 / q4_0 blocks, read in place
        bb = BLOCK_BYTES[np.dtype(kf.dtype.name)]

        def blocks(HD, q, qb, group, kf, kr, nk, chunk, scale, sc):
            hd = HD
            rb = hd // BLOCK * bb  # a row's bytes
            kb = kr // BLOCK * bb
            for tb in range(0, nk, 16):
                nv = min(16, nk - tb)
                for g in range(group):
                    scores16_blocks(HD, q, qb + g * hd, kf, kb + tb * rb, nv, scale, sc,
                                    g * chunk + tb)  # fmt: skip

        return blocks

    def rows(HD, q, qb, group, kf, kr, nk, chunk, scale, sc):
        hd = HD
        kbuf = scratch(kf, 16 * hd)  # empty: f32 / f16 rows are read in place
        for tb in range(0, nk, 16):
            nv = min(16, nk - tb)
            ka, ko = values(kf, kr + tb * hd, nv * hd, kbuf)
            for g in range(group):
                scores16(HD, q, qb + g * hd, ka, ko, nv, scale, sc, g * chunk + tb)

    return rows


def _weigh_values(HD, po, o0, group, sc, chunk, vf, vr, nk):
    """po[o0 + g hd : + hd] = sum_t sc[g * chunk + t] (value row vr / hd + t of vf) for
    t < nk, each head g of the group (unnormalised)."""


@overload(_weigh_values, inline="always", prefer_literal=True)
def _weigh_values_impl(HD, po, o0, group, sc, chunk, vf, vr, nk):
    if vf.dtype in (types.int8, types.uint8):  # q8_0 / q4_0 blocks, read in place
        bb = BLOCK_BYTES[np.dtype(vf.dtype.name)]

        def blocks(HD, po, o0, group, sc, chunk, vf, vr, nk):
            hd = HD
            rb = hd // BLOCK * bb
            vb = vr // BLOCK * bb
            a0, a1, b0, b1 = stack16(), stack16(), stack16(), stack16()
            c0, c1 = stack16(), stack16()
            one = np.float32(1.0)
            if group % 3 == 0:  # three heads a pass (block_axpy3)
                for g in range(0, group, 3):
                    for blk in range(hd // BLOCK):
                        for a in (a0, a1, b0, b1, c0, c1):
                            zero16(a)
                        at = vb + blk * bb
                        for t in range(nk):
                            block_axpy3(a0, a1, b0, b1, c0, c1, sc[g * chunk + t],
                                        sc[(g + 1) * chunk + t], sc[(g + 2) * chunk + t], vf,
                                        at + t * rb)  # fmt: skip
                        c = blk * BLOCK
                        for h, x0, x1 in ((g, a0, a1), (g + 1, b0, b1), (g + 2, c0, c1)):
                            store16(po, o0 + h * hd + c, x0, one)
                            store16(po, o0 + h * hd + c + 16, x1, one)
                return
            for g in range(0, group, 2):
                h = min(g + 1, group - 1)  # an odd group's last head pairs with itself
                for blk in range(hd // BLOCK):
                    zero16(a0)
                    zero16(a1)
                    zero16(b0)
                    zero16(b1)
                    at = vb + blk * bb
                    for t in range(nk):
                        block_axpy2(a0, a1, b0, b1, sc[g * chunk + t], sc[h * chunk + t], vf,
                                    at + t * rb)  # fmt: skip
                    c = blk * BLOCK
                    store16(po, o0 + g * hd + c, a0, one)
                    store16(po, o0 + g * hd + c + 16, a1, one)
                    store16(po, o0 + h * hd + c, b0, one)
                    store16(po, o0 + h * hd + c + 16, b1, one)

        return blocks

    def rows(HD, po, o0, group, sc, chunk, vf, vr, nk):
        hd = HD
        va, vo = values(vf, vr, nk * hd, scratch(vf, chunk * hd))  # f32 / f16: in place
        for g in range(0, group - 1, 2):
            _weighted_rows2(po, o0 + g * hd, o0 + (g + 1) * hd, sc, g * chunk, (g + 1) * chunk,
                            va, vo, nk, hd)  # fmt: skip
        if group & 1:
            g = group - 1
            weighted_rows(po, o0 + g * hd, sc, g * chunk, va, vo, nk, hd, hd, np.float32(1.0))

    return rows


@njit(inline="always")
def _chunk_job(HD, q, qb, group, kf, vf, kvb, t0, nk, chunk, scale, softcap, po, pm, job):
    """Heads qb / hd .. + group of flat q against positions t0 .. t0 + nk (nk <= chunk)
    of one KV head (its rows from value kvb of kf / vf): each head's chunk max and
    exponential sum into pm[job, g], its unnormalised weighted values into po[job, g].
    softcap > 0: the scaled scores are capped (capped_score) before the softmax."""
    hd = HD
    sc = np.empty(group * chunk, np.float32)  # head g's scores at g * chunk
    kr = kvb + t0 * hd
    _score_keys(HD, q, qb, group, kf, kr, nk, chunk, scale, sc)
    if softcap > 0:
        for g in range(group):
            for t in range(g * chunk, g * chunk + nk):
                sc[t] = capped_score(sc[t], softcap)
    for g in range(group):
        m, total = _softmax_chunk(sc, g * chunk, nk)
        pm[job, g, 0] = m
        pm[job, g, 1] = total
    _weigh_values(HD, po, job * group * hd, group, sc, chunk, vf, kr, nk)


@njit(inline="always")
def _merge(po, pm, job0, nch, group, g, hd, out, oi):
    """out.flat[oi:oi + hd] = one head's softmax-weighted values from its nch chunks'
    partial results (jobs job0 .. job0 + nch - 1)."""
    m = np.float32(-np.inf)
    for c in range(nch):
        m = max(m, pm[job0 + c, g, 0])
    total = np.float32(0.0)
    w = np.empty(nch, np.float32)
    for c in range(nch):
        w[c] = np.exp(pm[job0 + c, g, 0] - m)
        total += pm[job0 + c, g, 1] * w[c]
    inv = np.float32(1.0) / total
    a = stack16()
    for col in range(0, hd, 16):
        zero16(a)
        for c in range(nch):
            axpy16(a, w[c], po, ((job0 + c) * group + g) * hd + col)
        store16(out, oi + col, a, inv)


@njit(inline="always")
def capped_score(s, softcap):
    """Attention logit softcapping (Gemma 2): softcap * tanh(s / softcap), on the scores
    after their scale and before the softmax."""
    return softcap * np.tanh(s / softcap)


@njit(inline="always")
def span(pos, window):
    """The positions a query at pos attends: [lo, pos + 1)."""
    lo = 0
    if window > 0:
        lo = max(0, pos - window + 1)
    return lo, pos + 1


@njit(inline="always")
def _chunking(length, hkv):
    """(positions a chunk, chunks) for a sequence attending `length` positions: at least
    JOBS jobs over its KV heads where chunks of MIN_CHUNK allow, chunks of at most CHUNK. It
    depends on the sequence alone (not on the batch, nor the thread count), so a row
    comes out the same in any batch on any number of threads."""
    want = max((length + CHUNK - 1) // CHUNK, (JOBS + hkv - 1) // hkv)
    chunk = (length + want - 1) // want
    chunk = min(CHUNK, max(MIN_CHUNK, (chunk + 15) // 16 * 16))
    return chunk, (length + chunk - 1) // chunk


@njit(inline="always")
def _attend_one(HD, q, kc, vc, pos, window, scale, softcap, out):
    """q [hq, hd] of one token at pos against kc, vc [hkv, n_ctx, hd] -> out [hq, hd]."""
    hq, hd = q.shape
    hkv, nctx = kc.shape[0], kc.shape[1]
    group = hq // hkv
    lo, hi = span(pos, window)
    chunk, nch = _chunking(hi - lo, hkv)
    njobs = hkv * nch
    po = np.empty(njobs * group * hd, np.float32)
    pm = np.empty((njobs, group, 2), np.float32)
    kf, vf, of = kc.reshape(-1), vc.reshape(-1), out.reshape(-1)
    qf = rotated_queries(kf, q.reshape(-1), hd)  # R q against rotated key blocks
    for job in prange(njobs):
        kh = job // nch
        t0 = lo + (job - kh * nch) * chunk
        nk = min(chunk, hi - t0)
        _chunk_job(HD, qf, kh * group * hd, group, kf, vf, kh * nctx * hd, t0, nk, chunk,
                   scale, softcap, po, pm, job)  # fmt: skip
    for h in range(hq):
        kh = h // group
        _merge(po, pm, kh * nch, nch, group, h - kh * group, hd, of, h * hd)
    unrotate_output(vf, of, hd)


@intrinsic
def cache_at(typingctx, addr, like):
    """The int64 address of a cache array's element -> a pointer of `like`'s dtype."""
    ptr = types.CPointer(like.dtype)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, like), codegen


@njit(inline="always")
def _attend_many(HD, q, klike, vlike, kaddr, vaddr, nctx, layer, starts, window, scale, softcap,
                 out):  # fmt: skip
    """q [n, hq, hd]: each sequence b's token at starts[b] against its own layer `layer`
    of the caches at kaddr[b], vaddr[b] ([layers, hkv, nctx[b], row], of klike's and
    vlike's dtype and row width) -> out [n, hq, hd]. The jobs are (sequence, KV head,
    chunk), each as _attend_one cuts them for that sequence alone."""
    n, hq, hd = q.shape
    hkv = klike.shape[1]
    kw, vw = klike.shape[2], vlike.shape[2]
    group = hq // hkv
    nch = np.empty(n, np.int64)
    chunks = np.empty(n, np.int64)
    los = np.empty(n, np.int64)
    for b in range(n):
        los[b], hi = span(starts[b], window)
        chunks[b], nch[b] = _chunking(hi - los[b], hkv)
    most = nch.max()
    per = hkv * most  # jobs a sequence may take
    njobs = n * per
    po = np.empty(njobs * group * hd, np.float32)
    pm = np.empty((njobs, group, 2), np.float32)
    qf, of = rotated_queries(klike, q.reshape(-1), hd), out.reshape(-1)
    kitem, vitem = klike.itemsize, vlike.itemsize
    for job in prange(njobs):
        b = job // per
        r = job - b * per
        kh = r // most
        c = r - kh * most
        if c < nch[b]:
            ks, vs = hkv * nctx[b] * kw, hkv * nctx[b] * vw
            kf = numba.carray(cache_at(kaddr[b] + layer * ks * kitem, klike), ks)
            vf = numba.carray(cache_at(vaddr[b] + layer * vs * vitem, vlike), vs)
            t0 = los[b] + c * chunks[b]
            _chunk_job(HD, qf, (b * hq + kh * group) * hd, group, kf, vf, kh * nctx[b] * hd,
                       t0, min(chunks[b], starts[b] + 1 - t0), chunks[b], scale, softcap, po,
                       pm, job)  # fmt: skip
    for b in range(n):
        for h in range(hq):
            kh = h // group
            j0 = b * per + kh * most
            _merge(po, pm, j0, nch[b], group, h - kh * group, hd, of, (b * hq + h) * hd)
    unrotate_output(vlike, of, hd)


@njit(cache=True, parallel=True, nogil=True)
def attend_many(q, klike, vlike, kaddr, vaddr, nctx, layer, starts, window, scale, out,
                softcap=0.0):  # fmt: skip
    """Decode attention of n sequences' tokens, each against its own cache, in one
    parallel call (ops/attention.BatchAttention's addresses; klike, vlike: arrays of the
    caches' key and value dtypes shaped [n, hkv, row]; new keys and values already
    stored) -> out [n, hq, hd]. `supports(hd)` must hold. softcap > 0: Gemma 2's logit
    softcapping."""
    hd = q.shape[2]
    cap = np.float32(softcap)
    if hd == 64:
        _attend_many(64, q, klike, vlike, kaddr, vaddr, nctx, layer, starts, window, scale,
                     cap, out)  # fmt: skip
    elif hd == 128:
        _attend_many(128, q, klike, vlike, kaddr, vaddr, nctx, layer, starts, window, scale,
                     cap, out)  # fmt: skip
    else:
        _attend_many(256, q, klike, vlike, kaddr, vaddr, nctx, layer, starts, window, scale,
                     cap, out)  # fmt: skip


# One kernel per head size, each compiling its own copy of the job loop: a model runs one
# of them, and compiling the three in one function tripled the first run's longest
# compile (SmolLM2: 22 of its 74 s of compile CPU; one head size is a third of that).
# `positions[0]` is the token's position, so a bound decode step's call (decode_step.py)
# reads the position its buffer holds without rebinding.
@njit(cache=True, parallel=True, nogil=True)
def attend_one64(q, kc, vc, positions, window, scale, out, softcap):
    _attend_one(64, q, kc, vc, positions[0], window, scale, softcap, out)


@njit(cache=True, parallel=True, nogil=True)
def attend_one128(q, kc, vc, positions, window, scale, out, softcap):
    _attend_one(128, q, kc, vc, positions[0], window, scale, softcap, out)


@njit(cache=True, parallel=True, nogil=True)
def attend_one256(q, kc, vc, positions, window, scale, out, softcap):
    _attend_one(256, q, kc, vc, positions[0], window, scale, softcap, out)


_ATTEND_ONE = {64: attend_one64, 128: attend_one128, 256: attend_one256}


def attend_one_kernel(head_dim: int):
    """The decode attention kernel of a head size `supports`: called as
    kernel(q [hq, hd], kc, vc, positions, window (int64), scale (float32), out [hq, hd],
    softcap (float32)) with the token at positions[0]."""
    return _ATTEND_ONE[head_dim]


def attend_one(
    q: np.ndarray,
    kc: np.ndarray,
    vc: np.ndarray,
    pos: int,
    window: int,
    scale: float,
    out: np.ndarray,
    softcap: float = 0.0,
) -> None:
    """Decode attention of one token: q [hq, hd] (C-contiguous float32) at position pos
    against the caches kc, vc [hkv, n_ctx, row] (float32, fp16 bits or q8_0 / q4_0
    blocks, position pos already stored) -> out [hq, hd]. `supports(hd)` must hold.
    softcap > 0: Gemma 2's logit softcapping."""
    kernel = _ATTEND_ONE[q.shape[1]]
    positions = np.array([pos], np.int64)
    kernel(q, kc, vc, positions, np.int64(window), np.float32(scale), out, np.float32(softcap))
