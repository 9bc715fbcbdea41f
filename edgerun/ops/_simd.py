"""Small Numba intrinsics shared by the block kernels (portable: any LLVM target).

- `h2f(u16)`: exact IEEE fp16 -> fp32 (LLVM `fpext half`; vcvtph2ps on x86 with F16C,
  fcvt on ARM).
- `bf2f(u16)`: bfloat16 -> fp32 (a shift and a bit cast).
- `stack16()`: a pointer to 16 float32 on the stack; wrap it with `numba.carray` to get
  16 lane accumulators that LLVM promotes to registers (SROA), with no heap allocation.
- `hsum16(acc)`, `dot16(a, b)`: the 16-lane sum and dot product built on it (the SLP
  vectorizer packs the lanes; Numba's loop vectorizer stays off). `dot16` widens `b`
  with `widen`, so it also reads f16 bits (uint16), as an f16 KV cache stores them.
- `zero16`, `madd16`, `axpy16`, `vsum16`, `store16`, `max16`, `exp_shift16`: explicit
  16-lane vector ops on a stack16() accumulator and C-contiguous float32 / fp16-bits
  arrays (attention). Per-lane
  code over slices lets the SLP vectorizer gather k rows lane by lane (vgatherqps) and
  build f16 vectors from 16 scalar loads: attention runs ~4x slower that way.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _to_i16(builder, v):
    w = v.type.width
    if w > 16:
        return builder.trunc(v, _I16)
    if w < 16:
        return builder.zext(v, _I16)
    return v


@intrinsic
def h2f(typingctx, v):
    """fp16 bits (any integer type; the low 16 bits are used) -> float32, exact."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        h = builder.bitcast(_to_i16(builder, args[0]), ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def bf2f(typingctx, v):
    """bfloat16 bits (any integer type; the low 16 bits are used) -> float32, exact."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        u = builder.zext(_to_i16(builder, args[0]), _I32)
        u = builder.shl(u, ir.Constant(_I32, 16))
        return builder.bitcast(u, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def stack16(typingctx):
    """Pointer to 16 uninitialised float32 in the function's entry block (stack)."""

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=ir.Constant(ir.IntType(64), 16))

    return types.CPointer(types.float32)(), codegen


def widen(x):
    """A float32 value as is; fp16 bits (an integer) converted with h2f."""
    return x


@overload(widen, inline="always")
def _widen_impl(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if isinstance(x, types.Integer):
        return lambda x: h2f(x)
    return None


@njit(inline="always")
def hsum16(acc):
    t = np.float32(0.0)
    for l in range(16):
        t += acc[l]
    return t


@njit(inline="always")
def dot16(a, b):
    """sum(a * widen(b)) over 16 lane accumulators."""
    n = a.shape[0]
    acc = numba.carray(stack16(), 16)
    for l in range(16):
        acc[l] = np.float32(0.0)
    n16 = n // 16
    for c in range(n16):
        ac = a[c * 16 : c * 16 + 16]
        bc = b[c * 16 : c * 16 + 16]
        for l in range(16):
            acc[l] += ac[l] * widen(bc[l])
    t = hsum16(acc)
    for j in range(n16 * 16, n):
        t += a[j] * widen(b[j])
    return t


_V16F = ir.VectorType(ir.FloatType(), 16)


def _is_c_array(t, dtypes=(types.float32, types.uint16)) -> bool:
    return isinstance(t, types.Array) and t.layout == "C" and t.dtype in dtypes


def _load16(context, builder, aryty, ary, index):
    """<16 x float> from a C-contiguous float32 or fp16-bits (uint16) array's flat
    elements index..index+15: one vector load (and one vcvtph2ps), where per-lane code
    let the SLP vectorizer assemble the vector from 16 scalar loads and shuffles."""
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.gep(data, [index])
    if aryty.dtype == types.float32:
        return builder.load(builder.bitcast(ptr, _V16F.as_pointer()), align=4)
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(_I16, 16).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), _V16F)


def _acc_ptr(builder, acc):
    return builder.bitcast(acc, _V16F.as_pointer())


def _splat16(builder, x):
    """<16 x float> with every lane x."""
    v = builder.insert_element(ir.Constant(_V16F, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), None))


