"""Prefill GEMMs on Intel AMX tiles: Q4_K / Q6_K on int8 tiles, the block formats on
bf16 tiles (`mm_bf16_amx`, further down).

K-quants: the same integers as `int8.superblock`, 16 weight rows x 16 tokens at a time.
- A weight row is unpacked once per matmul into int16 w = q * sc (Q4_K, 0..945) or
  (q - 32) * sc (Q6_K, |w| <= 4096): the sub-block scales are folded in
  (`int8.superblock.prep_row_sb`). w is split into its low byte (u8) and its high
  byte (s8): w = 256 hi + lo.
- Each token's super-block is quantize_x's word 128 q1 + q2 (|v| <= 16320, one scale per
  256 elements, `quantize_tokens_sb`), split likewise into xl (u8) and xh (s8), laid out
  in AMX's VNNI tiles (4 consecutive elements of a token side by side).
- A super-block of a 16 x 16 tile is 16 tile dot products, 4 per 64 columns: lo.xl
  (TDPBUUD) into LL, lo.xh (TDPBUSD) and hi.xl (TDPBSUD) both into MID, hi.xh (TDPBSSD)
  into HH. Then, per row and token,
      dot = 256 (256 HH + MID) + LL
  is exactly the super-block dot of the vpdpwssd GEMM (256 HH + MID < 2^27; the sum is
  formed in float32, as it can pass 2^31), scaled by d_row * dx'_token, plus the Q4_K
  mins -dmin m_j * dx' sum(words) of each 32-element sub-block.

One tile product is 16 x 16 x 64 multiply-adds (~16 cycles, 5.3 ns at 3 GHz);
four of them replace 128 vpdpwssd. The tiles need the kernel's permission (arch_prctl
ARCH_REQ_XCOMP_PERM, once a process) and a tile configuration in every thread that runs
them (`_tile_config` per task).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import ctypes  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops.int8.blocks import (  # noqa: E402
    KIND_Q4_K,
    KIND_Q6_K,
)
from edgerun.ops.int8.gemm import (  # noqa: E402
    prep_row,
)
from edgerun.ops.int8.ir import (  # noqa: E402
    _IR,
    F0,
    I8,
    I16,
    I32,
    I64,
    V16F,
    V16I32,
    _store,
    _v,
)
from edgerun.ops.int8.superblock import (  # noqa: E402
    mm_superblock,
    q4k_sb_words,
    q6k_half_words,
    quantize_tokens_sb,
)
from edgerun.ops.portable.kernels import _f16at  # noqa: E402

TILE = 16  # weight rows (and tokens) per tile
CHUNK = 64  # columns per tile dot product (64 bytes a tile row)
SUPER = 256
# Fewest prompt tokens for which the tiles beat the AVX-512 GEMMs: both unpack every
# weight row once, and the tiles' unpack costs more. The int8 tiles (Q4_K/Q6_K) pass at
# ~11 tokens on Qwen2.5-1.5B (12 tokens: 218 against 285 ms per forward, 2 threads), the
# bf16 tiles (block formats) at ~24 on SmolLM2 and Gemma 3 270M (24 tokens: 54 against 64
# and 52 against 60 ms). Shorter prompts take the batched decode kernels anyway
# (ops/traits.py, prefill_max). Re-derive: `python benchmarks/amx_gemm.py -t 2 -n N`.
MIN_TOKENS = 11
BF16_MIN_TOKENS = 24
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86_64
V64I16, V64I8 = _v(I16, 64), _v(I8, 64)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True where this process may run AMX int8 tiles: an x86_64 Linux CPU with
    amx-tile and amx-int8, the kernel's permission granted, and EDGERUN_AMX not "0"."""
    if os.environ.get("EDGERUN_AMX", "1").strip() == "0":
        return False
    if platform.system() != "Linux" or not numba_env.x86_host():
        return False
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    if not (features.get("amx-tile") and features.get("amx-int8")):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        return False
    return granted == 0


