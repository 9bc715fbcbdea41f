"""A tiny GGUF of each grid format (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S) loads
and runs, prefill and decode, as its F32 twin does.

The model is a one-layer Llama (d_model 256, so that the 256-element super-blocks fit)
with the tokenizer of tests/data/families/llama, every matrix (embedding and output head
included) random valid blocks of the format. Its twin stores the same weights dequantized
by the numpy reference (bit-exact with gguf-py) as F32: the two must give the same logits
to float32 rounding on every position of a prompt (the prefill GEMM) and the same greedy
tokens, with logits as close, one token at a time (the decode matvec).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.formats.gguf import read_gguf
from edgerun.model.kvcache import KVCache
from edgerun.quant.formats import QuantType
from edgerun.quant.reference import dequantize, random_blocks

gguf = pytest.importorskip("gguf")

FAMILY = Path(__file__).parents[1] / "data" / "families" / "llama" / "f32.gguf"
GRID_TYPES = [
    QuantType.IQ2_XXS,
    QuantType.IQ2_XS,
    QuantType.IQ2_S,
    QuantType.IQ3_XXS,
    QuantType.IQ3_S,
    QuantType.IQ1_S,
]
D, FF, HEADS, KV, HEAD_DIM, VOCAB = 256, 512, 4, 2, 64, 384


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, QuantType]]) -> None:
    src = gguf.GGUFReader(FAMILY)
    w = gguf.GGUFWriter(path, "llama")
    dims = {
        "llama.block_count": 1,
        "llama.embedding_length": D,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV,
        "llama.attention.key_length": HEAD_DIM,
        "llama.attention.value_length": HEAD_DIM,
        "llama.rope.dimension_count": HEAD_DIM,
    }
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in dims:
            w.add_uint32(name, dims[name])
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for name, (data, q) in tensors.items():
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(int(q)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_pair(tmp: Path, q: QuantType) -> tuple[Path, Path]:
    """(the model in format q, its F32 twin holding the dequantized weights)."""
    rng = np.random.default_rng(int(q))
    shapes = {
        "token_embd.weight": (VOCAB, D),
        "output.weight": (VOCAB, D),
        "blk.0.attn_q.weight": (HEADS * HEAD_DIM, D),
        "blk.0.attn_k.weight": (KV * HEAD_DIM, D),
        "blk.0.attn_v.weight": (KV * HEAD_DIM, D),
        "blk.0.attn_output.weight": (D, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": (FF, D),
        "blk.0.ffn_up.weight": (FF, D),
        "blk.0.ffn_down.weight": (D, FF),
    }
    quant, flat = {}, {}
    for name, (rows, cols) in shapes.items():
        # weights of ~0.05: a random one-layer model with usable, non-saturated logits
        raw = random_blocks(q, rows, cols, rng, scale=0.002)
        quant[name] = (raw, q)
        flat[name] = (dequantize(q, raw), QuantType.F32)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        ones = np.ones(D, np.float32)
        quant[name] = flat[name] = (ones, QuantType.F32)
    paths = tmp / f"tiny-{q.name.lower()}.gguf", tmp / f"tiny-{q.name.lower()}-f32.gguf"
    _write(paths[0], quant)
    _write(paths[1], flat)
    return paths


def _decode(model, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after ids, one forward per token, and each step's logits."""
    cache = KVCache(model.spec, len(ids) + steps + 1, "f32")
    tr = model.transformer
    logits = [np.asarray(tr.forward(ids, cache), np.float32).copy()]
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits.append(np.asarray(tr.forward([out[-1]], cache), np.float32).copy())
    return out, np.stack(logits)


def _close(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("q", GRID_TYPES, ids=lambda q: q.name)
def test_tiny_grid_model_runs_as_its_f32_twin(tmp_path, q):
    path, twin_path = _tiny_pair(tmp_path, q)
    model = edgerun.load(path, n_ctx=64, threads=1)
    twin = edgerun.load(twin_path, n_ctx=64, threads=1)
    try:
        assert read_gguf(path).tensor("blk.0.ffn_down.weight").qtype == q
        ids = [1, 17, 250, 3, 99, 42, 7, 300, 5, 12, 88, 64]
        # prefill of every position (the GEMM)
        got, want = model.logits(ids), twin.logits(ids)
        assert got.shape == (len(ids), VOCAB)
        assert np.abs(want).max() > 0.1  # a model that says something
        assert _close(got, want) < 1e-4
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
        # decode one token at a time (the fused matvec and the embedding rows)
        toks, lg = _decode(model, ids[:4], 8)
        twin_toks, twin_lg = _decode(twin, ids[:4], 8)
        assert toks == twin_toks
        assert _close(lg, twin_lg) < 1e-4
    finally:
        model.close()
        twin.close()