def _accumulate16(builder, acc, a, b):
    """acc[0:16] += a * b (<16 x float> a, b; contracted to one FMA)."""
    p = _acc_ptr(builder, acc)
    prod = builder.fmul(a, b, flags=("contract",))
    builder.store(builder.fadd(builder.load(p, align=4), prod, flags=("contract",)), p, align=4)


def tree_sum16(builder, p):
    """IR: the sum of the 16 float32 at pointer p as a fixed tree (8+8, 4+4, 2+2, 1+1),
    not a 16-step serial chain; one order for every caller (vsum16, the VNNI kernels'
    hsum16), so batched rows round as single ones."""
    v = builder.load(_acc_ptr(builder, p), align=4)
    width = 16
    while width > 1:
        half = width // 2
        mask = ir.VectorType(_I32, half)
        lo = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(half, width))))
        v = builder.fadd(lo, hi)
        width = half
    return builder.extract_element(v, ir.Constant(_I32, 0))


def sum_lanes16(b, vecs):
    """IR: 16 <16 x float> -> one <16 x float> whose lane j is the sum of vecs[j]'s lanes:
    pairs of vectors exchange halves and add, 4 rounds (8 + 4 + 2 + 1 adds)."""
    width = 16  # lanes each vector's keys still occupy
    while len(vecs) > 1:
        half = width // 2
        keys = 16 // width
        lo, hi = [], []
        for base in (0, 16):
            for key in range(keys):
                lo += [base + key * width + i for i in range(half)]
                hi += [base + key * width + half + i for i in range(half)]
        mlo = ir.Constant(ir.VectorType(_I32, 16), lo)
        mhi = ir.Constant(ir.VectorType(_I32, 16), hi)
        vecs = [
            b.fadd(b.shuffle_vector(x, y, mlo), b.shuffle_vector(x, y, mhi))
            for x, y in zip(vecs[0::2], vecs[1::2])
        ]
        width = half
    return vecs[0]


def store_scores16(context, b, out_type, out, oi, accs, scale, nvalid):
    """IR: out.flat[oi:oi+16] = scale * (lane j: the sum of accs[j]'s lanes) for j <
    nvalid, -inf in the other lanes (rows that were not read); out a float32 array of
    numba type out_type, oi and nvalid int64."""
    s = b.fmul(sum_lanes16(b, accs), _splat16(b, scale))
    lanes = ir.Constant(ir.VectorType(_I64, 16), list(range(16)))
    nvv = b.insert_element(ir.Constant(ir.VectorType(_I64, 16), None), nvalid, ir.Constant(_I32, 0))
    nvv = b.shuffle_vector(nvv, nvv, ir.Constant(ir.VectorType(_I32, 16), None))
    s = b.select(b.icmp_signed("<", lanes, nvv), s, ir.Constant(_V16F, [float("-inf")] * 16))
    data = context.make_array(out_type)(context, b, out).data
    b.store(s, b.bitcast(b.gep(data, [oi]), _V16F.as_pointer()), align=4)


@intrinsic
def zero16(typingctx, acc):
    """acc[0:16] = 0 (acc: a stack16() pointer)."""

    def codegen(context, builder, sig, args):
        builder.store(ir.Constant(_V16F, None), _acc_ptr(builder, args[0]), align=4)
        return context.get_dummy_value()

    return types.none(acc), codegen


@intrinsic
def madd16(typingctx, acc, a, ai, b, bi):
    """acc[0:16] += a.flat[ai:ai+16] * widen(b.flat[bi:bi+16]), as 16-lane vector ops.
    a: float32, b: float32 or fp16 bits, both C-contiguous; no bounds check (the caller's
    loop bounds keep both in range)."""
    if not (_is_c_array(a, (types.float32,)) and _is_c_array(b)):
        return None

    def codegen(context, builder, sig, args):
        va = _load16(context, builder, sig.args[1], args[1], args[2])
        vb = _load16(context, builder, sig.args[3], args[3], args[4])
        _accumulate16(builder, args[0], va, vb)
        return context.get_dummy_value()

    return types.none(acc, a, ai, b, bi), codegen


@intrinsic
def axpy16(typingctx, acc, w, b, bi):
    """acc[0:16] += w * widen(b.flat[bi:bi+16]) (w: float32; b as in madd16)."""
    if not _is_c_array(b):
        return None

    def codegen(context, builder, sig, args):
        vb = _load16(context, builder, sig.args[2], args[2], args[3])
        _accumulate16(builder, args[0], _splat16(builder, args[1]), vb)
        return context.get_dummy_value()

    return types.none(acc, types.float32, b, bi), codegen