# ------------------------------------------------------------------ tile intrinsics
@njit(inline="always")
def aligned_empty(n, dtype):
    """np.empty(n, dtype) starting on a 64-byte boundary, for arrays that tiles load or
    store. A tile load whose rows cross cache lines costs ~5x an aligned one (1 KB: 18-20
    ns against 4 ns), and Numba's allocations are 32-byte aligned (large ones, as the
    activation tiles, can start 32 bytes past a 64-byte line)."""
    a = np.empty(n + 64, dtype)
    skip = ((-a.ctypes.data) % 64) // a.itemsize
    return a[skip : skip + n]


@njit(inline="always")
def aligned_zeros(n, dtype):
    """aligned_empty, zeroed."""
    a = aligned_empty(n, dtype)
    a[:] = 0
    return a


_TILE_IMM = [ir.Constant(I8, t) for t in range(8)]


def _tile_fn(r, name, argtys):
    return r.fn(f"llvm.x86.{name}", ir.VoidType(), argtys)


def _i64(b, v):
    """An integer argument widened to the i64 a tile load's stride takes."""
    return b.sext(v, I64) if v.type.width < 64 else v


def _store_tile_column(r, arr_i, to, v):
    """The 16 int32 lanes of v into rows 0..15 of a 64-byte-row tile in array arg arr_i:
    lane k at byte offset to + 64 k (one token's column of a VNNI tile)."""
    b = r.b
    for k in range(TILE):
        at = b.add(to, ir.Constant(to.type, 64 * k))
        b.store(b.extract_element(v, ir.Constant(I32, k)), r.ptr(arr_i, at, I32), align=4)


@intrinsic
def _tile_config(typingctx, cfg):
    """ldtilecfg from the 64-byte configuration cfg (uint8)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        p = r.ptr(0, ir.Constant(I64, 0), I8)
        builder.call(_tile_fn(r, "ldtilecfg", [I8.as_pointer()]), [p])
        return context.get_dummy_value()

    return types.void(cfg), codegen


@njit(cache=True, nogil=True)
def _configure_tiles():
    """This thread's tile configuration: palette 1, all eight tiles 16 rows x 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = TILE
    _tile_config(cfg)


