"""An experiment, measured and not adopted: decode matvecs of the block-32 formats
(Q4_0, Q4_1, Q5_0, Q8_0) on AMX int8 tiles, one kernel for one to eight vectors.

    python benchmarks/amx_decode.py                     # SmolLM2 and Qwen2.5-0.5B, 2 threads
    python benchmarks/amx_decode.py -m qwen2.5-coder-0.5b -t 2

Why it was tried: 4 concurrent sessions decode only ~2.1-2.3x one on a 2-vCPU Xeon (#13
asks 2.5x). The AVX-512 batched kernels (qmatvec_vnni.mvb_*) unpack a block pair once,
but every vector then costs its own dot, conversion, scale product and FMA, so a
4-vector pass costs 1.7-2.9x a one-vector pass, and 8 vectors cost twice 4.

The kernel (below): per 16 weight rows and 64 columns the A tile holds the rows' weights
as signed bytes (qmatvec_vnni's pair unpack), the B tile the vectors' single-level int8
activations (quantize_x1) block-diagonally, 8 / npad chunks side by side, so that one
TDPBSSD chain yields every (row, chunk, block, vector) integer dot; a float epilogue
scales them per 32 and a fixed-order fold sums each row's 16 slots. Every element goes
through the same float operations whatever the vector count, so a batch's rows equal the
single-vector rows bit for bit (checked below). The row tiles run as a pipeline: step s
unpacks, step s - 1's tile products run, step s - 2's epilogue reads its stored C.

Measured on the first AMX host (session 34, `benchmarks/results/amx_decode_s34.txt`), ms
for all block-format matrices of a model, VNNI / AMX, two runs:
- tile costs: TDPBSSD 7-10 ns; a 1 KB tile load 4-5 ns from a 64-byte-aligned buffer and
  18-22 ns from one 32 bytes off (Numba's allocations are 32-byte aligned: the reason
  qmatmul_amx.aligned_empty exists; the prefill GEMMs gained 5-20% from it);
- SmolLM2 (Q4_1, Q8_0 head): one vector 6.1 / 10.9 and 8.5 / 19.2, 4 vectors 15.6 / 12.9
  and 24.5 / 17.6, 8 vectors 25.0 / 18.9 and 35.5 / 24.9;
- Qwen2.5-0.5B (Q5_0, Q8_0 head): 20.8 / 31.7 and 40.8 / 55.1, 42.8 / 41.2 and
  57.5 / 53.6, 78.2 / 60.3 and 111.5 / 76.8.
One vector costs 1.3-2.3x the VNNI kernel: unpacking the weights into the A tile alone
takes about what the VNNI kernel takes in all (prep only, the Q8_0 head: 7-9 ms against
7.7). Since a batched row must equal the single-vector row, one vector would have to take
this kernel too, and single-stream decode would lose more than batches gain. Not adopted.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from edgerun import _numba_env  # noqa: E402

_numba_env.configure()

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops.qmatmul_amx import (  # noqa: E402
    _TILE_IMM,
    TILE,
    _configure_tiles,
    _i64,
    _tile_fn,
    _tile_release,
    aligned_empty,
    available,
)
from edgerun.ops.qmatvec_vnni import (  # noqa: E402
    _IR,
    F0,
    I8,
    I64,
    KIND_Q4_0,
    KIND_Q4_1,
    KIND_Q5_0,
    KIND_Q8_0,
    V16F,
    V16I32,
    _prefetch_ahead,
    _store,
    _unpack_q4_0,
    _unpack_q4_1,
    _unpack_q5_0,
    _unpack_q8_0,
    _v,
    quantize_x1,
)

MAX_VECTORS = 8  # columns of C: 2 blocks x 8 vectors fill a 64-byte tile row
CHUNK = 64  # columns per tile product (two blocks of 32)
# row-tile parts a call splits into (each with its own scratch), at most one a tile: a
# constant, as numba.get_num_threads() inside a kernel keeps it out of the disk cache
PARTS = 16
V32F = _v(ir.FloatType(), 32)


# ------------------------------------------------------------------ weights -> A
def _prep_intrinsic(unpack, nbytes, shift, name):
    """U[uo:uo+64] = a block pair's weights at flat[off] as signed bytes (unpack's u8
    minus `shift`), DM[dmo:dmo+4] = its [d_a, m_a, d_b, m_b] (or [d_a, d_a, d_b, d_b])."""

    def prep(typingctx, U, uo, flat, off, DM, dmo):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            _prefetch_ahead(r, args[3], nbytes)
            w, dm, _ = unpack(r, args[3])
            if shift:
                w = builder.sub(w, r.splat_i8(64, shift))
            _store(r, 0, args[1], w)
            _store(r, 4, args[5], dm)
            return context.get_dummy_value()

        return types.void(U, uo, flat, off, DM, dmo), codegen

    prep.__name__ = name
    return intrinsic(prep)


prep_q4_0 = _prep_intrinsic(_unpack_q4_0, 36, 8, "prep_q4_0")
prep_q4_1 = _prep_intrinsic(_unpack_q4_1, 40, 0, "prep_q4_1")
prep_q5_0 = _prep_intrinsic(_unpack_q5_0, 44, 16, "prep_q5_0")
prep_q8_0 = _prep_intrinsic(_unpack_q8_0, 68, 128, "prep_q8_0")


@njit(inline="always")
def _pair_bytes(kind):
    if kind == KIND_Q4_0:
        return 36
    if kind == KIND_Q4_1:
        return 40
    if kind == KIND_Q5_0:
        return 44
    return 68


@njit(inline="always")
def _prep(kind, U, uo, flat, off, DM, dmo):
    if kind == KIND_Q4_0:
        prep_q4_0(U, uo, flat, off, DM, dmo)
    elif kind == KIND_Q4_1:
        prep_q4_1(U, uo, flat, off, DM, dmo)
    elif kind == KIND_Q5_0:
        prep_q5_0(U, uo, flat, off, DM, dmo)
    else:
        prep_q8_0(U, uo, flat, off, DM, dmo)


# ------------------------------------------------------------------ tiles
@intrinsic
def tile_zero(typingctx, ct):
    if not isinstance(ct, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        builder.call(_tile_fn(r, "tilezero", [I8]), [_TILE_IMM[ct.literal_value]])
        return context.get_dummy_value()

    return types.void(ct), codegen


@intrinsic
def tile_chunk(typingctx, U, uo, ustride, B, bo, ct, ab):
    """C tile ct += the A tile at U[uo:] (rows ustride bytes apart) times the B tile at
    B[bo:] (16 rows of 64 bytes), through A tile 2 + ab and B tile 4 + ab."""
    if not isinstance(ct, types.IntegerLiteral) or not isinstance(ab, types.IntegerLiteral):
        return None
    c, k = ct.literal_value, ab.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        p8 = I8.as_pointer()
        load = _tile_fn(r, "tileloadd64", [I8, p8, I64])
        t = _TILE_IMM
        builder.call(load, [t[2 + k], r.ptr(0, args[1], I8), _i64(builder, args[2])])
        builder.call(load, [t[4 + k], r.ptr(3, args[4], I8), ir.Constant(I64, CHUNK)])
        builder.call(_tile_fn(r, "tdpbssd", [I8, I8, I8]), [t[c], t[2 + k], t[4 + k]])
        return context.get_dummy_value()

    return types.void(U, uo, ustride, B, bo, ct, ab), codegen


@intrinsic
def tile_store(typingctx, C, co, ct):
    """C[co:co + 256] (int32 16 x 16) = C tile ct."""
    if not isinstance(ct, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        store = _tile_fn(r, "tilestored64", [I8, I8.as_pointer(), I64])
        p = r.ptr(0, args[1], I8)
        builder.call(store, [_TILE_IMM[ct.literal_value], p, ir.Constant(I64, CHUNK)])
        return context.get_dummy_value()

    return types.void(C, co, ct), codegen


def _lane_scales(npv):
    """Lane l of a C row -> index of its d in the row's [d_a, m_a, d_b, m_b] per chunk of
    the group (lane l is chunk l // 2 npad, block (l // npad) % 2, vector l % npad)."""
    return [(lane // (2 * npv)) * 4 + 2 * ((lane // npv) % 2) for lane in range(16)]


@intrinsic
def epilogue(typingctx, C, co, DM, dmo, XP, SP, xo, acc, ao, npad, bias):
    """For the 16 rows k of a group's C (int32 [16, 16] at C[co:]): acc[ao + 16 npad k:]
    += float(C row) * d * XP[xo:] (+ m * SP[xo:] where bias), d and m of the row's chunks
    at DM[dmo + 32 k / npad:] spread over the lanes (see _lane_scales)."""
    if not isinstance(npad, types.IntegerLiteral) or not isinstance(bias, types.BooleanLiteral):
        return None
    npv, with_bias = npad.literal_value, bias.literal_value
    idx = _lane_scales(npv)

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        co, dmo, xo, ao = args[1], args[3], args[6], args[8]
        xp = r.load(4, xo, V16F)
        sp = r.load(5, xo, V16F) if with_bias else None
        for k in range(TILE):
            c = r.load(0, b.add(co, ir.Constant(co.type, 16 * k)), V16I32)
            dmw = r.load(2, b.add(dmo, ir.Constant(dmo.type, 32 * k // npv)), V32F)
            s = b.fmul(r.shuf(dmw, dmw, idx), xp)
            at = b.add(ao, ir.Constant(ao.type, 16 * npv * k))
            a = r.fma(b.sitofp(c, V16F), s, r.load(7, at, V16F))
            if with_bias:
                a = r.fma(r.shuf(dmw, dmw, [i + 1 for i in idx]), sp, a)
            _store(r, 7, at, a)
        return context.get_dummy_value()

    return types.void(C, co, DM, dmo, XP, SP, xo, acc, ao, npad, bias), codegen


@intrinsic
def fold_slots(typingctx, acc, res, npad):
    """res[npad r + v] = the sum of row r's 16 slots of vector v in acc (acc[16 npad r +
    npad s + v] for slot s), for the 16 rows, as the same tree whatever npad is:
    (s, s + 8), then (s, s + 4), (s, s + 2), (s, s + 1), so a row's value does not depend
    on how many vectors shared the tiles."""
    if not isinstance(npad, types.IntegerLiteral):
        return None
    npv = npad.literal_value
    nz = npv  # zmm per row: slot s of vector v at lane (npad s + v) % 16 of zmm npad s // 16

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        for row in range(TILE):
            z = [r.load(0, ir.Constant(I64, 16 * (npv * row + q)), V16F) for q in range(nz)]
            width = 16  # slots still to fold
            while width > 1:
                half = width // 2
                if len(z) > 1:  # slot s + half is in zmm q + len(z) / 2, same lane
                    h = len(z) // 2
                    z = [b.fadd(z[q], z[q + h]) for q in range(h)]
                else:  # within the zmm: lanes npad s + v and npad (s + half) + v
                    k = half * npv
                    z = [b.fadd(z[0], r.shuf(z[0], z[0], [(lane + k) % 16 for lane in range(16)]))]
                width = half
            out = r.shuf(z[0], z[0], list(range(npv)))
            _store(r, 1, ir.Constant(I64, npv * row), out)
        return context.get_dummy_value()

    return types.void(acc, res, npad), codegen


@njit(inline="always")
def _fold(acc, res, npad):
    if npad == 1:
        fold_slots(acc, res, 1)
    elif npad == 2:
        fold_slots(acc, res, 2)
    elif npad == 4:
        fold_slots(acc, res, 4)
    else:
        fold_slots(acc, res, 8)


@njit(inline="always")
def _epi(bias, C, co, DM, dmo, XP, SP, xo, acc, ao, npad):
    if bias:
        if npad == 1:
            epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 1, True)
        elif npad == 2:
            epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 2, True)
        elif npad == 4:
            epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 4, True)
        else:
            epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 8, True)
    elif npad == 1:
        epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 1, False)
    elif npad == 2:
        epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 2, False)
    elif npad == 4:
        epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 4, False)
    else:
        epilogue(C, co, DM, dmo, XP, SP, xo, acc, ao, 8, False)


