"""Every ``tokenizer.ggml.pre`` edgerun knows splits text as llama.cpp does.

For each name in :data:`edgerun.tokenizer.bpe.PRE_TOKENIZERS` a vocabulary-only GGUF is
written with that name and without ``tokenizer.ggml.add_bos_token`` (so each name's BOS
default shows too); llama.cpp loads the same file (``vocab_only``) and the token ids must be
equal. Every name is checked on strings that tell the splits apart, with a vocabulary made
here whose merges rebuild any piece of those strings (so the ids show where the text was
split, which a real vocabulary's merges, made after its own split, mostly hide); one name of
each kind also on the whole tricky-string corpus with SmolLM2's real vocabulary (and, slow,
Qwen2.5's).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from tricky_strings import SPECIAL_TOKEN_STRINGS, TRICKY_STRINGS

from edgerun import registry
from edgerun.errors import UnsupportedError
from edgerun.formats.gguf import read_gguf
from edgerun.tokenizer import tokenizer_from_gguf_metadata
from edgerun.tokenizer.bpe import PRE_TOKENIZERS, _byte_decoder

llama_cpp = pytest.importorskip("llama_cpp")

# Strings on which the splits differ: digit groups, case changes, contractions, punctuation
# runs before newlines and slashes, whitespace runs, symbols, letters outside ASCII.
PROBES = [
    "12345 678901 3.14159",
    "HelloWorld camelCase XMLHttpRequest ÉCOLE École",
    "I'M don't WE'LL you've they'd it'S",
    "a, b!!\n\n  c...\n/x //y\r\n\tz",
    "x   y\t\t\n  \n z  ",
    "$100 + <tag> ^~| `code` #hash @user",
    "naïve Ωμέγα мир 東京タワー 한국어 ١٢٣ ½ Ⅷ",
    "def f(x):\n    return x**2  # ok\n",
]

# edgerun's own older name for GPT-2's split; llama.cpp knows it as "gpt-2"
LLAMA_CPP_NAME = {"gpt2": "gpt-2"}


def _kind_representatives() -> set[str]:
    """The first name of each distinct pre-tokenizer in the table."""
    first: dict[int, str] = {}
    for name, kind in PRE_TOKENIZERS.items():
        first.setdefault(id(kind), name)
    return set(first.values())


REPRESENTATIVES = _kind_representatives()


def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def write_vocab_gguf(path: Path, meta: dict, pre: str) -> Path:
    """A tensor-less GGUF v3 holding the tokenizer keys of ``meta`` with ``pre`` as
    ``tokenizer.ggml.pre`` and no ``add_bos_token`` (serialized here: gguf-py's writer takes
    ~1 s per file for a 49k vocabulary)."""
    kvs = [_gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama")]
    for key, value in meta.items():
        if not key.startswith("tokenizer.ggml.") or key == "tokenizer.ggml.add_bos_token":
            continue
        if key == "tokenizer.ggml.pre":
            continue
        head = _gguf_string(key)
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            items = list(value)
            body = struct.pack("<IIQ", 9, 8, len(items)) + b"".join(map(_gguf_string, items))
        elif key == "tokenizer.ggml.token_type":
            a = np.asarray(value, "<i4")
            body = struct.pack("<IIQ", 9, 5, a.size) + a.tobytes()
        elif isinstance(value, bool | np.bool_):
            body = struct.pack("<IB", 7, bool(value))
        elif isinstance(value, int | np.integer):
            body = struct.pack("<II", 4, int(value))
        elif isinstance(value, str):
            body = struct.pack("<I", 8) + _gguf_string(value)
        else:
            continue  # scores and the like: not read by a byte-level vocabulary
        kvs.append(head + body)
    kvs.append(_gguf_string("tokenizer.ggml.pre") + struct.pack("<I", 8) + _gguf_string(pre))
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    path.write_bytes(data + bytes(-len(data) % 32))
    return path


def chain_vocab(strings: list[str], longest: int = 24) -> dict:
    """Byte-level vocabulary metadata whose merges build every substring of ``strings`` of
    up to ``longest`` bytes, left to right, so a pre-token becomes (nearly) one token and
    the ids show the split; plus three control tokens and a user-defined one."""
    to_char = {b: c for c, b in _byte_decoder().items()}
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types = [3, 3, 3, 4]
    tokens += [to_char[b] for b in range(256)]
    types += [1] * 256
    known = set(tokens)
    merges = []
    for s in strings:
        chars = "".join(to_char[b] for b in s.encode("utf-8"))
        for i in range(len(chars)):
            for j in range(i + 2, min(len(chars), i + longest) + 1):
                left, right = chars[i : j - 1], chars[j - 1]
                if left + right not in known:
                    known.add(left + right)
                    tokens.append(left + right)
                    types.append(1)
                    merges.append(f"{left} {right}")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
    }


CHAIN_VOCAB = chain_vocab(PROBES)


def _registry_path(name: str) -> Path | None:
    try:
        p = Path(registry.resolve_path(registry.find(name)))
    except Exception:  # not installed here
        return None
    return p if p.exists() else None


@pytest.fixture(scope="module")
def smollm_vocab(smollm2_path) -> dict:
    return dict(read_gguf(smollm2_path).metadata)


def _compare(path: Path, strings: list[str], specials: tuple[bool, ...]) -> list:
    """(string, parse_special, llama.cpp's ids, ours) for every string where they differ;
    BOS as each side's model default (llama.cpp's add_special, our add_bos=None)."""
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ours = tokenizer_from_gguf_metadata(read_gguf(path).metadata)
    bad = []
    for s in strings:
        raw = s.encode("utf-8", "surrogatepass")
        for special in specials:
            want = ref.tokenize(raw, add_bos=True, special=special)
            got = ours.encode(s, parse_special=special)
            if want != got:
                bad.append((s, special, want[:24], got[:24]))
    return bad


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_matches_llama_cpp(pre, tmp_path):
    """Each name on the probes, with the chain vocabulary (control tokens parsed and not)."""
    path = write_vocab_gguf(tmp_path / "v.gguf", CHAIN_VOCAB, LLAMA_CPP_NAME.get(pre, pre))
    bad = _compare(path, PROBES, (False, True))
    assert not bad, bad[:3]
    if pre in LLAMA_CPP_NAME:  # our alias gives the same ids as llama.cpp's name
        ours = tokenizer_from_gguf_metadata(dict(CHAIN_VOCAB, **{"tokenizer.ggml.pre": pre}))
        ref = tokenizer_from_gguf_metadata(read_gguf(path).metadata)
        for s in PROBES + TRICKY_STRINGS:
            assert ours.encode(s) == ref.encode(s), repr(s)


@pytest.mark.parametrize("pre", sorted(REPRESENTATIVES))
def test_each_kind_matches_llama_cpp_on_corpus(pre, smollm_vocab, tmp_path):
    """One name per kind, SmolLM2's vocabulary, the whole corpus."""
    path = write_vocab_gguf(tmp_path / "v.gguf", smollm_vocab, LLAMA_CPP_NAME.get(pre, pre))
    bad = _compare(path, PROBES + TRICKY_STRINGS + SPECIAL_TOKEN_STRINGS, (False, True))
    assert not bad, bad[:3]


