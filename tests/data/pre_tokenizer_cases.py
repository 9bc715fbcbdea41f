"""The inputs on which edgerun's pre-tokenizers are compared with llama.cpp's.

Shared by tests/reference/test_pre_tokenizers.py and make_pre_tokenizer_ids.py (which records
llama.cpp's ids for exactly these inputs into pre_tokenizer_ids.json, so the test runs where
llama-cpp-python is not installed). Each golden group is a vocabulary, a list of strings, the
``parse_special`` settings and the names it covers; :func:`inputs_digest` fingerprints all but
the names, so goldens recorded for other inputs are refused rather than compared out of step.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
from tricky_strings import SPECIAL_TOKEN_STRINGS, TRICKY_STRINGS

from edgerun.tokenizer.bpe import PRE_TOKENIZERS, _byte_decoder

GOLDEN_PATH = Path(__file__).resolve().parent / "pre_tokenizer_ids.json"
REGENERATE = "PYTHONPATH=$PWD python tests/data/make_pre_tokenizer_ids.py"

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
    # combining marks (decomposed accents): words in Qwen3.5's split, symbols in Qwen2's
    "cafe\u0301 nai\u0308ve \u0915\u093f\u0924\u093e\u092c x\u0301!",
]

CORPUS = PROBES + TRICKY_STRINGS + SPECIAL_TOKEN_STRINGS

# edgerun's own older name for GPT-2's split; llama.cpp knows it as "gpt-2"
LLAMA_CPP_NAME = {"gpt2": "gpt-2"}


def kind_representatives() -> set[str]:
    """The first name of each distinct pre-tokenizer in the table."""
    first: dict[int, str] = {}
    for name, kind in PRE_TOKENIZERS.items():
        first.setdefault(id(kind), name)
    return set(first.values())


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

# group -> (strings, parse_special settings). "chain": every name, the chain vocabulary;
# "smollm2" and "qwen2.5-coder-0.5b": one name per kind, that model's real vocabulary (Qwen's
# control-token strings as text only: llama.cpp makes a normal token spelled like an
# end-of-generation marker, "</s>" in Qwen's vocabulary, a control token, which edgerun does not)
GROUPS: dict[str, tuple[list[str], tuple[bool, ...]]] = {
    "chain": (PROBES, (False, True)),
    "smollm2": (CORPUS, (False, True)),
    "qwen2.5-coder-0.5b": (CORPUS, (False,)),
}


def inputs_digest(meta: dict, strings: list[str], specials: tuple[bool, ...]) -> str:
    """sha256 over the vocabulary's tokens and merges, the strings and the settings."""
    h = hashlib.sha256()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        h.update("\n".join(meta.get(key, ())).encode("utf-8", "surrogatepass") + b"\0")
    h.update(json.dumps([strings, list(specials)], ensure_ascii=True).encode())
    return h.hexdigest()


def llama_cpp_ids(llama_cpp, path: Path, strings: list[str], specials: tuple[bool, ...]):
    """llama.cpp's ids for each string and parse_special setting, BOS as the model's
    default (add_bos=True there means "if the vocabulary asks for it")."""
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    out = [
        [
            ref.tokenize(s.encode("utf-8", "surrogatepass"), add_bos=True, special=sp)
            for sp in specials
        ]
        for s in strings
    ]
    del ref
    return out


def load_goldens() -> dict:
    """pre_tokenizer_ids.json as make_pre_tokenizer_ids.py wrote it."""
    return json.loads(GOLDEN_PATH.read_text())


def golden_ids(group: str, goldens: dict | None = None) -> dict[str, list[list[list[int]]]]:
    """{name: [[llama.cpp's ids for each parse_special setting] for each string]} of a group
    (empty when the group was not recorded)."""
    body = (goldens if goldens is not None else load_goldens()).get(group)
    if body is None:
        return {}
    variants = body["variants"]
    return {
        name: [[variants[i][k] for k in row] for i, row in enumerate(rows)]
        for name, rows in body["pick"].items()
    }
