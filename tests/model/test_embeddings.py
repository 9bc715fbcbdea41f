"""Model.embed: pooled final hidden states, held to transformers on a tiny
Qwen3-Embedding-style file (tests/data/qwen3-embedding, by tests/data/make_qwen3_embedding.py)
and to llama.cpp's own embeddings of SmolLM2 where llama-cpp-python is installed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.errors import ContextOverflowError, InvalidArgumentError, UnsupportedError
from edgerun.generate.embedding import text_tokens
from edgerun.model.kvcache import KVCache

DATA = Path(__file__).resolve().parents[1] / "data" / "qwen3-embedding"
TEXTS = json.loads((DATA / "reference.json").read_text())["texts"]


@pytest.fixture(scope="module")
def qwen3_embedding():
    model = edgerun.load(DATA / "f32.gguf", threads=2)
    yield model
    model.close()


@pytest.fixture(scope="module")
def reference():
    return np.load(DATA / "reference.npz")


def test_qwen3_embedding_file_says_last_token_and_eos(qwen3_embedding, reference):
    m = qwen3_embedding
    assert m.spec.pooling == "last"  # qwen3.pooling_type 3, from 1_Pooling/config.json
    assert m.tokenizer.add_eos
    want = np.split(reference["ids"], np.cumsum(reference["lengths"])[:-1])
    for text, ids in zip(TEXTS, want):
        assert text_tokens(m.tokenizer, text) == ids.tolist()  # transformers' ids, EOS last


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_qwen3_embedding_matches_transformers(qwen3_embedding, reference, pooling):
    got = qwen3_embedding.embed(TEXTS, pooling=None if pooling == "last" else pooling)
    assert got.shape == (len(TEXTS), 64) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    cos = (got.astype(np.float64) * reference[pooling]).sum(1)
    assert cos.min() >= 0.9999, cos
    other = "mean" if pooling == "last" else "last"
    assert (got.astype(np.float64) * reference[other]).sum(1).min() < 0.99  # pooling matters


def test_batched_equals_one_by_one_and_final_hidden(qwen3_embedding):
    m = qwen3_embedding
    together = m.embed(TEXTS, normalize=False)
    alone = np.concatenate([m.embed(t, normalize=False) for t in TEXTS])
    np.testing.assert_array_equal(together, alone)
    for text, row in zip(TEXTS, together):
        ids = text_tokens(m.tokenizer, text)
        hidden = m.transformer.final_hidden(ids, KVCache(m.spec, len(ids), "f32"))
        np.testing.assert_allclose(row, hidden[-1], rtol=1e-5, atol=1e-6)
    cls = m.embed(TEXTS, pooling="cls")
    first = [text_tokens(m.tokenizer, t)[0] for t in TEXTS]
    # a causal model's first token sees only itself: equal first ids, equal vectors
    same = [i for i in range(len(TEXTS)) if first[i] == first[0]]
    for i in same:
        np.testing.assert_allclose(cls[i], cls[0], rtol=1e-5, atol=1e-6)


def test_long_text_runs_in_chunks(qwen3_embedding):
    m = qwen3_embedding
    text = " ".join(TEXTS)
    ids = text_tokens(m.tokenizer, text)
    step = m.engine.prefill_chunk
    m.engine.prefill_chunk = 16  # past one pass: the chunked path on a cache
    try:
        assert len(ids) > 16
        chunked = m.embed([text, TEXTS[0]], pooling="mean")
    finally:
        m.engine.prefill_chunk = step
    whole = m.embed([text, TEXTS[0]], pooling="mean")
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-5)


def test_bad_embed_arguments(qwen3_embedding):
    m = qwen3_embedding
    with pytest.raises(InvalidArgumentError, match="pooling must be one of"):
        m.embed("hi", pooling="max")
    with pytest.raises(InvalidArgumentError, match="string or a list of strings"):
        m.embed([1, 2])
    with pytest.raises(ContextOverflowError, match="context window"):
        m.embed("word " * (m.n_ctx + 10))


def test_reranker_pooling_is_refused(qwen3_embedding):
    from edgerun.generate.embedding import resolve_pooling

    with pytest.raises(UnsupportedError, match="reranker"):
        resolve_pooling(None, "rank")
    assert resolve_pooling("mean", "rank") == "mean"


def test_smollm2_matches_llama_cpp(smollm2_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "x"]
    m = edgerun.load(smollm2_path, n_ctx=256, threads=2)
    try:
        for pooling, code in (("mean", 1), ("last", 3)):
            ours = m.embed(texts, pooling=pooling).astype(np.float64)
            ref = llama_cpp.Llama(
                model_path=str(smollm2_path), embedding=True, pooling_type=code, n_ctx=256,
                n_threads=2, type_k=0, type_v=0, verbose=False,
            )  # fmt: skip
            theirs = np.array(ref.embed(texts, normalize=True), np.float64)
            ref.close()
            cos = (ours * theirs).sum(1)
            assert cos.min() >= 0.999, (pooling, cos)
    finally:
        m.close()


@pytest.mark.parametrize("value, want", [(None, "last"), (0, "last"), (1, "mean"), (2, "cls")])
def test_pooling_type_metadata(value, want):
    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf

    meta = dict(read_gguf(DATA / "f32.gguf").metadata)
    meta.pop("qwen3.pooling_type")
    if value is not None:
        meta["qwen3.pooling_type"] = value
    assert spec_from_gguf(meta, "f.gguf").pooling == want


@pytest.mark.parametrize("value", [9, -1, "last", 1.0])
def test_bad_pooling_type_is_named(value):
    from edgerun.arch import spec_from_gguf
    from edgerun.errors import ModelFormatError
    from edgerun.formats.gguf import read_gguf

    meta = dict(read_gguf(DATA / "f32.gguf").metadata)
    meta["qwen3.pooling_type"] = value
    with pytest.raises(ModelFormatError, match=r"f\.gguf: metadata field 'qwen3\.pooling_type'"):
        spec_from_gguf(meta, "f.gguf")