def test_probes_tell_every_kind_apart():
    """With the chain vocabulary no two kinds give the same ids on all probes (with the same
    BOS default), so the per-name test checks which kind each name maps to."""
    seen: dict[tuple, str] = {}
    for pre in sorted(REPRESENTATIVES):
        t = tokenizer_from_gguf_metadata(dict(CHAIN_VOCAB, **{"tokenizer.ggml.pre": pre}))
        key = (t.add_bos, *(tuple(t.encode(s, add_bos=False)) for s in PROBES))
        assert key not in seen, f"{pre!r} splits the probes as {seen.get(key)!r} does"
        seen[key] = pre


@pytest.mark.slow
def test_pre_tokenizers_on_qwen_vocabulary(tmp_path):
    """One name per kind on Qwen2.5's 151k vocabulary (more multi-byte merges: CJK, code).
    Control-token strings as text only: llama.cpp makes a normal token spelled like an
    end-of-generation marker ("</s>", a plain token in Qwen's vocabulary) a control token,
    which edgerun does not."""
    qwen = _registry_path("qwen2.5-coder-0.5b")
    if qwen is None:
        pytest.skip("qwen2.5-coder-0.5b not installed (python -m edgerun pull qwen2.5-coder-0.5b)")
    vocab = dict(read_gguf(qwen).metadata)
    for pre in sorted(REPRESENTATIVES):
        path = write_vocab_gguf(tmp_path / f"{pre}.gguf", vocab, LLAMA_CPP_NAME.get(pre, pre))
        bad = _compare(path, PROBES + TRICKY_STRINGS + SPECIAL_TOKEN_STRINGS, (False,))
        assert not bad, (pre, bad[:3])


def test_unknown_pre_tokenizer_names_file_field_and_choices(smollm_vocab, tmp_path):
    path = write_vocab_gguf(tmp_path / "odd.gguf", smollm_vocab, "no-such-split")
    with pytest.raises(UnsupportedError) as e:
        tokenizer_from_gguf_metadata(read_gguf(path).metadata)
    msg = str(e.value)
    assert msg.startswith(f"{path}:"), msg
    assert "'tokenizer.ggml.pre'" in msg and "'no-such-split'" in msg
    for name in PRE_TOKENIZERS:
        assert name in msg
