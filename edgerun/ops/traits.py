"""The kernel traits table: ONE row per format, its kernels on every path (ggml's
type_traits_cpu).

A row names the format's portable kernels (float32, any CPU), its int8 kernels (the vnni,
avx2 and int8 paths: 3-slot matvec, batched decode, GEMM kind, K-quant super-block GEMM
kind), its kernels on the vnni path's 16-row interleaved copies, and its batched/GEMM
crossover per prefill route. None: the format has no kernel on that path and takes the
next one (qmatvec). ops/qmatvec dispatches through this table only; a new format is one
row here plus its kernels in portable/, int8/ (and rows16 for interleaved copies).

Defining the int8 kernels is harmless on any CPU (running the x86 forms elsewhere is not):
qmatvec only calls them on the paths int8_dot() allows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgerun.ops.int8 import batch as _ib
from edgerun.ops.int8 import blocks as _ik
from edgerun.ops.int8 import matvec as _im
from edgerun.ops.int8 import rows16 as _r16
from edgerun.ops.int8 import superblock as _sb
from edgerun.ops.portable import batch as _pb
from edgerun.ops.portable import gridquants as _pg
from edgerun.ops.portable import kernels as _p
from edgerun.ops.portable import lowbit as _pl
from edgerun.quant.formats import QuantType

__all__ = ["NO_GEMM", "ROUTES", "TRAITS", "Traits", "prefill_max"]

_MM_ROW_BLOCK = 16  # weight rows the portable GEMM dequantizes per chunk

NO_GEMM = 1 << 30  # a prompt length no prompt reaches: the format always takes mvb_<fmt>
ROUTES = ("amx", "vnni", "avx2", "int8")
# Crossovers (Traits.prefill_max): prompts of at most prefill_max[route] tokens take the
# batched decode kernels (mvb_<fmt>: blocks read in place, a cost per token) instead of a
# GEMM (a fixed cost per call to unpack every weight row, then little per token). Each
# figure is the prompt length where the GEMM's time falls below the batched kernels' on
# that route, 2 threads; _ROUTE_DEFAULT holds the route's figure for formats that set none.
# Re-derive: move a row's figure either side and compare prefill, alternating, e.g.
# `edgerun bench -m qwen2.5-coder-1.5b -p 4,8,12,16,24,32 -t 2`.
# - amx: tiles pass the batched kernels at ~10 tokens on Q4_K/Q6_K (Qwen2.5-1.5B, 12
#   tokens: 218 against 251 ms per forward), ~24 on the block formats (0.5B, SmolLM2).
# - vnni: the AVX-512 GEMMs at ~14 on Q4_K/Q6_K (16 tokens: 307 against 313 ms), ~28 on
#   the block formats; the super-block GEMM at ~12 on Q5_K and IQ4_XS (Qwen2.5-1.5B's
#   three shapes through qmatvec.matmul, each route forced by MVB_PREFILL_MAX, one
#   thread, CPU time: GEMM over batched 0.93 / 1.02 at 12 tokens, 1.14 / 1.18 at 8).
# - avx2: GEMM over batched time reaches 1.0 at 6 tokens for Q6_K, ~14 for Q4_K, 12 for
#   Q8_0, ~24 for Q4_0/Q4_1; Q5_0 and the G64 formats stay above 1.1 up to 512 tokens
#   (their batched kernels multiply single-level int8 from L1, the GEMM two-level int16
#   words), so they never take a GEMM (NO_GEMM).
# - int8 (generic vectors, e.g. ARM) takes avx2's figures: not measured there.
_ROUTE_DEFAULT = {"amx": 23, "vnni": 28, "avx2": 24, "int8": 24}


def _xover(amx: int | None = None, vnni: int | None = None, avx2: int | None = None) -> dict:
    """A format's prefill_max per route; "int8" takes avx2's figure."""
    avx2 = _ROUTE_DEFAULT["avx2"] if avx2 is None else avx2
    return {
        "amx": _ROUTE_DEFAULT["amx"] if amx is None else amx,
        "vnni": _ROUTE_DEFAULT["vnni"] if vnni is None else vnni,
        "avx2": avx2,
        "int8": avx2,
    }


@dataclass(frozen=True)
class Traits:
    """One format's kernels. Portable ones take raw uint8 blocks [rows, row_bytes]:
    matvec(data, x, out), matvec_batch(data, X, out), gemm(data, X, out),
    embedding_rows(data, ids, out). int8 ones: mv3 / mvb3(d0, d1, d2, x, o0, o1, o2) for
    up to three matrices sharing x; gemm_kind is int8.gemm.mm_int8's kind,
    superblock_kind int8.superblock's. mv16 / mvb16 run on interleaved copies.
    sb8_decode: on this path its decode (one vector or batched) takes single-level int8
    activations, one scale per super-block (quantize_x_sb8). sparse_rows:
    sparse_ffn.matvec_rows runs its indexed rows on the int8 row kernels of gemm_kind."""

    matvec: Callable
    gemm: Callable
    embedding_rows: Callable
    matvec_batch: Callable | None = None
    mv3: Callable | None = None
    mvb3: Callable | None = None
    gemm_kind: int | None = None
    superblock_kind: int | None = None
    mv16: Callable | None = None
    mvb16: Callable | None = None
    sb8_decode: bool = False
    sparse_rows: bool = False
    prefill_max: dict = field(default_factory=_xover)


# portable bindings of the kernels that take a view or a table
def _mv_f32(d, x, o):
    _p.mv_f32(d.view(np.float32), x, o)


def _mv_f16(d, x, o):
    _p.mv_f16(d.view(np.uint16), x, o, False)


def _mv_bf16(d, x, o):
    _p.mv_f16(d.view(np.uint16), x, o, True)


def _mv_q5_0(d, x, o):
    _p.mv_q5_0(d, x, o, _p.Q5_HBITS)


def _mvb_q5_0(d, x, o):
    _pb.mvb_q5_0(d, x, o, _p.Q5_HBITS)


def _mv_deq(kind: int) -> Callable:
    def mv(d, x, o):
        _p.mv_deq(kind, d, x, o)

    return mv


def _mvb_deq(kind: int) -> Callable:
    def mvb(d, X, o):
        _pb.mvb_deq(kind, d, X, o)

    return mvb


def _deq_kernels(kind: int, gemm_kind: int, mv3: Callable, mvb3: Callable) -> dict:
    """A row of a format whose portable decode reads dequantized rows (Q2_K, Q3_K):
    portable decode through them (portable.kernels.mv_deq), batch, GEMM and embedding
    rows; on the int8 paths the matvec mv3, the batched decode mvb3 and the GEMM
    (gemm_kind). The crossovers are Q5_K's (its super-block GEMM and batched kernels
    have the same shape of cost); not measured for these two."""
    return {
        "matvec": _mv_deq(kind),
        **_portable(kind),
        "matvec_batch": _mvb_deq(kind),
        "mv3": mv3,
        "mvb3": mvb3,
        "gemm_kind": gemm_kind,
        "prefill_max": _xover(amx=10, vnni=12, avx2=14),
    }


def _grid_kernels(kind: int) -> dict:
    """A row of a grid format (IQ2_XXS .. IQ1_S): the fused portable decode matvec
    and batched decode (portable.gridquants.mv_grid, mvb_grid: equal bit for bit) on every
    path; GEMM and embedding rows through dequantized rows (portable.kernels.deq_row); no
    int8 kernels."""

    def mv(d, x, o):
        _pg.mv_grid(kind, d, x, o)

    def mvb(d, X, o):
        _pg.mvb_grid(kind, d, X, o)

    return {"matvec": mv, **_portable(kind), "matvec_batch": mvb}


def _gemm(kind: int) -> Callable:
    def gemm(data, X, out):
        _p.mm_kernel(kind, data, X, out, _MM_ROW_BLOCK)

    return gemm


def _portable(kind: int) -> dict:
    return {"gemm": _gemm(kind), "embedding_rows": _p.embedding_rows_kernel(kind)}


TRAITS: dict[QuantType, Traits] = {
    QuantType.F32: Traits(_mv_f32, **_portable(_p.KIND_F32)),
    QuantType.F16: Traits(_mv_f16, **_portable(_p.KIND_F16)),
    QuantType.BF16: Traits(_mv_bf16, **_portable(_p.KIND_BF16)),
    QuantType.Q8_0: Traits(
        _p.mv_q8_0, **_portable(_p.KIND_Q8_0), matvec_batch=_pb.mvb_q8_0,
        mv3=_im.mv_q8_0, mvb3=_ib.mvb_q8_0, gemm_kind=_ik.KIND_Q8_0,
        mv16=_r16.mv16_q8_0, mvb16=_r16.mvb16_q8_0, sparse_rows=True,
        prefill_max=_xover(avx2=12),
    ),
    QuantType.Q4_0: Traits(
        _p.mv_q4_0, **_portable(_p.KIND_Q4_0), matvec_batch=_pb.mvb_q4_0,
        mv3=_im.mv_q4_0, mvb3=_ib.mvb_q4_0, gemm_kind=_ik.KIND_Q4_0,
        mv16=_r16.mv16_q4_0, mvb16=_r16.mvb16_q4_0, sparse_rows=True,
    ),
    QuantType.Q4_1: Traits(
        _p.mv_q4_1, **_portable(_p.KIND_Q4_1), matvec_batch=_pb.mvb_q4_1,
        mv3=_im.mv_q4_1, mvb3=_ib.mvb_q4_1, gemm_kind=_ik.KIND_Q4_1,
        mv16=_r16.mv16_q4_1, mvb16=_r16.mvb16_q4_1, sparse_rows=True,
    ),
    QuantType.Q5_0: Traits(
        _mv_q5_0, **_portable(_p.KIND_Q5_0), matvec_batch=_mvb_q5_0,
        mv3=_im.mv_q5_0, mvb3=_ib.mvb_q5_0, gemm_kind=_ik.KIND_Q5_0,
        mv16=_r16.mv16_q5_0, mvb16=_r16.mvb16_q5_0, sparse_rows=True,
        prefill_max=_xover(avx2=NO_GEMM),
    ),
    QuantType.Q4_K: Traits(
        _p.mv_q4_k, **_portable(_p.KIND_Q4_K), matvec_batch=_pb.mvb_q4_k,
        mv3=_im.mv_q4_k, mvb3=_ib.mvb_q4_k, gemm_kind=_ik.KIND_Q4_K,
        superblock_kind=_sb.KIND_Q4_K, mv16=_r16.mv16_q4_k, mvb16=_r16.mvb16_q4_k,
        sb8_decode=True, sparse_rows=True, prefill_max=_xover(amx=10, vnni=14, avx2=14),
    ),
    QuantType.Q6_K: Traits(
        _p.mv_q6_k, **_portable(_p.KIND_Q6_K), matvec_batch=_pb.mvb_q6_k,
        mv3=_im.mv_q6_k, mvb3=_ib.mvb_q6_k, gemm_kind=_ik.KIND_Q6_K,
        superblock_kind=_sb.KIND_Q6_K, mv16=_r16.mv16_q6_k, mvb16=_r16.mvb16_q6_k,
        sb8_decode=True, sparse_rows=True, prefill_max=_xover(amx=10, vnni=14, avx2=6),
    ),
    QuantType.Q5_1: Traits(
        _mv_deq(_p.KIND_Q5_1), **_portable(_p.KIND_Q5_1), matvec_batch=_mvb_deq(_p.KIND_Q5_1),
        mv3=_im.mv_q5_1, mvb3=_ib.mvb_q5_1, gemm_kind=_ik.KIND_Q5_1,
    ),
    QuantType.IQ4_NL: Traits(
        _mv_deq(_p.KIND_IQ4_NL), **_portable(_p.KIND_IQ4_NL),
        matvec_batch=_mvb_deq(_p.KIND_IQ4_NL),
        mv3=_im.mv_iq4_nl, mvb3=_ib.mvb_iq4_nl, gemm_kind=_ik.KIND_IQ4_NL,
    ),
    QuantType.Q5_K: Traits(
        _mv_deq(_p.KIND_Q5_K), **_portable(_p.KIND_Q5_K), matvec_batch=_mvb_deq(_p.KIND_Q5_K),
        mv3=_im.mv_q5_k, mvb3=_ib.mvb_q5_k, gemm_kind=_ik.KIND_Q5_K,
        superblock_kind=_sb.KIND_Q5_K, mv16=_r16.mv16_q5_k, mvb16=_r16.mvb16_q5_k,
        sb8_decode=True, prefill_max=_xover(amx=10, vnni=12, avx2=14),
    ),
    QuantType.IQ4_XS: Traits(
        _mv_deq(_p.KIND_IQ4_XS), **_portable(_p.KIND_IQ4_XS),
        matvec_batch=_mvb_deq(_p.KIND_IQ4_XS),
        mv3=_im.mv_iq4_xs, mvb3=_ib.mvb_iq4_xs, gemm_kind=_ik.KIND_IQ4_XS,
        superblock_kind=_sb.KIND_IQ4_XS, mv16=_r16.mv16_iq4_xs, mvb16=_r16.mvb16_iq4_xs,
        prefill_max=_xover(amx=10, vnni=12, avx2=14),
    ),
    QuantType.IQ2_XXS: Traits(**_grid_kernels(_pg.KIND_IQ2_XXS)),
    QuantType.IQ2_XS: Traits(**_grid_kernels(_pg.KIND_IQ2_XS)),
    QuantType.IQ2_S: Traits(**_grid_kernels(_pg.KIND_IQ2_S)),
    QuantType.IQ3_XXS: Traits(**_grid_kernels(_pg.KIND_IQ3_XXS)),
    QuantType.IQ3_S: Traits(**_grid_kernels(_pg.KIND_IQ3_S)),
    QuantType.IQ1_S: Traits(**_grid_kernels(_pg.KIND_IQ1_S)),
    QuantType.Q2_K: Traits(
        **_deq_kernels(_p.KIND_Q2_K, _ik.KIND_Q2_K, _im.mv_q2_k, _ib.mvb_q2_k),
        superblock_kind=_sb.KIND_Q2_K, mv16=_r16.mv16_q2_k, mvb16=_r16.mvb16_q2_k,
    ),
    QuantType.Q3_K: Traits(
        **_deq_kernels(_p.KIND_Q3_K, _ik.KIND_Q3_K, _im.mv_q3_k, _ib.mvb_q3_k),
        superblock_kind=_sb.KIND_Q3_K, mv16=_r16.mv16_q3_k, mvb16=_r16.mvb16_q3_k,
    ),
    QuantType.Q3_G64: Traits(
        _pl.mv_q3_g64, _pl.mm_q3_g64, _pl.emb_q3_g64,
        mv3=_im.mv_q3_g64, mvb3=_ib.mvb_q3_g64, gemm_kind=_ik.KIND_Q3_G64,
        prefill_max=_xover(avx2=NO_GEMM),
    ),
    QuantType.Q2_G64: Traits(
        _pl.mv_q2_g64, _pl.mm_q2_g64, _pl.emb_q2_g64,
        mv3=_im.mv_q2_g64, mvb3=_ib.mvb_q2_g64, gemm_kind=_ik.KIND_Q2_G64,
        prefill_max=_xover(avx2=NO_GEMM),
    ),
}  # fmt: skip


def prefill_max(route: str, qtype: QuantType | None) -> int:
    """The most prompt tokens for which `qtype` takes the batched decode kernels on
    `route` (one of ROUTES); None or a format without a row: the route's default."""
    t = TRAITS.get(qtype)
    return _ROUTE_DEFAULT[route] if t is None else t.prefill_max[route]
