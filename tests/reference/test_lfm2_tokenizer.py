"""The `lfm2` pre-tokenizer (llama.cpp's LLAMA3 split with ignore_merges and a BOS) on the
tiny LFM2 reference model's vocabulary, against llama.cpp's own tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

import edgerun

MODEL = Path(__file__).resolve().parents[1] / "data" / "families" / "lfm2" / "f32.gguf"
TEXTS = [
    "The quick brown fox; 12345 numbers and   spaces\n\nnew lines",
    "I'm don't we'll THEY'RE",
    "héllo wörld — 日本語 😀",
    "def main(): return 0 if x else 1",
    "",
]


def test_lfm2_tokenizes_as_llama_cpp():
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(MODEL), vocab_only=True, verbose=False)
    m = edgerun.load(MODEL, n_ctx=64, threads=1)
    try:
        assert m.tokenizer.pre == "lfm2"
        for text in TEXTS:
            want = ref.tokenize(text.encode(), add_bos=True, special=True)
            assert m.tokenize(text) == want, text
    finally:
        m.close()
