"""Gemma 4 text (tests/data/families/gemma4: per-layer embeddings, KV shared across layers,
per-layer head dims, proportional RoPE) through every path a model takes: a prompt pass
equals token-by-token decoding, batched decode equals each sequence alone, a cut cache
reuses its KV rows, generation runs through edgerun.load, and the tokenizer
(tokenizer.ggml.model "gemma4") agrees with llama.cpp's on the same file. Agreement with
transformers' logits is tests/reference/test_families.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.model.kvcache import KVCache

DATA = Path(__file__).resolve().parents[1] / "data" / "families" / "gemma4"
GREEDY = dict(temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def model():
    m = edgerun.load(DATA / "f32.gguf", n_ctx=96, threads=2, kv_type="f32")
    yield m
    m.close()


def _ids() -> list[int]:
    with np.load(DATA / "reference.npz") as ref:
        return ref["ids"].tolist()


def test_the_spec_has_gemma4s_layers(model):
    s = model.spec
    assert s.arch == "gemma4"
    assert s.layer_head_dims == (32, 32, 64, 32, 64)
    assert s.layer_kv_source == (0, 1, 2, 1, 2)  # 3 and 4 reuse the last of their kind
    assert s.layer_d_ff == (128, 128, 128, 256, 256)
    assert s.per_layer_input == 16
    tr = model.transformer
    assert tr.layers[3].k is None and tr.layers[3].v is None
    assert tr.per_layer is not None


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_a_prompt_equals_its_tokens_one_by_one(model, kv_type):
    tr, ids = model.transformer, _ids()[:40]
    whole = tr.forward(ids, KVCache(model.spec, 48, kv_type), all_logits=True)
    cache = KVCache(model.spec, 48, kv_type)
    steps = np.stack([tr.forward([t], cache) for t in ids])
    tol = 1e-4 if kv_type == "f32" else 5e-2
    assert np.abs(whole - steps).max() <= tol * (np.ptp(whole, axis=-1).max())
    assert (whole.argmax(-1) == steps.argmax(-1)).mean() >= 0.95


def test_batched_decode_of_four_equals_each_alone(model):
    tr, ids = model.transformer, _ids()
    prompts = [ids[:5], ids[3:14], ids[10:12], ids[20:29]]
    nexts = [ids[30:36], ids[36:42], ids[42:48], ids[48:54]]
    alone = []
    for p, nx in zip(prompts, nexts):
        c = KVCache(model.spec, 32, "f16")
        tr.forward(p, c)
        alone.append(np.stack([tr.forward([t], c) for t in nx]))
    caches = [KVCache(model.spec, 32, "f16") for _ in prompts]
    for p, c in zip(prompts, caches):
        tr.forward(p, c)
    together = np.stack([tr.forward_batch(list(step), caches) for step in zip(*nexts)], axis=1)
    for b in range(4):
        assert np.array_equal(together[b], alone[b])


def test_verify_equals_one_token_steps(model):
    tr, ids = model.transformer, _ids()
    c1, c2 = KVCache(model.spec, 40, "f32"), KVCache(model.spec, 40, "f32")
    tr.forward(ids[:12], c1)
    tr.forward(ids[:12], c2)
    rows = tr.verify(ids[12:17], c1)
    steps = np.stack([tr.forward([t], c2) for t in ids[12:17]])
    assert np.array_equal(rows, steps)


def test_a_batch_of_prompts_equals_each_alone(model):
    tr, ids = model.transformer, _ids()
    seqs = [ids[:9], ids[5:25], ids[30:33]]
    batch = tr.final_hidden_batch(seqs)
    for s, x in zip(seqs, batch):
        alone = tr.final_hidden(s, KVCache(model.spec, 32, "f32"))
        assert np.abs(x - alone).max() <= 1e-4 * np.abs(alone).max()


def test_generate_and_a_reused_prefix(model):
    tr, prompt = model.transformer, model.tokenize("The quick brown fox")
    cache = KVCache(model.spec, 64, "f32")
    seq = [int(tr.forward(prompt, cache).argmax())]
    for _ in range(5):
        seq.append(int(tr.forward([seq[-1]], cache).argmax()))
    assert "".join(model.generate(prompt, max_tokens=6, **GREEDY)) == model.detokenize(seq)
    # a cache cut back to a prefix continues as one that never held the rest (the KV-shared
    # layers read their source layers' rows, which the cut keeps)
    full = prompt + seq
    cache.truncate(len(prompt) - 2)
    again = tr.forward(full[len(prompt) - 2 :], cache, all_logits=True)
    fresh = tr.forward(full, KVCache(model.spec, 64, "f32"), all_logits=True)
    assert np.abs(again - fresh[len(prompt) - 2 :]).max() <= 1e-4 * np.ptp(fresh)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(): return 0 if x else 1\n\n  Numbers like 12345",
    "Ünïcödé ✓ not in the vocabulary, and\ttabs",
    "  leading spaces and trailing  ",
    "<bos>user\nHello<eos> again",
]


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokenizer_agrees_with_llama_cpp(model, text):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(DATA / "f32.gguf"), n_ctx=32, vocab_only=True, verbose=False)
    try:
        want = llm.tokenize(text.encode(), add_bos=True, special=True)
    finally:
        llm.close()
    got = model.tokenize(text)
    assert got == want
    assert model.detokenize(got[1:]) == text


def test_a_pack_keeps_the_per_layer_parts(model, tmp_path):
    from edgerun.tools.convert import convert

    out = convert(DATA / "f32.gguf", tmp_path / "pack", "keep", progress=False)
    pack = edgerun.load(out, n_ctx=64, threads=1, interleave=False)
    try:
        assert pack.spec == model.spec
        ids = _ids()[:20]
        assert np.array_equal(pack.logits(ids), model.logits(ids))
    finally:
        pack.close()


def test_the_planner_counts_the_per_layer_table_by_rows(model):
    """The per-layer embedding table is a lookup: the plan holds only the rows a
    conversation touches (at most EMBEDDING_TOUCH_BYTES), not the table."""
    from edgerun.formats.gguf import read_gguf
    from edgerun.offload.plan import EMBEDDING_TOUCH_BYTES, _resident_bytes, footprint

    reader = read_gguf(DATA / "q8_0.gguf")
    fp = footprint(model.spec, reader)
    table = reader.tensor("per_layer_token_embd.weight").nbytes
    assert fp.per_layer_table_bytes == table > 0
    gates = sum(reader.tensor(f"blk.{i}.inp_gate.weight").nbytes for i in range(5))
    assert fp.attention_bytes > gates  # the gates and projections are held
    without = _resident_bytes(dataclasses.replace(fp, per_layer_table_bytes=0))
    assert _resident_bytes(fp) - without == min(table, EMBEDDING_TOUCH_BYTES)


def test_under_a_budget_the_per_layer_table_stays_on_storage(tmp_path):
    """Dense offloading under a RAM budget: the per-layer embedding table stays on storage
    (nothing copies it into memory; a token's rows are read with direct I/O) and greedy
    decoding gives the resident model's text. In a fresh process, as the budget is the process's."""
    import json
    import subprocess
    import sys

    path = DATA / "q8_0.gguf"
    res = edgerun.load(path, n_ctx=64, threads=1, interleave=False)
    want = "".join(res.generate("The quick brown", max_tokens=8, **GREEDY))
    res.close()
    code = f"""
import json, edgerun, numpy as np
from edgerun.api import minimum_ram_budget
path = {str(path)!r}
need = minimum_ram_budget(path, n_ctx=64)
m = edgerun.load(path, n_ctx=64, threads=1, offload="dense", ram_budget=int(need * 1.05),
                 offload_options=dict(hold_after_warm_up=False, kv_loan_tiers=0))
got = "".join(m.generate("The quick brown", max_tokens=8, temperature=0.0, seed=0))
base = m.transformer.per_layer.table.data  # a view of the mapped file, or a copy
while isinstance(base, np.ndarray):
    base = base.base
ple, store = m.transformer.per_layer, m.transformer.store
lo = store._reader.infos["per_layer_token_embd.weight"].offset
seen, read_into = [], store.direct.read_into
def counting(ranges, out, out_offsets=None):  # the table's ranges the reader is asked for
    seen.extend(r for r in ranges if lo <= r[0] < lo + ple.table_bytes)
    return read_into(ranges, out, out_offsets)
store.direct.read_into = counting
rows = ple.read_rows(np.array([5, 0, 7]))
same = np.array_equal(np.asarray(rows.data), np.asarray(ple.table.data)[[5, 0, 7]])
print(json.dumps(dict(got=got, mapped=isinstance(base, memoryview), same=same,
                      read=sum(n for _, n in seen), row=ple.table.data.shape[1])))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["got"] == want
    assert out["mapped"]
    # the three tokens' rows through the direct reader, and only those
    assert out["same"] and out["read"] == 3 * out["row"]


def test_info_shows_the_per_layer_fields(capsys):
    from edgerun.cli import main

    assert main(["info", str(DATA / "q8_0.gguf")]) == 0
    out = capsys.readouterr().out
    assert "head dims:     32 on layers 0, 1, 3; 64 on layers 2, 4" in out
    assert "KV shared:     2 layers read another's KV (3<-1, 4<-2)" in out
    assert "per-layer emb: 16 per layer" in out


def test_gpu_placement_is_refused_by_name(model):
    from edgerun.errors import UnsupportedError
    from edgerun.gpu.place import move_layers

    with pytest.raises(UnsupportedError, match="gemma4 layers differ in shape"):
        move_layers(model.transformer, model.transformer.store, [0], "cpu")


def test_the_kv_cache_counts_the_slabs_it_writes(model):
    """Layers 3 and 4 store no KV of their own: a position costs the three owner layers'
    rows (of the largest head_dim, the cache's row), and that is what writing takes."""
    from edgerun.model.kvcache import written_slabs

    s = model.spec
    assert written_slabs(s) == 3
    assert KVCache.bytes_for(s, 1, "f32") == 3 * 2 * 64 * 4
    cache = KVCache(s, 64, "f32")
    model.transformer.forward(_ids()[:10], cache)
    assert cache.position_bytes == KVCache.bytes_for(s, 1, "f32")
    assert not cache.k[3:].any() and not cache.v[3:].any()  # the shared layers' slabs
