"""Decode kernels on a row-interleaved copy of a block-format matrix (AVX-512 VNNI).

The GGUF layout keeps each row's blocks together, so a row's dot with x ends in 16
lanes of partial sums: per 64 weights and per vector the kernels there take a
`vpdpbusd`, a conversion, a scale product and an FMA, and a horizontal sum per row. For
several vectors (concurrent sessions' decode) that per-vector work is what a step pays
for: 4 vectors cost ~1.8-2x one on Qwen2.5-0.5B.

Here 16 rows are interleaved per block of 32 columns, in the lane order `vpdpbusd`
wants with the rows across the lanes: register k (k = 0..7) of a block holds, for each
of the 16 rows, its weights 4k..4k+3, so `vpdpbusd(acc, W_k, broadcast(x[4k:4k+4]))`
adds four products to each row's own lane, and a block's 16 row dots end in one
register. Per block and vector: 8 `vpdpbusd` (a broadcast x operand each; two-level
formats 16), one conversion, one scale product and one FMA for 16 rows, where the row layout
takes 4 of each; no horizontal sums. The unpack (shared by the vectors) is the same.

On 48 Q5_0 matrices 4864x896 out of cache, 2 threads, a step takes 5.6 ms for 1 vector
against 7.0 for the row kernels, 6.3-6.6 for 4 vectors against 12.0-12.3 (it stops being
compute-bound): `python benchmarks/rows16.py -t 2`.

Layout (`interleave`), per group of 16 rows (the last one padded with zero rows) and
block of 32 columns, `GROUP_BYTES[kind]` bytes on average:
- nibble formats (Q4_0, Q4_1, Q5_0): 256 bytes, register j and j + 4 as the low and
  high nibbles of 64 bytes j (j = 0..3);
- Q5_0: then 8 x 64-bit masks, bit 4r + i of mask k = bit 4 of row r's weight 4k + i;
- Q8_0: 8 x 64 bytes, the weights + 128 (unsigned for vpdpbusd);
- then d of the 16 rows (16 x f16) and, for Q4_1, m (16 x f16);
- Q4_K / Q6_K / Q5_K / IQ4_XS: per super-block of 256 columns 8 records of 32 columns
  (the nibbles as above, then the rows' 6-bit scales and mins / Q6_K's high 2 bits as
  two 64-byte planes and its two 16-weight scales / Q5_K's fifth bits as Q5_0's masks,
  then its scales and mins / IQ4_XS's signed scales), then d and dmin / d of the 16 rows
  (_interleave_q4_k, _interleave_q6_k, _interleave_q5_k, _interleave_iq4_xs). IQ4_XS's
  4-bit indices become their levels + 128 with one vpshufb per register.
- Q3_K / Q2_K: per super-block 8 records of 32 columns: the 2-bit fields as two 64-byte
  planes, Q3_K's hmask bits as Q5_0's masks and its two 16-weight scales, Q2_K's two
  scale-and-min bytes, then d (and dmin) of the 16 rows (_interleave_k16).

Activations, as the row kernels quantize them: per block of 32 one scale dx = max|x| /
127, q1 = rint(x / dx), and for the two-level formats (Q4_0, Q4_1, Q8_0) the residual
q2 = rint((x - q1 dx) 128 / dx); a block's value is d dx (dot(w, q1) + dot(w, q2) / 128).
Q4_K, Q5_K and Q6_K take quantize_x_sb8's single level (one scale per 256 refined per 32
by a power of two), Q5_0 q1 alone, IQ4_XS two levels (as its row kernels). One level
halves the dots a vector costs, which is what several vectors pay for once the unpack is
shared: on the 1.5B's Q4_K 8960x1536 shape, 1 thread, 16 vectors cost 5.0-5.2x one
vector's time where two levels cost 6.8-7.2x, 4 vectors 1.6x where they cost 1.8-1.9x
(`python benchmarks/rows16.py --cpu-time -t 1 --vectors 1 2 4 8 16 --shapes
Q4_K:8960x1536x4 Q6_K:1536x8960x4`).
Passes: a group's blocks are walked once per pass of up to PASS = 8 vectors (8 while 8
are left, then up to 4), each block unpacked once for the pass, and the vectors'
`vpdpbusd` chains are emitted k-major, interleaved, so that each waits only on its own
chain. What a vector then pays per block is its 8 `vpdpbusd` and the float epilogue (a
scale product, a conversion, one or two FMAs), whose order fixes the rows' bits. On the
1.5B's Q4_K 8960x1536 / Q6_K 1536x8960 (x4, 1 thread, CPU time) 8 vectors take 3.4 / 4.3
ms where passes of 4 took 4.5 / 5.4, 16 vectors 7.0 / 7.9 where they took 8.0 / 9.2.
The formats' offsets (-8, -16, -128, -32, IQ4_XS's -128, Q3_K's -4 per weight) are
folded into the integer sums; Q4_1's m and Q4_K's / Q5_K's dmin terms take one FMA with
the block's activation sum, Q2_K's one per 16 weights.

A vector's operations do not depend on how many vectors share the call, so batched rows
equal single-vector rows bit for bit. Only call these kernels where `has_vnni()`.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from llvmlite.binding import llvm_version_info  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops._simd import h2f  # noqa: E402
from edgerun.ops.int8.activations import SB8_EMAX, amax32, q8_16, qhalf  # noqa: E402
from edgerun.ops.portable.kernels import _q4k_sm, iq4xs_scale, q3k_scale  # noqa: E402
from edgerun.quant.formats import QuantType  # noqa: E402
from edgerun.quant.iquants import KVALUES  # noqa: E402

ROWS = 16  # rows a group interleaves (16 int32 lanes of a zmm)
PASS = 8  # the most vectors a pass over a group takes (their dots stay in registers)
# a pass's vector counts: PASS while that many are left, else up to 4 (5-7 take two passes)
PASS_SIZES = (1, 2, 3, 4, PASS)
PREFETCH_BYTES = 16384  # as the row kernels (int8.PREFETCH_BYTES)
F0 = np.float32(0.0)

KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q8_0, KIND_Q4_K, KIND_Q6_K = 0, 1, 2, 3, 4, 5
KIND_Q5_K, KIND_IQ4_XS, KIND_Q3_K, KIND_Q2_K = 6, 7, 8, 9
KIND_OF = {
    QuantType.Q4_0: KIND_Q4_0,
    QuantType.Q4_1: KIND_Q4_1,
    QuantType.Q5_0: KIND_Q5_0,
    QuantType.Q8_0: KIND_Q8_0,
    QuantType.Q4_K: KIND_Q4_K,
    QuantType.Q6_K: KIND_Q6_K,
    QuantType.Q5_K: KIND_Q5_K,
    QuantType.IQ4_XS: KIND_IQ4_XS,
    QuantType.Q3_K: KIND_Q3_K,
    QuantType.Q2_K: KIND_Q2_K,
}
# bytes per group of 16 rows and block of 32 columns (the K-quants: a super-block of 256
# is 8 records of 288 / 416 / 352 / 272 / 224 / 160 bytes, then d and dmin / d of the 16
# rows: 2368 / 3360 / 2880 / 2208 / 1824 / 1344 bytes)
GROUP_BYTES = {
    KIND_Q4_0: 288,
    KIND_Q4_1: 320,
    KIND_Q5_0: 352,
    KIND_Q8_0: 544,
    KIND_Q4_K: 296,
    KIND_Q6_K: 420,
    KIND_Q5_K: 360,
    KIND_IQ4_XS: 276,
    KIND_Q3_K: 228,
    KIND_Q2_K: 168,
}
Q4K_SUPER, Q6K_SUPER, Q5K_SUPER, IQ4XS_SUPER = 2368, 3360, 2880, 2208
Q3K_SUPER, Q2K_SUPER = 1824, 1344
_D_AT = {KIND_Q4_0: 256, KIND_Q4_1: 256, KIND_Q5_0: 320, KIND_Q8_0: 512}
# single-level activations: Q5_0 one scale per 32 (quantize_x1), the K-quants one per 256
# refined per 32 (quantize_x_sb8); the others (IQ4_XS, Q3_K, Q2_K included, as their row
# kernels) two levels
_LEVELS = {KIND_Q5_0: 1, KIND_Q4_K: 1, KIND_Q6_K: 1, KIND_Q5_K: 1}
_SB8 = (KIND_Q4_K, KIND_Q6_K, KIND_Q5_K)  # the kinds on quantize_x_sb8's activations
# the weights' offsets (IQ4_XS: its levels + 128 as unsigned bytes); the others: 0
_BIAS = {
    KIND_Q4_0: -8,
    KIND_Q5_0: -16,
    KIND_Q8_0: -128,
    KIND_Q6_K: -32,
    KIND_IQ4_XS: -128,
    KIND_Q3_K: -4,
}
# IQ4_XS's 16 levels + 128 (1..241), the vpshufb table of every 16-byte lane
_IQ4_U8 = [int(v) + 128 for v in KVALUES] * 4

I1, I8, I32, I64 = (ir.IntType(n) for n in (1, 8, 32, 64))
F32, HALF = ir.FloatType(), ir.HalfType()
V16I32, V16F, V64I8 = ir.VectorType(I32, 16), ir.VectorType(F32, 16), ir.VectorType(I8, 64)
_PREFETCH = "llvm.prefetch.p0" if llvm_version_info >= (17,) else "llvm.prefetch.p0i8"


# ------------------------------------------------------------------------ the layout
@njit(cache=True, nogil=True)
def _interleave(kind, raw, rows, nb, out):
    """raw: GGUF rows [rows, nb * block bytes] -> out [groups, nb * GROUP_BYTES] (zeroed).
    A nibble block's 16 bytes land as they are: byte j holds weights j (low nibble) and
    j + 16 (high), which are registers j // 4 and j // 4 + 4 at the same byte."""
    gb = out.shape[1] // max(nb, 1)
    for row in range(rows):
        g, r = row // ROWS, row % ROWS
        if kind == KIND_Q4_K:
            _interleave_q4_k(raw, row, g, r, nb // 8, out)
            continue
        if kind == KIND_Q6_K:
            _interleave_q6_k(raw, row, g, r, nb // 8, out)
            continue
        if kind == KIND_Q5_K:
            _interleave_q5_k(raw, row, g, r, nb // 8, out)
            continue
        if kind == KIND_IQ4_XS:
            _interleave_iq4_xs(raw, row, g, r, nb // 8, out)
            continue
        if kind == KIND_Q3_K or kind == KIND_Q2_K:
            _interleave_k16(kind, raw, row, g, r, nb // 8, out)
            continue
        for b in range(nb):
            o = b * gb
            if kind == KIND_Q8_0:
                s = b * 34
                out[g, o + 512 + 2 * r] = raw[row, s]
                out[g, o + 513 + 2 * r] = raw[row, s + 1]
                for j in range(32):
                    out[g, o + 64 * (j >> 2) + 4 * r + (j & 3)] = raw[row, s + 2 + j] ^ 0x80
                continue
            if kind == KIND_Q5_0:
                s, qs, d_at = b * 22, b * 22 + 6, 320
            elif kind == KIND_Q4_1:
                s, qs, d_at = b * 20, b * 20 + 4, 256
                out[g, o + 288 + 2 * r] = raw[row, s + 2]
                out[g, o + 289 + 2 * r] = raw[row, s + 3]
            else:
                s, qs, d_at = b * 18, b * 18 + 2, 256
            out[g, o + d_at + 2 * r] = raw[row, s]
            out[g, o + d_at + 1 + 2 * r] = raw[row, s + 1]
            for j in range(16):
                out[g, o + 64 * (j >> 2) + 4 * r + (j & 3)] = raw[row, qs + j]
            if kind == KIND_Q5_0:
                # mask k's bits 4r .. 4r + 3: row r's high bits of weights 4k .. 4k + 3
                for t in range(4):
                    h = raw[row, s + 2 + t]  # high bits of weights 8t .. 8t + 7
                    for half in range(2):
                        k = 2 * t + half
                        nib = (h >> (4 * half)) & 15
                        out[g, o + 256 + 8 * k + r // 2] |= nib << (4 * (r & 1))


@njit(inline="always")
def _k4_records(raw, row, g, r, s, o, qs, rec, out):
    """Q4_K's part of row `row` (row r of group g) of a Q4_K or Q5_K super-block at byte s
    of the row, its 4-bit fields at s + qs, written at o: sub-block j's record at o + rec j
    holds its 32 weights' low 4 bits as the nibble formats do (byte 64 kk + 4 r + i:
    weight 4 kk + i low, 16 + 4 kk + i high) and ends with the row's 6-bit scale at
    rec - 32 + r and min at rec - 16 + r; d and dmin follow the 8 records, at 8 rec + 2 r
    and 8 rec + 32 + 2 r."""
    for t in range(2):
        out[g, o + 8 * rec + 2 * r + t] = raw[row, s + t]
        out[g, o + 8 * rec + 32 + 2 * r + t] = raw[row, s + 2 + t]
    for j in range(8):
        sc, m = _q4k_sm(raw[row, s + 4 : s + 16], j)
        oj = o + rec * j
        out[g, oj + rec - 32 + r] = sc
        out[g, oj + rec - 16 + r] = m
        q0 = s + qs + 32 * (j // 2)  # the 32 bytes holding sub-blocks 2c and 2c + 1
        sh = 4 * (j % 2)
        for kk in range(4):
            for i in range(4):
                lo = (raw[row, q0 + 4 * kk + i] >> sh) & 15
                hi = (raw[row, q0 + 16 + 4 * kk + i] >> sh) & 15
                out[g, oj + 64 * kk + 4 * r + i] = lo | (hi << 4)


@njit(inline="always")
def _interleave_q4_k(raw, row, g, r, nsb, out):
    """Row `row` (row r of group g) of a Q4_K matrix: per super-block s, sub-block j's
    record at s * Q4K_SUPER + 288 j holds its 32 weights as the nibble formats do, then
    the row's 6-bit scale at 256 + r and min at 272 + r; d and dmin at 2304 + 2 r and
    2336 + 2 r (_k4_records)."""
    for sb in range(nsb):
        _k4_records(raw, row, g, r, sb * 144, sb * Q4K_SUPER, 16, 288, out)


@njit(inline="always")
def _interleave_q6_k(raw, row, g, r, nsb, out):
    """Row `row` (row r of group g) of a Q6_K matrix: per super-block s, sub-block j's
    record at s * Q6K_SUPER + 416 j holds its weights' low 4 bits as the nibble formats
    do, then their high 2 bits as two 64-byte planes (byte 4 r + i of plane h, bits 2 m:
    weight 4 (4 h + m) + i), then the row's two 16-weight scales at 384 + r and 400 + r;
    d at 3328 + 2 r."""
    for sb in range(nsb):
        s, o = sb * 210, sb * Q6K_SUPER
        out[g, o + 3328 + 2 * r] = raw[row, s + 208]
        out[g, o + 3329 + 2 * r] = raw[row, s + 209]
        for j in range(8):
            oj = o + 416 * j
            out[g, oj + 384 + r] = raw[row, s + 192 + 2 * j]
            out[g, oj + 400 + r] = raw[row, s + 193 + 2 * j]
            # weight w of sub-block j: low 4 bits in ql byte lo0 + w (shifted by lsh), high
            # 2 in qh byte hi0 + w (shifted by hsh)
            lo0, lsh = s + 64 * (j // 4) + 32 * (j % 2), 4 * ((j // 2) % 2)
            hi0, hsh = s + 128 + 32 * (j // 4), 2 * (j % 4)
            for kk in range(4):
                for i in range(4):
                    w = 4 * kk + i
                    a = (raw[row, lo0 + w] >> lsh) & 15
                    c = (raw[row, lo0 + w + 16] >> lsh) & 15
                    out[g, oj + 64 * kk + 4 * r + i] = a | (c << 4)
            for h in range(2):
                for i in range(4):
                    v = 0
                    for m in range(4):
                        v |= ((raw[row, hi0 + 16 * h + 4 * m + i] >> hsh) & 3) << (2 * m)
                    out[g, oj + 256 + 64 * h + 4 * r + i] = v


@njit(inline="always")
def _interleave_q5_k(raw, row, g, r, nsb, out):
    """Row `row` (row r of group g) of a Q5_K matrix: per super-block s, sub-block j's
    record at s * Q5K_SUPER + 352 j holds its weights' low 4 bits as Q4_K's records, then
    their fifth bits as Q5_0's 8 masks (bit 4 r + i of mask k: weight 4 k + i), then the
    row's 6-bit scale at 320 + r and min at 336 + r; d and dmin at 2816 + 2 r and 2848 +
    2 r (_k4_records, and the masks here)."""
    for sb in range(nsb):
        s, o = sb * 176, sb * Q5K_SUPER
        _k4_records(raw, row, g, r, s, o, 48, 352, out)
        for j in range(8):
            oj = o + 352 * j
            for k in range(8):  # weight w's fifth bit: bit j of qh byte w
                nib = 0
                for i in range(4):
                    nib |= ((raw[row, s + 16 + 4 * k + i] >> j) & 1) << i
                out[g, oj + 256 + 8 * k + r // 2] |= nib << (4 * (r & 1))


@njit(inline="always")
def _interleave_iq4_xs(raw, row, g, r, nsb, out):
    """Row `row` (row r of group g) of an IQ4_XS matrix: per super-block s, sub-block j's
    record at s * IQ4XS_SUPER + 272 j holds its 16 index bytes as the nibble formats do
    (byte j of the file's 16: elements j and j + 16), then the row's signed scale
    (sc - 32) at 256 + r; d at 2176 + 2 r."""
    for sb in range(nsb):
        s, o = sb * 136, sb * IQ4XS_SUPER
        out[g, o + 2176 + 2 * r] = raw[row, s]
        out[g, o + 2177 + 2 * r] = raw[row, s + 1]
        for j in range(8):
            oj = o + 272 * j
            out[g, oj + 256 + r] = np.uint8(iq4xs_scale(raw[row, s : s + 8], j) & 255)
            for t in range(16):
                out[g, oj + 64 * (t >> 2) + 4 * r + (t & 3)] = raw[row, s + 8 + 16 * j + t]


@njit(inline="always")
def _interleave_k16(kind, raw, row, g, r, nsb, out):
    """Row `row` (row r of group g) of a Q3_K or Q2_K matrix: per super-block s,
    sub-block j's record at s * SUPER + RECORD j (Q3_K 1824 / 224, Q2_K 1344 / 160)
    holds its weights' 2-bit fields as two 64-byte planes (byte 4 r + i of plane h, bits
    2 m: weight 4 (4 h + m) + i), then for Q3_K their hmask bits as Q5_0's 8 masks (bit
    4 r + i of mask k: weight 4 k + i; a set bit is + 4) and the row's two 16-weight
    signed scales (sc - 32) at 192 + r and 208 + r, for Q2_K the row's two scale bytes
    (scale | min << 4) at 128 + r and 144 + r; d (and Q2_K's dmin) of the 16 rows at
    the super-block's end."""
    q3 = kind == KIND_Q3_K
    nbytes, sup, rec = (110, Q3K_SUPER, 224) if q3 else (84, Q2K_SUPER, 160)
    qs0 = 32 if q3 else 16
    for sb in range(nsb):
        s, o = sb * nbytes, sb * sup
        dat = s + 108 if q3 else s + 80
        e = o + 8 * rec
        for t in range(2):
            out[g, e + 2 * r + t] = raw[row, dat + t]
            if not q3:
                out[g, e + 32 + 2 * r + t] = raw[row, s + 82 + t]
        for j in range(8):  # elements 32 j + l: bits 2 (j % 4) of qs[32 (j // 4) + l]
            oj = o + rec * j
            h, sh = j // 4, 2 * (j % 4)
            for half in range(2):
                if q3:
                    sc = q3k_scale(raw[row, s + 96 : s + 108], 2 * j + half)
                    out[g, oj + 192 + 16 * half + r] = np.uint8(sc & 255)
                else:
                    out[g, oj + 128 + 16 * half + r] = raw[row, s + 2 * j + half]
            for w in range(32):
                k, i = w >> 2, w & 3
                q = (raw[row, s + qs0 + 32 * h + w] >> sh) & 3
                out[g, oj + 64 * (k >> 2) + 4 * r + i] |= q << (2 * (k & 3))
                if q3:
                    hb = (raw[row, s + w] >> j) & 1  # hmask bit j of element w
                    out[g, oj + 128 + 8 * k + r // 2] |= hb << (4 * (r & 1) + i)


def copy_shape(qtype: QuantType, rows: int, cols: int) -> tuple[int, int]:
    """The interleaved copy's shape (uint8) for a rows x cols matrix of qtype (KIND_OF):
    [ceil(rows / 16), cols / 32 * GROUP_BYTES]."""
    return (rows + ROWS - 1) // ROWS, cols // 32 * GROUP_BYTES[KIND_OF[qtype]]


def interleave(qtype: QuantType, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """GGUF rows uint8 [rows, row bytes] of a format in KIND_OF -> the interleaved copy,
    uint8 copy_shape(qtype, rows, cols) (read-only)."""
    out = np.zeros(copy_shape(qtype, rows, cols), np.uint8)
    _interleave(KIND_OF[qtype], raw, rows, cols // 32, out)
    out.flags.writeable = False
    return out


@njit(cache=True, nogil=True)
def embedding_rows16(kind, il, ids, out):
    """Rows `ids` of an interleaved matrix dequantized into out float32 [len(ids), cols],
    with the reference's float operations (quant/reference.py), so bit for bit: the
    embedding lookup of a tied head whose copy is the only one kept."""
    cols = out.shape[1]
    nb = cols // 32
    gb = il.shape[1] // max(nb, 1)
    for t in range(ids.shape[0]):
        g, r = ids[t] // ROWS, ids[t] % ROWS
        for bi in range(nb):
            if kind == KIND_Q6_K:
                sup = (bi >> 3) * Q6K_SUPER
                o = sup + (bi & 7) * 416
                dq = _f16_at(il, g, sup + 3328 + 2 * r)
                for j in range(32):
                    k = j >> 2
                    byte = il[g, o + 64 * (k & 3) + 4 * r + (j & 3)]
                    lo = np.int32((byte >> (4 * (k >> 2))) & 15)
                    hb = il[g, o + 256 + 64 * (k >> 2) + 4 * r + (j & 3)]
                    q = lo | (np.int32((hb >> (2 * (k & 3))) & 3) << 4)
                    sc = np.int8(il[g, o + 384 + 16 * (j >> 4) + r])
                    out[t, 32 * bi + j] = (dq * np.float32(sc)) * np.float32(q - 32)
                continue
            if kind == KIND_Q3_K or kind == KIND_Q2_K:
                q3 = kind == KIND_Q3_K
                rec = 224 if q3 else 160
                sup = (bi >> 3) * (Q3K_SUPER if q3 else Q2K_SUPER)
                o = sup + (bi & 7) * rec
                dq = _f16_at(il, g, sup + 8 * rec + 2 * r)
                for j in range(32):
                    k = j >> 2
                    pl = il[g, o + 64 * (k >> 2) + 4 * r + (j & 3)]
                    q = np.int32((pl >> (2 * (k & 3))) & 3)
                    if q3:
                        mask = il[g, o + 128 + 8 * k + r // 2]
                        q += 4 * np.int32((mask >> (4 * (r & 1) + (j & 3))) & 1) - 4
                        sc = np.int8(il[g, o + 192 + 16 * (j >> 4) + r])
                        out[t, 32 * bi + j] = (dq * np.float32(sc)) * np.float32(q)
                    else:
                        scm = il[g, o + 128 + 16 * (j >> 4) + r]
                        dm = _f16_at(il, g, sup + 8 * rec + 32 + 2 * r)
                        dl = dq * np.float32(scm & 15)
                        ml = dm * np.float32(scm >> 4)
                        out[t, 32 * bi + j] = dl * np.float32(q) - ml
                continue
            if kind == KIND_IQ4_XS:
                sup = (bi >> 3) * IQ4XS_SUPER
                o = sup + (bi & 7) * 272
                sc = np.int8(il[g, o + 256 + r])
                dl = _f16_at(il, g, sup + 2176 + 2 * r) * np.float32(sc)
                for j in range(32):
                    k = j >> 2
                    byte = il[g, o + 64 * (k & 3) + 4 * r + (j & 3)]
                    q = (byte >> (4 * (k >> 2))) & 15
                    out[t, 32 * bi + j] = dl * np.float32(KVALUES[q])
                continue
            if kind == KIND_Q4_K:
                sup = (bi >> 3) * Q4K_SUPER
                o = sup + (bi & 7) * 288
                d = _f16_at(il, g, sup + 2304 + 2 * r) * np.float32(il[g, o + 256 + r])
                m = _f16_at(il, g, sup + 2336 + 2 * r) * np.float32(il[g, o + 272 + r])
            elif kind == KIND_Q5_K:
                sup = (bi >> 3) * Q5K_SUPER
                o = sup + (bi & 7) * 352
                d = _f16_at(il, g, sup + 2816 + 2 * r) * np.float32(il[g, o + 320 + r])
                m = _f16_at(il, g, sup + 2848 + 2 * r) * np.float32(il[g, o + 336 + r])
            else:
                o = bi * gb
                d_at = 512 if kind == KIND_Q8_0 else (320 if kind == KIND_Q5_0 else 256)
                d = _f16_at(il, g, o + d_at + 2 * r)
                m = _f16_at(il, g, o + 288 + 2 * r) if kind == KIND_Q4_1 else np.float32(0.0)
            for j in range(32):
                if kind == KIND_Q8_0:
                    q = np.int32(il[g, o + 64 * (j >> 2) + 4 * r + (j & 3)]) - 128
                    out[t, 32 * bi + j] = np.float32(q) * d
                    continue
                k = j >> 2
                byte = il[g, o + 64 * (k & 3) + 4 * r + (j & 3)]
                q = np.int32((byte >> (4 * (k >> 2))) & 15)
                if kind == KIND_Q5_0 or kind == KIND_Q5_K:
                    mask = il[g, o + 256 + 8 * k + r // 2]
                    q += 16 * np.int32((mask >> (4 * (r & 1) + (j & 3))) & 1)
                if kind == KIND_Q5_0:
                    q -= 16
                elif kind == KIND_Q4_0:
                    q -= 8
                if kind == KIND_Q4_1:
                    out[t, 32 * bi + j] = d * np.float32(q) + m
                elif kind == KIND_Q4_K or kind == KIND_Q5_K:
                    out[t, 32 * bi + j] = d * np.float32(q) - m
                else:
                    out[t, 32 * bi + j] = d * np.float32(q)


@njit(inline="always")
def _f16_at(il, g, o):
    return h2f(np.uint16(il[g, o]) | (np.uint16(il[g, o + 1]) << np.uint16(8)))


# ------------------------------------------------------------------------ activations
@njit(cache=True, nogil=True)
def quantize_x16(X, levels, sb8, xq, xd, xs, xf, xh):
    """X float32 [nv, cols] -> per vector and block of 32, as the row kernels quantize
    (int8.quantize_x, quantize_x1, quantize_x_sb8): xq int8 [nv, levels, cols] (q1, and
    q2 for two levels), xd float32 [nv, nb] the scale of the integer sums (dx, or dx / 128
    for two levels, or for sb8 the super-block's dx / 2^e), xs int32 [nv, nb] the sum of
    the integer activations (sum(q1), or sum(128 q1 + q2)), xf = xd * xs (Q4_1's and
    Q4_K's m terms), xh int32 [nv, 2 nb] those sums per 16 elements (Q6_K's scales are
    per 16). sb8 (single level, the K-quants): one scale per 256 refined per 32 by a
    power of two, the integers quantize_x_sb8 gives the row kernels."""
    nv, cols = X.shape
    nb = cols // 32
    x = X.reshape(-1)
    q = xq.reshape(-1)
    amax, dsb, inv = F0, F0, F0
    for v in range(nv):
        for b in range(nb):
            xo = v * cols + 32 * b
            q1o = v * levels * cols + 32 * b
            if sb8:
                if b % 8 == 0:  # the super-block's scale
                    amax = F0
                    for j in range(8):
                        amax = max(amax, amax32(x, xo + 32 * j))
                    dsb = amax / np.float32(127.0)
                    inv = np.float32(1.0) / dsb if dsb != F0 else F0
                a32 = amax32(x, xo)
                e = 0
                while e < SB8_EMAX and a32 * np.float32(2 ** (e + 1)) <= amax:
                    e += 1
                f = np.float32(2**e)
                d = dsb / f
                t0, t1 = q8_16(x, xo, q, q1o, inv * f), q8_16(x, xo + 16, q, q1o + 16, inv * f)
            else:
                d = amax32(x, xo) / np.float32(127.0)
                inv = np.float32(1.0) / d if d != F0 else F0
                if levels == 2:
                    q2o = q1o + cols
                    inv2 = inv * np.float32(128.0)
                    t0 = qhalf(x, xo, q, q1o, q2o, d, inv, inv2)
                    t1 = qhalf(x, xo + 16, q, q1o + 16, q2o + 16, d, inv, inv2)
                    d = d / np.float32(128.0)
                else:
                    t0, t1 = q8_16(x, xo, q, q1o, inv), q8_16(x, xo + 16, q, q1o + 16, inv)
            t = t0 + t1
            xh[v, 2 * b] = np.int32(t0)
            xh[v, 2 * b + 1] = np.int32(t1)
            xd[v, b] = d
            xs[v, b] = np.int32(t)
            xf[v, b] = d * np.float32(t)


# ------------------------------------------------------------------------ the block intrinsic
def _block_codegen(kind: int, nv: int):
    levels, bias, d_at = _LEVELS.get(kind, 2), _BIAS.get(kind, 0), _D_AT.get(kind, 0)
    nbytes = GROUP_BYTES[kind]

    def codegen(context, builder, sig, args):
        b = builder
        accp, _, off, aux, _, xo, vstride, _, _, _, bi, nb, v0 = args

        def ptr(i, o, ty):
            a = context.make_array(sig.args[i])(context, b, args[i])
            return b.bitcast(b.gep(a.data, [o]), ty.as_pointer())

        def fn(name, ret, argtys):
            f = b.module.globals.get(name)
            return f if f is not None else ir.Function(b.module, ir.FunctionType(ret, argtys), name)

        def c64(v):
            return ir.Constant(I64, v)

        def at(o, extra):
            return b.add(o, c64(extra)) if extra else o

        def splat(v, vt):
            u = b.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(I32, 0))
            return b.shuffle_vector(u, u, ir.Constant(V16I32, [0] * 16))

        dpb = fn("llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32] * 3)
        fma = fn("llvm.fma.v16f32", V16F, [V16F] * 3)
        pf = fn(_PREFETCH, ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
        for k in range(0, nbytes, 64):
            p = ptr(1, at(off, PREFETCH_BYTES + k), I8)
            b.call(pf, [p, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
        # the block's 8 weight registers, 16 rows x 4 unsigned bytes each
        if kind == KIND_Q8_0:
            ws = [b.load(ptr(1, at(off, 64 * k), V64I8), align=1) for k in range(8)]
        elif kind == KIND_Q3_K or kind == KIND_Q2_K:
            planes = [b.load(ptr(1, at(off, 64 * h), V64I8), align=1) for h in range(2)]
            ws = []
            for k in range(8):
                sh = ir.Constant(V64I8, [2 * (k % 4)] * 64)
                p = b.lshr(planes[k // 4], sh) if k % 4 else planes[k // 4]
                ws.append(b.and_(p, ir.Constant(V64I8, [3] * 64)))
            if kind == KIND_Q3_K:
                for k in range(8):
                    m = b.load(ptr(1, at(off, 128 + 8 * k), I64), align=1)
                    h = b.select(
                        b.bitcast(m, ir.VectorType(I1, 64)),
                        ir.Constant(V64I8, [4] * 64),
                        ir.Constant(V64I8, [0] * 64),
                    )
                    ws[k] = b.or_(ws[k], h)
        elif kind == KIND_Q6_K:
            packed = [b.load(ptr(1, at(off, 64 * j), V64I8), align=1) for j in range(4)]
            ws = [b.and_(p, ir.Constant(V64I8, [15] * 64)) for p in packed]
            ws += [b.lshr(p, ir.Constant(V64I8, [4] * 64)) for p in packed]
            planes = [b.load(ptr(1, at(off, 256 + 64 * h), V64I8), align=1) for h in range(2)]
            for k in range(8):
                h2 = b.lshr(planes[k // 4], ir.Constant(V64I8, [2 * (k % 4)] * 64))
                h2 = b.shl(b.and_(h2, ir.Constant(V64I8, [3] * 64)), ir.Constant(V64I8, [4] * 64))
                ws[k] = b.or_(ws[k], h2)
        else:
            packed = [b.load(ptr(1, at(off, 64 * j), V64I8), align=1) for j in range(4)]
            lo = [b.and_(p, ir.Constant(V64I8, [15] * 64)) for p in packed]
            hi = [b.lshr(p, ir.Constant(V64I8, [4] * 64)) for p in packed]
            ws = lo + hi
            if kind == KIND_IQ4_XS:  # index -> level + 128: one vpshufb per register
                shufb = fn("llvm.x86.avx512.pshuf.b.512", V64I8, [V64I8, V64I8])
                table = ir.Constant(V64I8, _IQ4_U8)
                ws = [b.call(shufb, [table, w]) for w in ws]
            if kind == KIND_Q5_0 or kind == KIND_Q5_K:
                for k in range(8):
                    m = b.load(ptr(1, at(off, 256 + 8 * k), I64), align=1)
                    h = b.select(
                        b.bitcast(m, ir.VectorType(I1, 64)),
                        ir.Constant(V64I8, [16] * 64),
                        ir.Constant(V64I8, [0] * 64),
                    )
                    ws[k] = b.or_(ws[k], h)
        ws = [b.bitcast(w, V16I32) for w in ws]

        def f16x16(o):
            return b.fpext(b.load(ptr(1, o, ir.VectorType(HALF, 16)), align=1), V16F)

        def u8x16(o):  # 16 unsigned bytes as floats
            return b.uitofp(b.load(ptr(1, o, ir.VectorType(I8, 16)), align=1), V16F)

        def i8x16(o):  # 16 signed bytes as floats
            return b.sitofp(b.load(ptr(1, o, ir.VectorType(I8, 16)), align=1), V16F)

        m = None
        mh = []  # Q2_K: each 16-weight half's -dmin m, times dx and its per-16 sum
        # (registers, row scales, the xs index's half) of each part of a block's dot
        if kind == KIND_Q3_K:  # two 16-weight halves with their own scales d (sc - 32)
            dq = f16x16(aux)
            parts = [(range(4), b.fmul(dq, i8x16(at(off, 192))), 0)]
            parts.append((range(4, 8), b.fmul(dq, i8x16(at(off, 208))), 1))
        elif kind == KIND_Q2_K:  # halves with d (sc & 15) and dmin (sc >> 4)
            dq, dm = f16x16(aux), f16x16(at(aux, 32))
            parts = []
            for half in range(2):
                raw = b.load(ptr(1, at(off, 128 + 16 * half), ir.VectorType(I8, 16)), align=1)
                lo = b.and_(raw, ir.Constant(ir.VectorType(I8, 16), [15] * 16))
                hi = b.lshr(raw, ir.Constant(ir.VectorType(I8, 16), [4] * 16))
                parts.append((range(4 * half, 4 * half + 4), b.fmul(dq, b.uitofp(lo, V16F)), half))
                mh.append(b.fneg(b.fmul(dm, b.uitofp(hi, V16F))))
        elif kind == KIND_Q6_K:  # two 16-weight halves with their own scales d sc
            dq = f16x16(aux)
            parts = [(range(4), b.fmul(dq, i8x16(at(off, 384))), 0)]
            parts.append((range(4, 8), b.fmul(dq, i8x16(at(off, 400))), 1))
        elif kind == KIND_Q4_K or kind == KIND_Q5_K:  # d sc and -dmin m, exact in float32
            sc_at = 256 if kind == KIND_Q4_K else 320
            parts = [(range(8), b.fmul(f16x16(aux), u8x16(at(off, sc_at))), None)]
            m = b.fneg(b.fmul(f16x16(at(aux, 32)), u8x16(at(off, sc_at + 16))))
        elif kind == KIND_IQ4_XS:  # d (sc - 32) of the sub-block
            parts = [(range(8), b.fmul(f16x16(aux), i8x16(at(off, 256))), None)]
        else:
            parts = [(range(8), f16x16(at(off, d_at)), None)]
        if kind == KIND_Q4_1:
            m = f16x16(at(off, 288))
        acc = b.bitcast(accp, V16F.as_pointer())
        # per vector: [v, b] of the per-block arrays, its dx, its accumulator's slot and value
        vbs, dxs, ps, ys = [], [], [], []
        for v in range(nv):
            vb = b.add(b.mul(b.add(v0, c64(v)), nb), bi)
            vbs.append(vb)
            dxs.append(splat(b.load(ptr(7, vb, F32)), V16F))
            ps.append(b.gep(acc, [ir.Constant(I32, v)]))
            ys.append(b.load(ps[v], align=4))
        for ks, scale, half in parts:
            # the integer dots, one chain per vector and level, emitted k-major so that the
            # chains of all the pass's vectors interleave (each vpdpbusd waits on its own
            # chain only); a chain's order and so its sum are those of one vector alone
            dots = [[None] * levels for _ in range(nv)]
            for v in range(nv):
                for lv in range(levels):
                    a = ir.Constant(V16I32, [0] * 16)
                    if bias and lv == levels - 1:  # the offset's share: bias * xs, once
                        vb = vbs[v]
                        si = vb if half is None else b.add(b.add(vb, vb), c64(half))
                        s = b.load(ptr(8, si, I32))
                        a = splat(b.mul(s, ir.Constant(I32, bias)), V16I32)
                    dots[v][lv] = a
            for k in ks:
                for v in range(nv):
                    for lv in range(levels):
                        xl = b.add(xo, b.mul(vstride, c64(levels * v + lv)))
                        xw = b.load(ptr(4, at(xl, 4 * k), I32), align=1)
                        dots[v][lv] = b.call(dpb, [dots[v][lv], ws[k], splat(xw, V16I32)])
            for v in range(nv):
                dot = dots[v][0]
                if levels == 2:
                    dot = b.add(b.shl(dot, ir.Constant(V16I32, [7] * 16)), dots[v][1])
                ys[v] = b.call(fma, [b.sitofp(dot, V16F), b.fmul(scale, dxs[v]), ys[v]])
        for v in range(nv):
            vb, y = vbs[v], ys[v]
            if m is not None:
                y = b.call(fma, [m, splat(b.load(ptr(9, vb, F32)), V16F), y])
            for half, mv in enumerate(mh):  # dx times the half's integer sum (xs: xh)
                s16 = b.load(ptr(8, b.add(b.add(vb, vb), c64(half)), I32))
                y = b.call(
                    fma, [mv, splat(b.fmul(b.load(ptr(7, vb, F32)), b.sitofp(s16, F32)), V16F), y]
                )
            b.store(y, ps[v], align=4)
        return context.get_dummy_value()

    return codegen


def _block_intrinsic(kind: int, nv: int):
    def blk(typingctx, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0):
        sig = types.void(acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return sig, _block_codegen(kind, nv)

    blk.__name__ = f"rows16_block_{kind}_{nv}"
    return intrinsic(blk)


_BLK = {(k, n): _block_intrinsic(k, n) for k in GROUP_BYTES for n in PASS_SIZES}


def _pass_block(kind: int):
    """The block of `kind` for a pass of n (PASS_SIZES) vectors: a literal dispatch."""
    b1, b2, b3, b4, b8 = (_BLK[kind, n] for n in PASS_SIZES)

    @njit(inline="always")
    def block(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0):
        if n == PASS:
            b8(acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        elif n == 4:
            b4(acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        elif n == 3:
            b3(acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        elif n == 2:
            b2(acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        else:
            b1(acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)

    return block


_Q4_0, _Q4_1, _Q5_0, _Q8_0, _Q4_K, _Q6_K, _Q5_K, _IQ4_XS = (_pass_block(k) for k in range(8))
_Q3_K, _Q2_K = _pass_block(KIND_Q3_K), _pass_block(KIND_Q2_K)


@intrinsic
def _stack_acc(typingctx):
    """Pointer to PASS x 16 float32 on the stack (a pass's accumulators)."""

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, F32, size=ir.Constant(I64, 16 * PASS))

    return types.CPointer(types.float32)(), codegen


@njit(inline="always")
def _block(kind, n, acc, flat, base, bi, xq, xo, vstride, xd, xs, xf, nb, v0):
    """Block bi (32 columns) of the group at byte base, for a pass of n vectors."""
    if kind == KIND_Q4_K:  # sub-block bi % 8 of super-block bi // 8
        sup = base + (bi >> 3) * Q4K_SUPER
        off, aux = sup + (bi & 7) * 288, sup + 2304
        _Q4_K(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return
    if kind == KIND_Q6_K:  # xs: the sums per 16 (quantize_x16's xh)
        sup = base + (bi >> 3) * Q6K_SUPER
        off, aux = sup + (bi & 7) * 416, sup + 3328
        _Q6_K(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return
    if kind == KIND_Q5_K:
        sup = base + (bi >> 3) * Q5K_SUPER
        off, aux = sup + (bi & 7) * 352, sup + 2816
        _Q5_K(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return
    if kind == KIND_IQ4_XS:
        sup = base + (bi >> 3) * IQ4XS_SUPER
        off, aux = sup + (bi & 7) * 272, sup + 2176
        _IQ4_XS(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return
    if kind == KIND_Q3_K:  # xs: the sums per 16 (quantize_x16's xh)
        sup = base + (bi >> 3) * Q3K_SUPER
        off, aux = sup + (bi & 7) * 224, sup + 1792
        _Q3_K(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return
    if kind == KIND_Q2_K:  # xs: the sums per 16 (quantize_x16's xh)
        sup = base + (bi >> 3) * Q2K_SUPER
        off, aux = sup + (bi & 7) * 160, sup + 1280
        _Q2_K(n, acc, flat, off, aux, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
        return
    off = base + bi * _group_bytes(kind)
    if kind == KIND_Q5_0:
        _Q5_0(n, acc, flat, off, off, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
    elif kind == KIND_Q8_0:
        _Q8_0(n, acc, flat, off, off, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
    elif kind == KIND_Q4_1:
        _Q4_1(n, acc, flat, off, off, xq, xo, vstride, xd, xs, xf, bi, nb, v0)
    else:
        _Q4_0(n, acc, flat, off, off, xq, xo, vstride, xd, xs, xf, bi, nb, v0)


@njit(inline="always")
def _levels(kind):
    return 1 if kind == KIND_Q5_0 or _sb8(kind) else 2


@njit(inline="always")
def _sb8(kind):
    """Whether kind is in _SB8 (quantize_x_sb8's activations)."""
    return kind == KIND_Q4_K or kind == KIND_Q6_K or kind == KIND_Q5_K


@njit(inline="always")
def _group_bytes(kind):
    """GROUP_BYTES[kind]."""
    if kind == KIND_Q4_K:
        return 296
    if kind == KIND_Q6_K:
        return 420
    if kind == KIND_Q5_K:
        return 360
    if kind == KIND_IQ4_XS:
        return 276
    if kind == KIND_Q3_K:
        return 228
    if kind == KIND_Q2_K:
        return 168
    if kind == KIND_Q5_0:
        return 352
    if kind == KIND_Q8_0:
        return 544
    return 320 if kind == KIND_Q4_1 else 288


@njit(inline="always")
def _mv16(kind, d0, d1, d2, X, o0, o1, o2):
    """o_k[v, :] = W_k @ X[v] for up to three interleaved matrices of one format sharing
    X [nv, cols] (unused slots: 0-row arrays); o_k [nv, rows_k] (rows_k <= 16 groups)."""
    nv, cols = X.shape
    nb = cols // 32
    lv = _levels(kind)
    gb = _group_bytes(kind)
    xq = np.empty((nv, lv, cols), np.int8)
    xd = np.empty((nv, nb), np.float32)
    xs = np.empty((nv, nb), np.int32)
    xf = np.empty((nv, nb), np.float32)
    xh = np.empty((nv, 2 * nb), np.int32)
    quantize_x16(X, lv, _sb8(kind), xq, xd, xs, xf, xh)
    xqf, xdf, xsf, xff = xq.reshape(-1), xd.reshape(-1), xs.reshape(-1), xf.reshape(-1)
    if kind == KIND_Q6_K or kind == KIND_Q3_K or kind == KIND_Q2_K:
        xsf = xh.reshape(-1)
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    g0, g01 = d0.shape[0], d0.shape[0] + d1.shape[0]
    for i in prange(g01 + d2.shape[0]):
        if i < g0:
            flat, g, out = f0, np.int64(i), o0
        elif i < g01:
            flat, g, out = f1, np.int64(i - g0), o1
        else:
            flat, g, out = f2, np.int64(i - g01), o2
        base = g * nb * gb
        nrow = min(ROWS, out.shape[1] - g * ROWS)
        accp = _stack_acc()
        acc = numba.carray(accp, 16 * PASS)
        v0 = 0
        while v0 < nv:
            n = PASS if nv - v0 >= PASS else min(4, nv - v0)
            for j in range(16 * PASS):
                acc[j] = np.float32(0.0)
            xo0 = v0 * lv * cols
            for bi in range(nb):
                _block(kind, n, accp, flat, base, bi, xqf, xo0 + bi * 32, cols, xdf, xsf, xff,
                       nb, np.int64(v0))  # fmt: skip
            for v in range(n):
                for r in range(nrow):
                    out[v0 + v, g * ROWS + r] = acc[16 * v + r]
            v0 += n


@njit(inline="always")
def _mv16_one(kind, d0, d1, d2, x, o0, o1, o2):
    """_mv16 for one vector x [cols] into o_k [rows_k]."""
    o0, o1, o2 = o0.reshape(1, -1), o1.reshape(1, -1), o2.reshape(1, -1)
    _mv16(kind, d0, d1, d2, x.reshape(1, -1), o0, o1, o2)


# One vector (x [cols], o [rows]) and several (X [nv, cols], o [nv, rows]), as the row
# kernels' mv_* / mvb_* entry points (three slots); one compiled kernel per format.
@njit(parallel=True, cache=True, nogil=True)
def mv16_q4_0(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q4_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q4_1(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q4_1, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q5_0(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q5_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q8_0(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q8_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q4_k(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q4_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q6_k(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q6_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q5_k(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q5_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_iq4_xs(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_IQ4_XS, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q4_0(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q4_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q4_1(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q4_1, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q5_0(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q5_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q8_0(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q8_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q4_k(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q4_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q6_k(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q6_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q5_k(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q5_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_iq4_xs(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_IQ4_XS, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q3_k(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q3_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv16_q2_k(d0, d1, d2, x, o0, o1, o2):
    _mv16_one(KIND_Q2_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q3_k(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q3_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb16_q2_k(d0, d1, d2, X, o0, o1, o2):
    _mv16(KIND_Q2_K, d0, d1, d2, X, o0, o1, o2)