@intrinsic
def vsum16(typingctx, acc):
    """The sum of acc[0:16] (tree_sum16)."""

    def codegen(context, builder, sig, args):
        return tree_sum16(builder, args[0])

    return types.float32(acc), codegen


@intrinsic
def store16(typingctx, out, oi, acc, scale):
    """out.flat[oi:oi+16] = acc[0:16] * scale (out: C-contiguous float32)."""
    if not _is_c_array(out, (types.float32,)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        dst = builder.bitcast(builder.gep(data, [args[1]]), _V16F.as_pointer())
        acc_v = builder.load(_acc_ptr(builder, args[2]), align=4)
        builder.store(builder.fmul(acc_v, _splat16(builder, args[3])), dst, align=4)
        return context.get_dummy_value()

    return types.none(out, oi, acc, types.float32), codegen


def _vcall(builder, name, *vals):
    f = builder.module.globals.get(name)
    if f is None:
        f = ir.Function(builder.module, ir.FunctionType(_V16F, [_V16F] * len(vals)), name)
    return builder.call(f, list(vals))


def _c16(v: float):
    return ir.Constant(_V16F, [v] * 16)


def exp16(builder, x):
    """IR: e^x of <16 x float> in vector operations (Cephes' expf: x = n ln2 + r, e^r by
    a degree-6 polynomial, 2^n through the exponent bits; ~1 ulp, inputs clamped to
    [-87.3, 88.4]), where Numba calls libm's scalar expf once per element."""
    b = builder
    x = _vcall(
        b, "llvm.minnum.v16f32", _vcall(b, "llvm.maxnum.v16f32", x, _c16(-87.33654)), _c16(88.37626)
    )
    fx = _vcall(b, "llvm.floor.v16f32", b.fadd(b.fmul(x, _c16(1.44269504088896341)), _c16(0.5)))
    r = b.fsub(b.fsub(x, b.fmul(fx, _c16(0.693359375))), b.fmul(fx, _c16(-2.12194440e-4)))
    y = _c16(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = b.fadd(b.fmul(y, r), _c16(c))
    y = b.fadd(b.fadd(b.fmul(y, b.fmul(r, r)), r), _c16(1.0))
    v16i = ir.VectorType(_I32, 16)
    n = b.add(b.fptosi(fx, v16i), ir.Constant(v16i, [127] * 16))
    pow2n = b.bitcast(b.shl(n, ir.Constant(v16i, [23] * 16)), _V16F)
    return b.fmul(y, pow2n)


@intrinsic
def max16(typingctx, acc, a, ai):
    """acc[0:16] = max(acc[0:16], a.flat[ai:ai+16]) (a: C-contiguous float32)."""
    if not _is_c_array(a, (types.float32,)):
        return None

    def codegen(context, builder, sig, args):
        p = _acc_ptr(builder, args[0])
        va = _load16(context, builder, sig.args[1], args[1], args[2])
        m = _vcall(builder, "llvm.maxnum.v16f32", builder.load(p, align=4), va)
        builder.store(m, p, align=4)
        return context.get_dummy_value()

    return types.none(acc, a, ai), codegen


# Softmax weights below e^-64 (1.6e-28 of the largest) are 0: exp16 clamps its input at
# -87.3 and returns ~1e-38 there, and the weighted sums' products of such weights are
# denormal, which Intel cores compute in microcode. On a real Qwen2.5-0.5B cache (scores
# up to 2.7e6 below a row's maximum) the decode kernel takes 13.0 us a layer with this,
# 17.3 without, on an Intel core (`python benchmarks/decode_step.py -m qwen2.5-coder-0.5b`).
SOFTMAX_FLUSH = -64.0


@intrinsic
def exp_shift16(typingctx, acc, a, ai, m):
    """a.flat[ai:ai+16] = e^(a.flat[ai:ai+16] - m) (exp16; 0 below SOFTMAX_FLUSH), and
    acc[0:16] += the result: softmax's exponentials and their running sum, 16 at a
    time."""
    if not _is_c_array(a, (types.float32,)):
        return None

    def codegen(context, builder, sig, args):
        b = builder
        data = context.make_array(sig.args[1])(context, b, args[1]).data
        ptr = b.bitcast(b.gep(data, [args[2]]), _V16F.as_pointer())
        x = b.fsub(b.load(ptr, align=4), _splat16(b, args[3]))
        e = exp16(b, x)
        flush = b.fcmp_ordered("<", x, _c16(SOFTMAX_FLUSH))
        e = b.select(flush, _c16(0.0), e)
        b.store(e, ptr, align=4)
        p = _acc_ptr(b, args[0])
        b.store(b.fadd(b.load(p, align=4), e), p, align=4)
        return context.get_dummy_value()

    return types.none(acc, a, ai, types.float32), codegen


GELU_K2 = 2.0 * 0.7978845608028654  # 2 sqrt(2 / pi): 0.5 (1 + tanh z) = sigmoid(2 z)
GELU_C = 0.044715


@intrinsic
def glu16(typingctx, gelu, g, u, out, i):
    """out[i:i+16] = act(g[i:i+16]) * u[i:i+16] with act SiLU, or GELU-tanh when gelu
    (a literal), as x / (1 + e^-z) with z = x or 2 sqrt(2/pi) (x + 0.044715 x^3); all
    three arrays C-contiguous float32, no bounds check."""
    f32 = (types.float32,)
    if not (isinstance(gelu, types.BooleanLiteral) or isinstance(gelu, types.IntegerLiteral)):
        return None
    if not all(_is_c_array(a, f32) for a in (g, u, out)):
        return None

    def codegen(context, builder, sig, args):
        b = builder
        x = _load16(context, b, sig.args[1], args[1], args[4])
        z = x
        if gelu.literal_value:
            x3 = b.fmul(b.fmul(x, x), x)
            z = b.fmul(_c16(GELU_K2), b.fadd(x, b.fmul(_c16(GELU_C), x3)))
        e = exp16(b, b.fsub(_c16(0.0), z))
        act = b.fdiv(x, b.fadd(_c16(1.0), e))
        v = b.fmul(act, _load16(context, b, sig.args[2], args[2], args[4]))
        data = context.make_array(sig.args[3])(context, b, args[3]).data
        b.store(v, b.bitcast(b.gep(data, [args[4]]), _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(gelu, g, u, out, i), codegen


@intrinsic
def u2f(typingctx, v):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        a = args[0]
        if a.type.width > 32:
            a = builder.trunc(a, _I32)
        elif a.type.width < 32:
            a = builder.zext(a, _I32)
        return builder.bitcast(a, ir.FloatType())

    return types.float32(v), codegen


def _x86_has(llvm_names: tuple[str, ...], cpuinfo_names: tuple[str, ...]) -> bool:
    """True on an x86 host whose CPU has every feature (llvmlite's names; /proc/cpuinfo's
    where llvmlite cannot say)."""
    if not numba_env.x86_host():
        return False
    try:
        import llvmlite.binding as llvm

        feats = llvm.get_host_cpu_features()
        return all(feats.get(f, False) for f in llvm_names)
    except Exception:  # pragma: no cover - fall back to the kernel's view of the CPU
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:
            return False
        return all(f in flags for f in cpuinfo_names)


def has_avx2() -> bool:
    """True when the host CPU runs the int8 kernels' AVX2 form (AVX2 + FMA + F16C, x86)."""
    return _x86_has(("avx2", "fma", "f16c"), ("avx2", "fma", "f16c"))


def has_vnni() -> bool:
    """True when the host CPU runs the VNNI kernels (AVX-512 F/BW/VL + VNNI)."""
    return _x86_has(
        ("avx512f", "avx512bw", "avx512vl", "avx512vnni"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    )


def int8_dot() -> str | None:
    """The int8 dot the int8 kernels are built on in this process: "vnni" (AVX-512 VNNI),
    "avx2" (AVX2 + FMA + F16C), or "int8" (LLVM's generic vector operations, any target):
    on 64-bit ARM, or anywhere `EDGERUN_KERNELS=int8` asks for it; None where no int8 path
    runs (the portable float kernels only: 32-bit ARM and other CPUs). On x86 "int8"
    compiles to the avx2 path's instructions; on AArch64 to NEON widening multiply-adds
    (checked there under qemu-user: the kernel tests and SmolLM2's greedy text)."""
    import platform

    if numba_env.requested_kernels() == "int8":
        return "int8"
    if has_vnni():
        return "vnni"
    if has_avx2():
        return "avx2"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "int8"
    return None
