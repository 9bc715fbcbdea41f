"""Byte-level BPE's own merge table (tokenizer/bpe_merges.py) against the ``tokenizers``
library's BPE model built from the same GGUF vocabulary: the same ids on prose, code,
random Unicode, added tokens in the text, and words long enough that a quadratic merge
loop would not finish."""

from __future__ import annotations

import glob
import os
import random
import time

import numpy as np
import pytest

from edgerun.formats.gguf import read_gguf
from edgerun.tokenizer.bpe import LLAMA3_SPLIT, BPETokenizer
from edgerun.tokenizer.bpe_merges import MergeTable


def library_tokenizer(meta: dict, ignore_merges: bool = False):
    """The library's tokenizer for a SmolLM2-style ("digits") or Llama 3 vocabulary, as
    edgerun built it before it had its own merges: BPE model, pre-tokenizer, added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        ignore_merges=ignore_merges,
    )
    tk = Tokenizer(model)
    if ignore_merges:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    control = [t for t, ty in zip(tokens, types) if ty == 3]
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    return tk


def library_encode(tk, text: str, parse_special: bool) -> list[int]:
    tk.encode_special_tokens = not parse_special
    return tk.encode(text, add_special_tokens=False).ids


def sample_texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for f in sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))[:25]:
        src = open(f, encoding="utf-8", errors="replace").read()
        for _ in range(4):
            a = rng.randrange(0, max(1, len(src) - 1500))
            out.append(src[a : a + rng.randrange(1, 1500)])
    alphabet = "abcXYZ 019\n\t\r  éüß中文日本語한국어🙂👍🏽\u200b\u00a0"
    alphabet += "'\"!?.,;:-_()[]{}<>|\\/@#$%^&*+=~`"
    for _ in range(400):
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60))))
    out += ["a" * 3000, "ab" * 1500, " " * 600, "\n" * 300, "1234567890" * 50, "🙂" * 200]
    return out


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_path):
    return read_gguf(smollm2_path).metadata


def test_ids_equal_the_library_bpe(smollm2_meta):
    ours = BPETokenizer(smollm2_meta)
    lib = library_tokenizer(smollm2_meta)
    specials = list(ours.special_texts())
    rng = random.Random(1)
    texts = sample_texts()
    texts += [t[:k] + rng.choice(specials) + t[k:] for t in texts[:100] for k in [len(t) // 2]]
    for text in texts:
        for parse_special in (True, False):
            want = library_encode(lib, text, parse_special)
            assert ours.encode(text, add_bos=False, parse_special=parse_special) == want, text
    assert ours.encode_batch(texts[:20], add_bos=False) == [
        library_encode(lib, t, True) for t in texts[:20]
    ]


def test_ignore_merges_takes_vocabulary_words_whole(smollm2_meta):
    """Llama 3's rule on a real vocabulary: a word that is itself a token is one id."""
    meta = dict(smollm2_meta)
    meta["tokenizer.ggml.pre"] = "llama-bpe"
    ours = BPETokenizer(meta)
    lib = library_tokenizer(meta, ignore_merges=True)
    for text in sample_texts(seed=2)[:150]:
        assert ours.encode(text, add_bos=False) == library_encode(lib, text, True), text


def test_a_long_word_is_merged_in_n_log_n(smollm2_meta):
    """A 200k-character run with no split point (a quadratic merge loop: minutes)."""
    ours = BPETokenizer(smollm2_meta)
    lib = library_tokenizer(smollm2_meta)
    word = "".join(random.Random(3).choice("abcdefgh") for _ in range(200_000))
    t0 = time.perf_counter()
    got = ours.encode(word, add_bos=False)
    took = time.perf_counter() - t0
    assert got == library_encode(lib, word, True)
    assert took < 10.0, took


def test_merge_table_keeps_the_last_rank_of_a_repeated_pair():
    """A pair listed twice keeps its last rank (the library inserts merges in file order
    into a map), and the lowest-ranked adjacent pair merges first, leftmost on ties."""
    # ids: a=0 b=1 c=2 ab=3 bc=4 abc=5; merges: (b c) rank 0, (a b) rank 1, (b c) rank 2
    t = MergeTable(np.array([1, 0, 1]), np.array([2, 1, 2]), np.array([4, 3, 4]))
    assert len(t.keys) == 2 and t.nbytes == 2 * (8 + 4 + 4)
    assert t.merge(np.array([0, 1, 2], np.int32)).tolist() == [3, 2]  # (a b) now ranks first
    t2 = MergeTable(np.array([0, 3]), np.array([1, 2]), np.array([3, 5]))  # (a b), (ab c)
    assert t2.merge(np.array([0, 1, 0, 1, 2], np.int32)).tolist() == [3, 5]
    assert t2.merge(np.array([2], np.int32)).tolist() == [2]
    assert t2.merge(np.array([], np.int32)).tolist() == []
