"""The grammar libraries compared for generate/constraint.py: llguidance, xgrammar and
outlines-core, on edgerun's own tokenizers of SmolLM2 (49k tokens) and Qwen2.5 (151k):
the tokenizer's setup, one JSON Schema's compile ($ref, enum, format, pattern, array
bounds), and the per-token mask over a valid answer's tokens (median, max).

    pip install llguidance xgrammar outlines-core   # xgrammar brings torch
    python benchmarks/structured_libs.py

A library that is not installed is reported as failed.
"""

import json
import statistics
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import os

from edgerun import registry
from edgerun.formats.gguf import read_gguf
from edgerun.tokenizer import tokenizer_from_gguf_metadata

SMOL = str(registry.resolve_path(registry.find("smollm2-135m")))
QWEN = os.path.expanduser("~/.cache/edgerun/models/qwen2.5-coder-0.5b-instruct.gguf")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"$ref": "#/$defs/addr"},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "address"],
    "$defs": {
        "addr": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        }
    },
}
TEXT = json.dumps(
    {
        "name": "Alice Smith",
        "age": 30,
        "email": "a@b.io",
        "tags": ["x", "y"],
        "address": {"city": "Paris", "zip": "75001"},
        "kind": "b",
    }
)


def vocab(path):
    tok = tokenizer_from_gguf_metadata(read_gguf(path).metadata)
    toks = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    return tok, toks


def med(xs):
    return statistics.median(xs) * 1e6


def run_llg(tok, toks, ids):
    import llguidance
    import llguidance.numpy as lln

    class W:
        pass

    w = W()
    w.eos_token_id = tok.eos_id
    w.bos_token_id = tok.bos_id
    w.tokens = [b"\xff" + t if i in tok.special_ids else t for i, t in enumerate(toks)]
    w.special_token_ids = sorted(tok.special_ids)
    w.__call__ = None

    class TW:
        def __init__(s):
            s.eos_token_id, s.bos_token_id, s.tokens, s.special_token_ids = (
                w.eos_token_id,
                w.bos_token_id,
                w.tokens,
                w.special_token_ids,
            )
            s.is_tokenizer_wrapper = True

        def __call__(s, b):
            return tok.encode(
                b if isinstance(b, str) else b.decode("utf-8", "replace"),
                add_bos=False,
                parse_special=False,
            )

    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer(TW())
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    m = llguidance.LLMatcher(llt, g)
    t_comp = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    bm = lln.allocate_token_bitmask(1, tok.vocab_size)
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(m, bm)
        ts.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return t_tok, t_comp, ts


def run_xgr(tok, toks, ids):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(
        [t.decode("latin-1") if False else t for t in toks],
        vocab_type=xgr.VocabType.RAW,
        vocab_size=tok.vocab_size,
        stop_token_ids=[tok.eos_id],
    )
    comp = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA))
    t_comp = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, tok.vocab_size)
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        ts.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return t_tok, t_comp, ts


def run_oc(tok, toks, ids):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    d = {}
    for i, t in enumerate(toks):
        if i == tok.eos_id or i in tok.special_ids:
            continue
        d.setdefault(t, []).append(i)
    voc = Vocabulary(tok.eos_id, d)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    rx = build_regex_from_schema(json.dumps(SCHEMA))
    idx = Index(rx, voc)
    t_comp = time.perf_counter() - t0
    gd = Guide(idx)
    ts = []
    for t in ids:
        t0 = time.perf_counter()
        gd.get_tokens()
        ts.append(time.perf_counter() - t0)
        gd.advance(t)
    return t_tok, t_comp, ts


for name, path in (("SmolLM2", SMOL), ("Qwen2.5", QWEN)):
    tok, toks = vocab(path)
    ids = tok.encode(TEXT, add_bos=False, parse_special=False)
    for lib, fn in (("llguidance", run_llg), ("xgrammar", run_xgr), ("outlines-core", run_oc)):
        try:
            t_tok, t_comp, ts = fn(tok, toks, ids)
            print(
                f"{name:8s} vocab {tok.vocab_size:6d} {lib:14s} tokenizer {t_tok * 1e3:8.1f} ms"
                f"  schema compile {t_comp * 1e3:9.1f} ms  mask median {med(ts):8.1f} us"
                f"  max {max(ts) * 1e6:8.0f} us  ({len(ts)} tokens)",
                flush=True,
            )
        except Exception as e:
            print(f"{name} {lib} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