@njit(cache=True, nogil=True)
def _tile_rows_out(acc, out, r0, nr):
    """out[t, r0 + i] = acc [16-token group, row i, token] for rows i < nr and t < n."""
    n = out.shape[0]
    for g in range((n + TILE - 1) // TILE):
        for i in range(nr):
            for t in range(min(TILE, n - g * TILE)):
                out[g * TILE + t, r0 + i] = acc[(g * TILE + i) * TILE + t]


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        builder.call(_tile_fn(r, "tilerelease", []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def tile_superblock(typingctx, WL, WH, wo, wstride, XL, XH, xo, C):
    """One super-block of a 16 x 16 tile: the int32 tiles C [3, 16, 16] = lo.xl, lo.xh +
    hi.xl, hi.xh over the 256 columns at WL/WH[wo:] (rows wstride bytes apart) and the
    activation tiles XL/XH[xo:] (4 tiles of 1 KB, one per 64 columns)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        p8 = I8.as_pointer()
        load = _tile_fn(r, "tileloadd64", [I8, p8, I64])
        zero = _tile_fn(r, "tilezero", [I8])
        dots = {k: _tile_fn(r, f"tdpb{k}d", [I8, I8, I8]) for k in ("uu", "us", "su", "ss")}
        store = _tile_fn(r, "tilestored64", [I8, p8, I64])
        t = _TILE_IMM
        wstride = _i64(b, args[3])
        s64 = ir.Constant(I64, 64)
        for c in range(3):
            b.call(zero, [t[c]])
        for k in range(SUPER // CHUNK):
            wo = b.add(args[2], ir.Constant(args[2].type, CHUNK * k))
            xo = b.add(args[6], ir.Constant(args[6].type, TILE * CHUNK * k))
            b.call(load, [t[3], r.ptr(0, wo, I8), wstride])
            b.call(load, [t[5], r.ptr(4, xo, I8), s64])
            b.call(load, [t[4], r.ptr(1, wo, I8), wstride])
            b.call(load, [t[6], r.ptr(5, xo, I8), s64])
            b.call(dots["uu"], [t[0], t[3], t[5]])  # lo x xl
            b.call(dots["us"], [t[1], t[3], t[6]])  # lo x xh
            b.call(dots["ss"], [t[2], t[4], t[6]])  # hi x xh
            b.call(dots["su"], [t[1], t[4], t[5]])  # hi x xl
        for c in range(3):
            b.call(store, [t[c], r.ptr(7, ir.Constant(I64, 256 * c), I8), s64])
        return context.get_dummy_value()

    return types.void(WL, WH, wo, wstride, XL, XH, xo, C), codegen


@intrinsic
def tile_epilogue(typingctx, C, acc, ao, wd, wdo, dx, dxo, bias, bo, xs, xso, with_mins):
    """acc[ao:] [16 rows, 16 tokens] += (256 (256 HH + MID) + LL) * wd[wdo + row] *
    dx[dxo:dxo+16] for the tiles C = (LL, MID, HH), plus (with_mins, a literal)
    sum_j bias[bo + 8 row + j] * xs[xso + 16 j:][:16] over the 8 sub-blocks of 32."""
    if not isinstance(with_mins, types.BooleanLiteral):
        return None
    mins = with_mins.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        eight = ir.Constant(V16I32, [8] * 16)
        c256 = ir.Constant(V16F, [256.0] * 16)
        dxv = r.load(5, args[6], V16F)
        xsv = []
        if mins:
            xso = args[10]
            xsv = [r.load(9, b.add(xso, ir.Constant(xso.type, 16 * j)), V16F) for j in range(8)]

        def tile_row(c, row):
            return r.load(0, ir.Constant(I64, 256 * c + 16 * row), V16I32)

        for row in range(TILE):
            hi = b.add(b.shl(tile_row(2, row), eight), tile_row(1, row))  # < 2^27
            f = r.fma(b.sitofp(hi, V16F), c256, b.sitofp(tile_row(0, row), V16F))
            d = r.load(3, b.add(args[4], ir.Constant(args[4].type, row)), ir.FloatType())
            sv = b.fmul(dxv, r.splat(d, 16))
            ao = b.add(args[2], ir.Constant(args[2].type, 16 * row))
            a = r.fma(f, sv, r.load(1, ao, V16F))
            for j in range(8 if mins else 0):
                bo = b.add(args[8], ir.Constant(args[8].type, 8 * row + j))
                a = r.fma(r.splat(r.load(7, bo, ir.FloatType()), 16), xsv[j], a)
            _store(r, 1, ao, a)
        return context.get_dummy_value()

    return types.void(C, acc, ao, wd, wdo, dx, dxo, bias, bo, xs, xso, with_mins), codegen


def _put_bytes(r, wl_i, wh_i, wo):
    """A put(element offset, <n x i16> words) that stores the words' low bytes at
    WL[wo + offset] and their high bytes at WH[wo + offset] (array args wl_i, wh_i)."""
    b = r.b

    def put(k, v):
        n = v.type.count
        o = b.add(wo, ir.Constant(wo.type, k))
        _store(r, wl_i, o, b.trunc(v, _v(I8, n)))
        _store(r, wh_i, o, b.trunc(b.ashr(v, ir.Constant(v.type, [8] * n)), _v(I8, n)))

    return put


@intrinsic
def prep_q4k_sb_bytes(typingctx, WL, WH, wo, wd, so, b16, bo, flat, o):
    """`int8.superblock.prep_q4k_sb` with the words stored as low bytes WL[wo:] and
    high bytes WH[wo:] (no int16 row in between)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        q4k_sb_words(r, 7, args[8], 3, args[4], 5, args[6], _put_bytes(r, 0, 1, args[2]))
        return context.get_dummy_value()

    return types.void(WL, WH, wo, wd, so, b16, bo, flat, o), codegen


@intrinsic
def prep_q6k_half_bytes(typingctx, WL, WH, wo, flat, o, h):
    """`int8.superblock.st_q6k128` into low bytes WL[wo:] and high bytes WH[wo:]."""
    if not isinstance(h, types.IntegerLiteral):
        return None
    hv = h.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        _put_bytes(r, 0, 1, args[2])(0, q6k_half_words(r, 3, args[4], hv))
        return context.get_dummy_value()

    return types.void(WL, WH, wo, flat, o, h), codegen


@njit(cache=True, nogil=True)
def prep_row_bytes(kind, flat, base, cols, WL, WH, wo, wd, b16):
    """`int8.superblock.prep_row_sb` with the folded weights split into bytes:
    WL/WH[wo:wo+cols], wd [cols // 256] the super-block scales d, b16 [cols // 16] the
    Q4_K mins -dmin * m of each 16 elements."""
    nsb = cols // SUPER
    if kind == KIND_Q4_K:
        for s in range(nsb):
            prep_q4k_sb_bytes(WL, WH, wo + s * SUPER, wd, s, b16, s * 16, flat, base + s * 144)
    else:
        for s in range(nsb):
            o = base + s * 210
            wd[s] = _f16at(flat, o + 208)
            prep_q6k_half_bytes(WL, WH, wo + s * SUPER, flat, o, 0)
            prep_q6k_half_bytes(WL, WH, wo + s * SUPER + 128, flat, o, 1)


@intrinsic
def words_to_tiles(typingctx, xw, xo, XL, XH, to):
    """64 activation words xw[xo:] of one token -> their low bytes (u8) and high bytes
    (s8) in the VNNI tiles XL/XH: 4 consecutive elements as one int32 at byte offset
    to + 64 k for k = 0..15 (to: the token's column in row 0 of the tile)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        w = r.load(0, args[1], V64I16)
        hi = b.trunc(b.ashr(w, ir.Constant(V64I16, [8] * 64)), V64I8)
        _store_tile_column(r, 2, args[4], b.bitcast(b.trunc(w, V64I8), V16I32))
        _store_tile_column(r, 3, args[4], b.bitcast(hi, V16I32))
        return context.get_dummy_value()

    return types.void(xw, xo, XL, XH, to), codegen


# ------------------------------------------------------------------ activations
@njit(parallel=True, cache=True, nogil=True)
def activation_tiles(X, ng):
    """Rows of X [n, cols] -> quantize_x's words (`quantize_tokens_sb`: 128 q1 + q2 per
    super-block scale) as AMX tiles: XL (u8 low bytes) and XH (s8 high bytes), uint8
    [ng, cols // 64, 16, 64] (per 16 tokens and 64 columns the VNNI tile: row k // 4,
    byte 4 t + k % 4); the word scales dx' DX [ng, nsb, 16] and the 32-element sums
    dx' sum(words) XS [ng, nsb, 8, 16]. Tokens past n are zero."""
    n, cols = X.shape
    nsb = cols // SUPER
    nch = cols // CHUNK
    xw2, xsb, xs16 = quantize_tokens_sb(X, ng * TILE)
    xw = xw2.reshape(-1)
    XL = aligned_zeros(ng * nch * TILE * CHUNK, np.uint8)
    XH = aligned_zeros(ng * nch * TILE * CHUNK, np.uint8)
    DX = np.zeros((ng, nsb, TILE), np.float32)
    XS = np.zeros((ng, nsb, 8, TILE), np.float32)
    for t in prange(n):
        g = t // TILE
        tl = t % TILE
        for ch in range(nch):
            words_to_tiles(xw, t * cols + ch * CHUNK, XL, XH, (g * nch + ch) * 1024 + 4 * tl)
        for s in range(nsb):
            DX[g, s, tl] = xsb[t, s]
            for j in range(8):
                XS[g, s, j, tl] = xs16[t, 16 * s + 2 * j] + xs16[t, 16 * s + 2 * j + 1]
    return XL, XH, DX, XS


# ------------------------------------------------------------------------ GEMM
@njit(cache=True, nogil=True)
def _prep_tile(kind, flat, r0, nr, rb, cols, wd, b16, WL, WH, wdT, bias):
    """Unpack rows r0..r0+nr of the matrix into the tile's WL/WH (rows past nr zero), the
    super-block scales wdT [nsb, 16] and the Q4_K mins bias [nsb, 16, 8]."""
    nsb = cols // SUPER
    WL[nr * cols :] = 0
    WH[nr * cols :] = 0
    for i in range(nr):
        prep_row_bytes(kind, flat, (r0 + i) * rb, cols, WL, WH, i * cols, wd[i], b16[i])
    for s in range(nsb):
        for i in range(TILE):
            wdT[s, i] = wd[i, s] if i < nr else F0
            for j in range(8):
                bias[s, i, j] = b16[i, 16 * s + 2 * j] if i < nr else F0


@njit(parallel=True, cache=True, nogil=True)
def mm_superblock_amx(kind, data, X, out, nparts):
    """out [n, rows] = X [n, cols] @ W.T for a Q4_K (kind 7) or Q6_K (kind 8) matrix
    data uint8 [rows, row bytes], cols a multiple of 256, on AMX tiles. The row tiles
    are split into nparts contiguous parts (one buffer set each). Tried (within noise or
    slower): column spans keeping the tile's weights in L1 across all tokens,
    tile-contiguous weight bytes, a fourth C tile, an epilogue one super-block behind.
    The other super-block kinds (Q5_K, IQ4_XS, Q3_K, Q2_K) take the AVX-512 GEMM: the
    tiles' unpack and epilogue (a bias per 32 elements) know Q4_K and Q6_K only."""
    if kind != KIND_Q4_K and kind != KIND_Q6_K:
        mm_superblock(kind, data, X, out)
        return
    n, cols = X.shape
    ng = (n + TILE - 1) // TILE
    XL, XH, DX, XS = activation_tiles(X, ng)
    dxf = DX.reshape(-1)
    xsf = XS.reshape(-1)
    rows = data.shape[0]
    flat = data.reshape(-1)
    rb = data.shape[1]
    nsb = cols // SUPER
    nch = cols // CHUNK
    x16w = (cols // 16 + 15) // 16 * 16
    mins = kind == KIND_Q4_K
    ntiles = (rows + TILE - 1) // TILE
    nparts = max(1, min(nparts, ntiles))
    for p in prange(nparts):
        wd = np.zeros((TILE, nsb), np.float32)
        b16 = np.zeros((TILE, x16w), np.float32)
        WL = aligned_empty(TILE * cols, np.uint8)
        WH = aligned_empty(TILE * cols, np.uint8)
        wdT = np.empty((nsb, TILE), np.float32)
        bias = np.empty((nsb, TILE, 8), np.float32)
        wdf = wdT.reshape(-1)
        biasf = bias.reshape(-1)
        C = aligned_empty(3 * TILE * TILE, np.int32)
        acc = np.empty(ng * TILE * TILE, np.float32)
        _configure_tiles()
        for tile in range(p * ntiles // nparts, (p + 1) * ntiles // nparts):
            r0 = tile * TILE
            nr = min(TILE, rows - r0)
            _prep_tile(kind, flat, r0, nr, rb, cols, wd, b16, WL, WH, wdT, bias)
            acc[:] = F0
            for g in range(ng):
                ao = g * TILE * TILE
                for s in range(nsb):
                    xo = (g * nch + 4 * s) * 1024
                    tile_superblock(WL, WH, s * SUPER, cols, XL, XH, xo, C)
                    so = (g * nsb + s) * TILE
                    wo = s * TILE
                    if mins:
                        bo, xs = wo * 8, so * 8
                        tile_epilogue(C, acc, ao, wdf, wo, dxf, so, biasf, bo, xsf, xs, True)
                    else:
                        tile_epilogue(C, acc, ao, wdf, wo, dxf, so, biasf, 0, xsf, 0, False)
            _tile_rows_out(acc, out, r0, nr)
        _tile_release()


# ------------------------------------------------- any int8-path format: bf16 pairs
# Block-32 formats scale every 32 weights by a float, so their integer dots cannot run
# over a super-block as above. Here each weight is dequantized once per matmul
# (prep_row's u * lane scale + 16-group bias, exact in float32) and split into two
# bfloat16, w = hi + lo (16 significant bits); the activations likewise. TDPBF16PS
# accumulates hi.xhi + hi.xlo + lo.xhi in float32 inside the tile (the lo.xlo term is
# below 2^-16 of the product), over the whole row with no epilogue.
BF_CHUNK = 32  # columns per bf16 tile dot product (32 pairs of bf16 = 64 bytes)
V16I16, V32I16, V32F = _v(I16, 16), _v(I16, 32), _v(ir.FloatType(), 32)


def _bf16_split(b, x):
    """float32 vector -> (hi, lo) bf16 bits as i16 vectors, round to nearest even:
    hi = bf16(x), lo = bf16(x - hi)."""
    n = x.type.count
    vi = _v(I32, n)

    def rne(v):
        u = b.bitcast(v, vi)
        odd = b.and_(b.lshr(u, ir.Constant(vi, [16] * n)), ir.Constant(vi, [1] * n))
        r = b.add(u, b.add(odd, ir.Constant(vi, [0x7FFF] * n)))
        return b.and_(r, ir.Constant(vi, [-65536] * n))

    hi = rne(x)
    lo = rne(b.fsub(x, b.bitcast(hi, x.type)))
    sh = ir.Constant(vi, [16] * n)
    return b.trunc(b.lshr(hi, sh), _v(I16, n)), b.trunc(b.lshr(lo, sh), _v(I16, n))


@intrinsic
def deq_bf16_16(typingctx, U, uo, wsl, so, b16, bo, AH, AL, o):
    """16 weights u * wsl[so + k // 4] + b16[bo] from prep_row's bytes U[uo:] ->
    their bf16 halves AH/AL[o:o+16] (uint16)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        u = b.uitofp(r.load(0, args[1], _v(I8, 16)), V16F)
        s4 = r.load(2, args[3], _v(ir.FloatType(), 4))
        sv = r.shuf(s4, s4, [k // 4 for k in range(16)])
        bias = r.splat(r.load(4, args[5], ir.FloatType()), 16)
        hi, lo = _bf16_split(b, r.fma(u, sv, bias))
        _store(r, 6, args[8], hi)
        _store(r, 7, args[8], lo)
        return context.get_dummy_value()

    return types.void(U, uo, wsl, so, b16, bo, AH, AL, o), codegen


@intrinsic
def x_bf16_tiles(typingctx, X, xo, BH, BL, to):
    """32 activations X[xo:] of one token -> their bf16 halves in the VNNI pair tiles
    BH/BL (uint8): elements 2k, 2k + 1 as one int32 at byte offset to + 64 k."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        hi, lo = _bf16_split(b, r.load(0, args[1], V32F))
        _store_tile_column(r, 2, args[4], b.bitcast(hi, V16I32))
        _store_tile_column(r, 3, args[4], b.bitcast(lo, V16I32))
        return context.get_dummy_value()

    return types.void(X, xo, BH, BL, to), codegen


@intrinsic
def tile_zero2(typingctx):
    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        for t in range(2):
            builder.call(_tile_fn(r, "tilezero", [I8]), [_TILE_IMM[t]])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def bf16_chunk2(typingctx, AH, AL, wo, wstride, BH, BL, xo0, xo1):
    """Tiles 0 and 1 (two 16-token groups) += the 16 rows' 32 columns at AH/AL[wo:]
    (uint16, rows wstride bytes apart) times the groups' tiles BH/BL at byte xo0 / xo1:
    hi.xhi + hi.xlo + lo.xhi each."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        p8 = I8.as_pointer()
        load = _tile_fn(r, "tileloadd64", [I8, p8, I64])
        dot = _tile_fn(r, "tdpbf16ps", [I8, I8, I8])
        t = _TILE_IMM
        ws = _i64(b, args[3])
        s64 = ir.Constant(I64, 64)

        def wptr(i):
            a = context.make_array(sig.args[i])(context, builder, args[i])
            return b.bitcast(b.gep(a.data, [args[2]]), p8)

        b.call(load, [t[2], wptr(0), ws])
        b.call(load, [t[3], wptr(1), ws])
        for g, xo in enumerate((args[6], args[7])):
            bh, bl = t[4 + 2 * g], t[5 + 2 * g]
            b.call(load, [bh, r.ptr(4, xo, I8), s64])
            b.call(load, [bl, r.ptr(5, xo, I8), s64])
            b.call(dot, [t[g], t[2], bh])
            b.call(dot, [t[g], t[2], bl])
            b.call(dot, [t[g], t[3], bh])
        return context.get_dummy_value()

    return types.void(AH, AL, wo, wstride, BH, BL, xo0, xo1), codegen


@intrinsic
def tile_store2(typingctx, acc, ao0, ao1):
    """acc[ao0:ao0+256] = tile 0 and acc[ao1:ao1+256] = tile 1 (float32 16 x 16)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        store = _tile_fn(r, "tilestored64", [I8, I8.as_pointer(), I64])
        for t, ao in ((0, args[1]), (1, args[2])):
            builder.call(store, [_TILE_IMM[t], r.ptr(0, ao, I8), ir.Constant(I64, 64)])
        return context.get_dummy_value()

    return types.void(acc, ao0, ao1), codegen


@njit(parallel=True, cache=True, nogil=True)
def activation_bf16_tiles(X, ng2, c64):
    """Rows of X [n, cols] (cols % 32 == 0) -> bf16 halves BH/BL, uint8
    [ng2, c64 // 32, 16, 64]: per 16 tokens and 32 columns the VNNI pair tile (row k // 2,
    bytes 4 t + 2 (k % 2)). Tokens past n and columns past cols are zero."""
    n, cols = X.shape
    nch = c64 // BF_CHUNK
    BH = aligned_zeros(ng2 * nch * TILE * 64, np.uint8)
    BL = aligned_zeros(ng2 * nch * TILE * 64, np.uint8)
    Xf = X.reshape(-1)
    for t in prange(n):
        g = t // TILE
        tl = t % TILE
        for ch in range(cols // BF_CHUNK):
            x_bf16_tiles(Xf, t * cols + ch * BF_CHUNK, BH, BL, (g * nch + ch) * 1024 + 4 * tl)
    return BH, BL


@njit(parallel=True, cache=True, nogil=True)
def mm_bf16_amx(kind, data, X, out, nparts):
    """out [n, rows] = X [n, cols] @ W.T for any format `int8.prep_row` unpacks
    (cols % 32 == 0), on AMX bf16 tiles; the row tiles in nparts contiguous parts."""
    n, cols = X.shape
    c64 = (cols + 63) // 64 * 64
    nch = c64 // BF_CHUNK
    ng = (n + TILE - 1) // TILE
    ng2 = (ng + 1) // 2 * 2
    BH, BL = activation_bf16_tiles(np.ascontiguousarray(X), ng2, c64)
    rows = data.shape[0]
    flat = data.reshape(-1)
    rb = data.shape[1]
    c4 = c64 // 4
    x16w = (c64 // 16 + 15) // 16 * 16
    ntiles = (rows + TILE - 1) // TILE
    nparts = max(1, min(nparts, ntiles))
    for p in prange(nparts):
        U = np.zeros((TILE, c64), np.uint8)
        wsl = np.zeros((TILE, c4), np.float32)
        b16 = np.zeros((TILE, x16w), np.float32)
        AH = aligned_empty(TILE * c64, np.uint16)
        AL = aligned_empty(TILE * c64, np.uint16)
        acc = aligned_empty(ng2 * TILE * TILE, np.float32)
        _configure_tiles()
        for tile in range(p * ntiles // nparts, (p + 1) * ntiles // nparts):
            r0 = tile * TILE
            nr = min(TILE, rows - r0)
            # prep_row writes a row's first cols entries; the padding past cols keeps
            # the zeros of the allocation, and rows past nr (the last tile) are cleared
            U[nr:] = 0
            wsl[nr:] = F0
            b16[nr:] = F0
            for i in range(nr):
                prep_row(kind, flat, (r0 + i) * rb, cols, U[i], wsl[i], b16[i])
            Uf = U.reshape(-1)
            wf = wsl.reshape(-1)
            bf = b16.reshape(-1)
            for i in range(TILE):
                for j in range(0, c64, 16):
                    o = i * c64 + j
                    deq_bf16_16(Uf, o, wf, i * c4 + j // 4, bf, i * x16w + j // 16, AH, AL, o)
            for g in range(0, ng2, 2):
                tile_zero2()
                for ch in range(nch):
                    xo = (g * nch + ch) * 1024
                    bf16_chunk2(AH, AL, ch * BF_CHUNK, 2 * c64, BH, BL, xo, xo + nch * 1024)
                tile_store2(acc, g * TILE * TILE, (g + 1) * TILE * TILE)
            _tile_rows_out(acc, out, r0, nr)
        _tile_release()
