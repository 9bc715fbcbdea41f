"""int8 block kernels: int8 activations x raw GGUF blocks with `vpdpbusd` (AVX-512 VNNI)
or, on CPUs with only AVX2, `vpmaddwd` on int16 activations (`DOT`; same lanes and
int32 results).

Decode has two exceptions: Q4_K, Q5_K and Q6_K take single-level int8 activations with
one scale per super-block refined per 32 by powers of two (quantize_x_sb8, q4_k_block8, and
the interleaved copies' rows16 kernels), half the multiplies for ~1e-4 KL on the logits
(see q4_k_block8): a single vector's decode is bound by DRAM either way, but several
vectors (a speculative verification pass, the batching scheduler) are bound by the
integer dots, which one level halves; on every int8 path Q5_0 takes a scale per 32 and
Q3_G64/Q2_G64 one per 64 (quantize_x1, "X1's formats"): 1.1-1.5x the kernels
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
`vpmaddwd`: 2 multiplies per 32 weights where vpmaddubsw on both int8 levels takes 4
(a 1024x4096 matvec, 1 thread, weights in L3: 292 against 425 us on Q4_1, 244 against 320
on Q4_K, 264 against 405 on Q8_0).

On the vnni path a Q4_1 matvec costs ~9-10 cycles per 64 weights (1 thread, weights in L2:
1536x576 in ~37 us; single-level q8 ~31 us, the portable float path ~83 us).
`python benchmarks/kernels.py --paths vnni avx2 portable --threads 1` re-measures both.
Rows never build views (`data[r]` costs an NRT incref/decref per row):
kernels index a flat byte array with offsets.

Entry points: `mv_<fmt>(d0, d1, d2, x, o0, o1, o2)` (up to three matrices sharing x, one
x quantization, one parallel launch; pass 0-row arrays for unused slots; matvec.py),
`mvb_<fmt>` (a few vectors, batch.py) and `mm_int8(kind, data, X, out)` (prefill, gemm.py).

Files, each after what it holds: ir (the IR builder, DOT), blocks (block intrinsics, kinds),
activations (x quantization), matvec, batch, gemm; rows16 (decode on 16-row interleaved
copies) and superblock (K-quant prefill on one activation scale per super-block). This
package re-exports the kernels and constants other modules take from the int8 path.

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

from edgerun.ops.int8.activations import (
    _scratch as _scratch,
)
from edgerun.ops.int8.activations import (
    quantize_xn as quantize_xn,
)
from edgerun.ops.int8.activations import (
    x_k8 as x_k8,
)
from edgerun.ops.int8.batch import (
    GROUP as GROUP,
)
from edgerun.ops.int8.batch import (
    mvb_q2_g64 as mvb_q2_g64,
)
from edgerun.ops.int8.batch import (
    mvb_q3_g64 as mvb_q3_g64,
)
from edgerun.ops.int8.batch import (
    mvb_q4_0 as mvb_q4_0,
)
from edgerun.ops.int8.batch import (
    mvb_q4_1 as mvb_q4_1,
)
from edgerun.ops.int8.batch import (
    mvb_q4_k as mvb_q4_k,
)
from edgerun.ops.int8.batch import (
    mvb_q5_0 as mvb_q5_0,
)
from edgerun.ops.int8.batch import (
    mvb_q6_k as mvb_q6_k,
)
from edgerun.ops.int8.batch import (
    mvb_q8_0 as mvb_q8_0,
)
from edgerun.ops.int8.blocks import (
    KIND_Q2_G64 as KIND_Q2_G64,
)
from edgerun.ops.int8.blocks import (
    KIND_Q3_G64 as KIND_Q3_G64,
)
from edgerun.ops.int8.blocks import (
    KIND_Q4_0 as KIND_Q4_0,
)
from edgerun.ops.int8.blocks import (
    KIND_Q4_1 as KIND_Q4_1,
)
from edgerun.ops.int8.blocks import (
    KIND_Q4_K as KIND_Q4_K,
)
from edgerun.ops.int8.blocks import (
    KIND_Q5_0 as KIND_Q5_0,
)
from edgerun.ops.int8.blocks import (
    KIND_Q6_K as KIND_Q6_K,
)
from edgerun.ops.int8.blocks import (
    KIND_Q8_0 as KIND_Q8_0,
)
from edgerun.ops.int8.blocks import (
    x1_span as x1_span,
)
from edgerun.ops.int8.gemm import (
    mm_int8 as mm_int8,
)
from edgerun.ops.int8.ir import (
    DOT as DOT,
)
from edgerun.ops.int8.matvec import (
    _row_k8 as _row_k8,
)
from edgerun.ops.int8.matvec import (
    _row_q4_0 as _row_q4_0,
)
from edgerun.ops.int8.matvec import (
    _row_q4_1 as _row_q4_1,
)
from edgerun.ops.int8.matvec import (
    _row_q5_0 as _row_q5_0,
)
from edgerun.ops.int8.matvec import (
    _row_q8_0 as _row_q8_0,
)
from edgerun.ops.int8.matvec import (
    mv_q2_g64 as mv_q2_g64,
)
from edgerun.ops.int8.matvec import (
    mv_q3_g64 as mv_q3_g64,
)
from edgerun.ops.int8.matvec import (
    mv_q4_0 as mv_q4_0,
)
from edgerun.ops.int8.matvec import (
    mv_q4_1 as mv_q4_1,
)
from edgerun.ops.int8.matvec import (
    mv_q4_k as mv_q4_k,
)
from edgerun.ops.int8.matvec import (
    mv_q5_0 as mv_q5_0,
)
from edgerun.ops.int8.matvec import (
    mv_q6_k as mv_q6_k,
)
from edgerun.ops.int8.matvec import (
    mv_q8_0 as mv_q8_0,
)