@njit(inline="always")
def _tiles(U, uo, ustride, B, bo, C, co, ct, nchunks):
    """One group: C tile ct = sum over its nchunks chunks, stored to C[co:]."""
    if ct == 0:
        tile_zero(0)
        for g in range(nchunks):
            if g % 2 == 0:
                tile_chunk(U, uo + CHUNK * g, ustride, B, bo + 1024 * g, 0, 0)
            else:
                tile_chunk(U, uo + CHUNK * g, ustride, B, bo + 1024 * g, 0, 1)
        tile_store(C, co, 0)
    else:
        tile_zero(1)
        for g in range(nchunks):
            if g % 2 == 0:
                tile_chunk(U, uo + CHUNK * g, ustride, B, bo + 1024 * g, 1, 0)
            else:
                tile_chunk(U, uo + CHUNK * g, ustride, B, bo + 1024 * g, 1, 1)
        tile_store(C, co, 1)


# ------------------------------------------------------------------ activations -> B
@njit(inline="always")
def padded_vectors(n):
    """Vectors per chunk in B and C: n rounded up to 1, 2, 4 or 8, so that a C row's 16
    lanes hold 8 / npad chunks x 2 blocks x npad vectors."""
    if n <= 2:
        return n
    return 4 if n <= 4 else 8


