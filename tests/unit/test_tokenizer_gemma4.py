"""Gemma 4's BPE (tokenizer.ggml.model "gemma4") on a hand-made vocabulary: spaces as "▁",
merges by rank over UTF-8 characters, newline runs apart, byte fallback for characters the
vocabulary lacks, and clear errors for a file without merges. (The tiny reference model's
vocabulary is checked against llama.cpp's tokenizer in tests/model/test_gemma4.py.)"""

from __future__ import annotations

import pytest

from edgerun.errors import ModelFormatError, UnsupportedError
from edgerun.tokenizer.from_gguf import tokenizer_from_gguf_metadata

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["a", "b", "c", "▁", "\n", "\n\n", "ab", "▁a", "▁ab", "abc"]
MERGES = ["a b", "▁ ab", "ab c"]


def _meta(**over):
    tokens = SPECIAL + BYTES + PIECES
    types = [3] * 4 + [6] * 256 + [1] * len(PIECES)
    meta = {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": False,
    }
    meta.update(over)
    return meta


def _id(piece: str) -> int:
    return (SPECIAL + BYTES + PIECES).index(piece)


def test_pieces_merge_by_rank_with_spaces_as_the_escape():
    tok = tokenizer_from_gguf_metadata(_meta())
    ids = tok.encode("abc ab", add_bos=False)
    assert ids == [_id("abc"), _id("▁ab")]
    assert tok.decode(ids) == "abc ab"


def test_newline_runs_and_byte_fallback():
    tok = tokenizer_from_gguf_metadata(_meta())
    ids = tok.encode("a\n\nb é", add_bos=False)
    e_bytes = [_id(f"<0x{b:02X}>") for b in "é".encode()]
    assert ids == [_id("a"), _id("\n\n"), _id("b"), _id("▁"), *e_bytes]
    assert tok.decode(ids) == "a\n\nb é"


def test_bos_comes_first_as_llama_cpp_forces_for_gemma4():
    tok = tokenizer_from_gguf_metadata(_meta())
    assert tok.encode("a")[0] == 2 and tok.add_bos


def test_control_tokens_are_parsed_only_when_asked():
    tok = tokenizer_from_gguf_metadata(_meta())
    assert tok.encode("a<eos>", add_bos=False) == [_id("a"), 1]
    assert 1 not in tok.encode("a<eos>", add_bos=False, parse_special=False)


def test_a_file_without_merges_is_refused_by_field():
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges"):
        tokenizer_from_gguf_metadata(_meta(**{"tokenizer.ggml.merges": []}))
    with pytest.raises(ModelFormatError, match="entry #0"):
        tokenizer_from_gguf_metadata(_meta(**{"tokenizer.ggml.merges": ["a z"]}))


def test_an_unknown_tokenizer_kind_names_the_supported_ones():
    with pytest.raises(UnsupportedError, match="'gemma4'"):
        tokenizer_from_gguf_metadata(_meta(**{"tokenizer.ggml.model": "plamo2"}))