@njit(cache=False, nogil=True)
def activation_tiles(X, nib2):
    """X [n <= 8, cols] (cols % 64 == 0) -> B uint8 [nch, 16, 16, 4]: per chunk the B
    tile, quantize_x1's bytes of block j of vector v in column (ch % G, j, v) of the rows
    that meet block j (G = 8 / npad chunks a group), zero elsewhere; XP and SP float32
    [groups, 16]: dx and dx sum(q) of each lane's (chunk, block, vector), zero for
    padding vectors and chunks."""
    n, cols = X.shape
    npad = padded_vectors(n)
    per = 8 // npad
    nch = cols // CHUNK
    ngroups = (nch + per - 1) // per
    nb = cols // 32
    xq = np.empty(n * cols, np.int8)
    xds = np.empty(n * 2 * nb, np.float32)
    for v in range(n):
        quantize_x1(
            X[v], nib2, xq[v * cols : (v + 1) * cols], xds[v * 2 * nb : (v + 1) * 2 * nb], 32
        )
    words = xq.view(np.int32)
    B = aligned_empty(nch * 256, np.int32)
    B[:] = 0
    for v in range(n):
        for ch in range(nch):
            g = ch % per
            for q in range(16):  # B row q: bytes 4q..4q+3 of the chunk
                j = (q // 4) % 2 if nib2 else q // 8
                B[ch * 256 + q * 16 + (2 * g + j) * npad + v] = words[(v * cols) // 4 + ch * 16 + q]
    XP = np.zeros(ngroups * 16, np.float32)
    SP = np.zeros(ngroups * 16, np.float32)
    for grp in range(ngroups):
        for lane in range(16):
            ch = grp * per + lane // (2 * npad)
            j = (lane // npad) % 2
            v = lane % npad
            if v < n and ch < nch:
                XP[grp * 16 + lane] = xds[v * 2 * nb + 2 * (2 * ch + j)]
                SP[grp * 16 + lane] = xds[v * 2 * nb + 2 * (2 * ch + j) + 1]
    return B.view(np.uint8), XP, SP


# ------------------------------------------------------------------ kernel
@njit(inline="always")
def _prep_step(kind, d, tt, c0, nc, per, pb, U, uo, gbytes, DM, dmo):
    """Unpack chunks c0..c0+nc of row tile tt of matrix d (uint8 [rows, row bytes]) into
    U[uo:] (16 rows gbytes apart) and their scales into DM[dmo:] (4 per chunk, 4 per
    chunk of the group per row). A group's missing chunks keep their stale scales, finite
    numbers from earlier chunks or the zeros DM starts with: their C, XP and SP are 0."""
    flat = d.reshape(-1)
    rb = d.shape[1]
    nr = min(TILE, d.shape[0] - tt * TILE)
    for r in range(nr):
        base = (tt * TILE + r) * rb + c0 * pb
        for g in range(nc):
            _prep(
                kind,
                U,
                uo + r * gbytes + g * CHUNK,
                flat,
                base + g * pb,
                DM,
                dmo + r * 4 * per + 4 * g,
            )


@njit(inline="always")
def _write_rows(o, tt, res, npad):
    """Rows of row tile tt of o [n, rows] from res [16, npad]."""
    n = o.shape[0]
    for r in range(min(TILE, o.shape[1] - tt * TILE)):
        for v in range(n):
            o[v, tt * TILE + r] = res[r * npad + v]


@njit(inline="always")
def _mva(kind, d0, d1, d2, X, o0, o1, o2, nparts):
    """o_k[v] = W_k @ X[v] for up to three matrices of one format sharing X [n <= 8,
    cols % 64 == 0] (unused slots: 0-row arrays); row tiles in nparts parts.

    A part runs its (row tile, chunk group) steps as a pipeline: step s unpacks its
    weights while step s - 1's tile products run and step s - 2's epilogue reads the C
    tiles stored a step before, so no tile load waits on the stores that just wrote it."""
    n, cols = X.shape
    npad = padded_vectors(n)
    per = 8 // npad  # chunks a group
    nch = cols // CHUNK
    ngroups = (nch + per - 1) // per
    gbytes = CHUNK * per
    bias = kind == KIND_Q4_1
    B, XP, SP = activation_tiles(X, kind != KIND_Q8_0)
    pb = _pair_bytes(kind)
    t0 = (d0.shape[0] + TILE - 1) // TILE
    t1 = (d1.shape[0] + TILE - 1) // TILE
    ntiles = t0 + t1 + (d2.shape[0] + TILE - 1) // TILE
    nparts = max(1, min(nparts, ntiles))
    # scratch for all parts, allocated once (allocations in the parallel loop cost a small
    # matrix more than its products)
    ulen, dlen, alen = 2 * TILE * gbytes, 3 * 4 * TILE * per + 32, 16 * npad * TILE
    U_all = aligned_empty(nparts * ulen, np.int8)
    DM_all = np.empty(nparts * dlen, np.float32)
    C_all = aligned_empty(nparts * 512, np.int32)
    acc_all = np.zeros(nparts * alen, np.float32)
    for p in prange(nparts):
        U = U_all[p * ulen : (p + 1) * ulen]
        DM = DM_all[p * dlen : (p + 1) * dlen]
        C = C_all[p * 512 : (p + 1) * 512]
        acc = acc_all[p * alen : (p + 1) * alen]
        res = np.empty(TILE * npad, np.float32)
        DM[:] = F0
        _configure_tiles()
        tb = p * ntiles // nparts
        steps = ((p + 1) * ntiles // nparts - tb) * ngroups
        for i in range(steps + 2):
            if i < steps:  # unpack step i's weights: 16 rows x its chunks
                t = tb + i // ngroups
                c0 = (i % ngroups) * per
                nc = min(per, nch - c0)
                uo, dmo = (i % 2) * TILE * gbytes, (i % 3) * 4 * TILE * per
                if t < t0:
                    _prep_step(kind, d0, t, c0, nc, per, pb, U, uo, gbytes, DM, dmo)
                elif t < t0 + t1:
                    _prep_step(kind, d1, t - t0, c0, nc, per, pb, U, uo, gbytes, DM, dmo)
                else:
                    _prep_step(kind, d2, t - t0 - t1, c0, nc, per, pb, U, uo, gbytes, DM, dmo)
            if 1 <= i <= steps:  # tile products of step i - 1
                s = i - 1
                c0 = (s % ngroups) * per
                nc = min(per, nch - c0)
                _tiles(
                    U, (s % 2) * TILE * gbytes, gbytes, B, c0 * 1024, C, (s % 2) * 256, s % 2, nc
                )
            if i >= 2:  # epilogue of step i - 2
                s = i - 2
                grp = s % ngroups
                ao = (grp % npad) * 16
                dmo = (s % 3) * 4 * TILE * per
                _epi(bias, C, (s % 2) * 256, DM, dmo, XP, SP, grp * 16, acc, ao, npad)
                if grp == ngroups - 1:  # the row tile's last group: out = sum of 16 slots
                    t = tb + s // ngroups
                    _fold(acc, res, npad)
                    if t < t0:
                        _write_rows(o0, t, res, npad)
                    elif t < t0 + t1:
                        _write_rows(o1, t - t0, res, npad)
                    else:
                        _write_rows(o2, t - t0 - t1, res, npad)
                    acc[:] = F0
        _tile_release()


@njit(inline="always")
def _single(kind, d0, d1, d2, x, o0, o1, o2):
    X = x.reshape(1, -1)
    _mva(kind, d0, d1, d2, X, o0.reshape(1, -1), o1.reshape(1, -1), o2.reshape(1, -1), PARTS)


@njit(inline="always")
def _batch(kind, d0, d1, d2, X, o0, o1, o2):
    """Groups of up to MAX_VECTORS vectors, each one pass over the weights."""
    n = X.shape[0]
    for v0 in range(0, n, MAX_VECTORS):
        v1 = min(n, v0 + MAX_VECTORS)
        _mva(kind, d0, d1, d2, X[v0:v1], o0[v0:v1], o1[v0:v1], o2[v0:v1], PARTS)


@njit(parallel=True, cache=False, nogil=True)
def mva_q4_0(d0, d1, d2, x, o0, o1, o2):
    _single(KIND_Q4_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mva_q4_1(d0, d1, d2, x, o0, o1, o2):
    _single(KIND_Q4_1, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mva_q5_0(d0, d1, d2, x, o0, o1, o2):
    _single(KIND_Q5_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mva_q8_0(d0, d1, d2, x, o0, o1, o2):
    _single(KIND_Q8_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mvba_q4_0(d0, d1, d2, X, o0, o1, o2):
    _batch(KIND_Q4_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mvba_q4_1(d0, d1, d2, X, o0, o1, o2):
    _batch(KIND_Q4_1, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mvba_q5_0(d0, d1, d2, X, o0, o1, o2):
    _batch(KIND_Q5_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=False, nogil=True)
def mvba_q8_0(d0, d1, d2, X, o0, o1, o2):
    _batch(KIND_Q8_0, d0, d1, d2, X, o0, o1, o2)


SINGLE = {"Q4_0": mva_q4_0, "Q4_1": mva_q4_1, "Q5_0": mva_q5_0, "Q8_0": mva_q8_0}
BATCH = {"Q4_0": mvba_q4_0, "Q4_1": mvba_q4_1, "Q5_0": mvba_q5_0, "Q8_0": mvba_q8_0}


# ------------------------------------------------------------------ tile cost probe
@intrinsic
def _probe_load(typingctx, U, uo, t):
    if not isinstance(t, types.IntegerLiteral):
        return None
    tv = t.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        load = _tile_fn(r, "tileloadd64", [I8, I8.as_pointer(), I64])
        builder.call(load, [_TILE_IMM[tv], r.ptr(0, args[1], I8), ir.Constant(I64, CHUNK)])
        return context.get_dummy_value()

    return types.void(U, uo, t), codegen


@intrinsic
def _probe_dot(typingctx, ct):
    if not isinstance(ct, types.IntegerLiteral):
        return None
    c = ct.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        dot = _tile_fn(r, "tdpbssd", [I8, I8, I8])
        builder.call(dot, [_TILE_IMM[c], _TILE_IMM[2], _TILE_IMM[4]])
        return context.get_dummy_value()

    return types.void(ct), codegen


@njit(nogil=True)
def _probe(U, n, what):
    _configure_tiles()
    _probe_load(U, 0, 2)
    _probe_load(U, 0, 4)
    for _ in range(n):
        if what == 0:  # one tile load
            _probe_load(U, 0, 2)
        else:  # four independent tile products
            _probe_dot(0)
            _probe_dot(1)
            _probe_dot(3)
            _probe_dot(5)
    _tile_release()


def tile_costs() -> dict[str, float]:
    """ns a 1 KB tile load (64-byte aligned, and 32 bytes off) and a TDPBSSD takes."""
    raw = np.ones(4096 + 128, np.int8)
    at = (-raw.ctypes.data) % 64
    out = {}
    n = 200_000
    for name, off, what, per in (
        ("tile load, aligned", at, 0, 1),
        ("tile load, 32 bytes off", at + 32, 0, 1),
        ("tdpbssd (4 chains)", at, 1, 4),
    ):
        buf = raw[off : off + 4096]
        _probe(buf, 10, what)
        t = time.perf_counter()
        _probe(buf, n, what)
        out[name] = (time.perf_counter() - t) / (n * per) * 1e9
    return out


# ------------------------------------------------------------------ against VNNI
def compare(name: str, threads: int, repeats: int) -> None:
    """Every block-format matrix of a registry model: the AMX kernel against the VNNI
    kernels (qmatvec.matvec / matvec_batch) at 1, 4 and 8 vectors, after checking it
    against the single-level reference and batched rows against single ones."""
    import edgerun
    from edgerun.ops import qmatvec
    from edgerun.quant import QuantTensor

    edgerun.load(name, threads=threads)
    tensors = [o for o in gc.get_objects() if isinstance(o, QuantTensor) and o.qtype.name in SINGLE]
    groups = collections.defaultdict(list)
    for w in tensors:
        if w.shape[1] % CHUNK == 0:
            groups[(w.qtype.name, w.shape)].append(w)
    rng = np.random.default_rng(0)
    nr, no, no2 = qmatvec._NO_ROWS, qmatvec._NO_OUT, qmatvec._NO_OUT2
    totals = collections.Counter()
    print(f"{name}, {threads} threads: ms for all matrices of a shape, VNNI / AMX")
    for (fmt, shape), ws in sorted(
        groups.items(), key=lambda kv: -kv[0][1][0] * kv[0][1][1] * len(kv[1])
    ):
        data = [qmatvec._data(w) for w in ws]
        x = rng.standard_normal((8, shape[1])).astype(np.float32)
        one = np.zeros(shape[0], np.float32)
        SINGLE[fmt](data[0], nr, nr, x[0], one, no, no)
        ref = qmatvec.matvec_reference(ws[0], qmatvec.quantize_x_reference(x[0], 32, levels=1))
        err = float(np.abs(one - ref).max() / np.abs(ref).max())
        batch = np.zeros((8, shape[0]), np.float32)
        BATCH[fmt](data[0], nr, nr, x, batch, no2, no2)
        exact = np.array_equal(batch[0], one)
        cells = []
        for n in (1, 4, 8):
            out = np.empty((n, shape[0]), np.float32)
            for engine in ("vnni", "amx"):
                ts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    for d, w in zip(data, ws):
                        if engine == "vnni":
                            if n == 1:
                                qmatvec.matvec(w, x[0], out[0])
                            else:
                                qmatvec.matvec_batch(w, x[:n], out)
                        elif n == 1:
                            SINGLE[fmt](d, nr, nr, x[0], out[0], no, no)
                        else:
                            BATCH[fmt](d, nr, nr, x[:n], out, no2, no2)
                    ts.append(time.perf_counter() - t)
                totals[(engine, n)] += statistics.median(ts) * 1e3
                cells.append(statistics.median(ts) * 1e3)
        print(
            f"  {fmt} {shape[0]}x{shape[1]} x{len(ws)}: "
            + "  ".join(
                f"n{n} {cells[2 * i]:.2f} / {cells[2 * i + 1]:.2f}" for i, n in enumerate((1, 4, 8))
            )
            + f"  (rel. error {err:.1e}, batch == single: {exact})"
        )
    print(
        "  total: "
        + "  ".join(f"n{n} {totals[('vnni', n)]:.2f} / {totals[('amx', n)]:.2f}" for n in (1, 4, 8))
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if not available():
        print("no AMX int8 tiles on this CPU (or EDGERUN_AMX=0)")
        return 1
    for k, v in tile_costs().items():
        print(f"{k}: {v:.1f} ns")
    for name in args.model or ["smollm2-135m", "qwen2.5-coder-0.5b"]:
        compare(name, args.threads, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
