"""Gemma 3n text (tests/data/families/gemma3n: AltUp streams, Laurel residual, activation
sparsity, per-layer embeddings, KV shared across layers) through every path a model takes:
each of its parts moves the logits (so the reference check can fail), a prompt pass
equals token-by-token decoding, batched decode equals each sequence alone, a cut cache
reuses its KV rows, generation runs through edgerun.load and under a RAM budget, a pack
keeps the parts, and the paths that cannot compute them refuse by name. Agreement with
transformers' logits is tests/reference/test_families.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.model.kvcache import KVCache

DATA = Path(__file__).resolve().parents[1] / "data" / "families" / "gemma3n"
GREEDY = dict(temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def model():
    m = edgerun.load(DATA / "f32.gguf", n_ctx=96, threads=2, kv_type="f32")
    yield m
    m.close()


def _reference() -> tuple[list[int], np.ndarray]:
    with np.load(DATA / "reference.npz") as ref:
        return ref["ids"].tolist(), ref["logits"]


def _ids() -> list[int]:
    return _reference()[0]


def test_the_spec_has_gemma3ns_layers(model):
    s = model.spec
    assert s.arch == "gemma3n"
    assert (s.altup_inputs, s.altup_active, s.laurel) == (4, 0, True)
    assert s.layer_kv_source == (0, 1, 2, 3, 3, 2)  # 4 and 5 reuse the last of their kind
    assert s.layer_windows == (8, 8, 0, 8, 8, 0)
    assert s.per_layer_input == 16
    # the normal quantiles of 0.95 and 0.8 (the converter's), dense after
    assert s.layer_ffn_sparsity[0] == pytest.approx(1.6448536, abs=1e-6)
    assert s.layer_ffn_sparsity[1] == pytest.approx(0.8416212, abs=1e-6)
    assert s.layer_ffn_sparsity[2:] == (None,) * 4
    tr = model.transformer
    assert tr.layers[4].k is None and tr.layers[5].v is None
    assert tr.layers[0].laurel.left.shape == (16, 64)


def _logits_without(model, monkeypatch, part: str) -> np.ndarray:
    """The reference tokens' logits with one of Gemma 3n's parts turned off."""
    from edgerun.model import altup
    from edgerun.model.transformer import Transformer

    spec = model.spec
    if part == "activation sparsity":
        spec = dataclasses.replace(spec, layer_ffn_sparsity=())
    elif part == "laurel":
        monkeypatch.setattr(altup.LaurelWeights, "__call__", lambda self, x, eps, decode: x)
    elif part == "altup router":
        zeros = lambda self, x, eps: np.zeros((x.shape[0], 4), np.float32)  # noqa: E731
        monkeypatch.setattr(altup.AltUpWeights, "modalities", zeros)
    elif part == "per-layer embeddings":
        monkeypatch.setattr(Transformer, "_add_per_layer", _zero_per_layer)
    elif part == "altup streams":  # the merge reads the first stream alone
        monkeypatch.setattr(altup.AltUpMerge, "run", _merge_first)
    tr = Transformer(spec, model.transformer.store, "test")
    ids = _ids()
    return tr.forward(ids, KVCache(spec, len(ids), "f32"), all_logits=True)


def _zero_per_layer(self, rows, ids):
    rows.ple = np.zeros((len(ids), self.spec.n_layers, self.spec.per_layer_input), np.float32)


def _merge_first(self, rows):
    from edgerun.ops.norm import rmsnorm

    rows.h = rows.streams[0].copy()
    rows.x = rmsnorm(rows.h, self.norm, self.eps)


@pytest.mark.parametrize(
    "part",
    ["activation sparsity", "laurel", "altup router", "per-layer embeddings", "altup streams"],
)
def test_each_part_moves_the_logits(model, monkeypatch, part):
    """Without the part the logits leave the reference by far more than the f32 bound
    (1e-3 of the spread) the model meets with it: the reference check sees each part."""
    ids, ref = _reference()
    spread = np.ptp(ref, axis=-1)
    ours = model.transformer.forward(ids, KVCache(model.spec, len(ids), "f32"), all_logits=True)
    assert (np.abs(ours - ref).max(-1) / spread).max() <= 1e-3
    without = _logits_without(model, monkeypatch, part)
    assert (np.abs(without - ref).max(-1) / spread).max() >= 0.05


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
    full = prompt + seq
    cache.truncate(len(prompt) - 2)
    again = tr.forward(full[len(prompt) - 2 :], cache, all_logits=True)
    fresh = tr.forward(full, KVCache(model.spec, 64, "f32"), all_logits=True)
    assert np.abs(again - fresh[len(prompt) - 2 :]).max() <= 1e-4 * np.ptp(fresh)


def test_sessions_resume_and_the_scheduler_batches_them(tmp_path):
    """A session saved and resumed continues as the uninterrupted one, and sessions the
    batching scheduler decodes together give the sequential answers. The reference file
    is a base model: the tiny families' chat template stands in for Gemma 3n's."""
    from tiny_families import TEMPLATE
    from together import send_together

    from edgerun.serving.session import Session

    greedy = dict(temperature=0.0, repeat_penalty=1.0)
    m = edgerun.load(DATA / "q8_0.gguf", n_ctx=256, threads=1, kv_type="f16")
    try:
        m.tokenizer.chat_template = TEMPLATE
        s = m.session()
        s.send("Name three fruits.", max_tokens=10, **greedy)
        resumed = Session.load(m, s.save(tmp_path / "chat.safetensors"))
        assert resumed.cache.tokens == s.cache.tokens
        a = s.send("Which one is red?", max_tokens=10, **greedy)
        assert resumed.send("Which one is red?", max_tokens=10, **greedy) == a
        prompts = ["the theme of the day", "hello world, this is the test", "x", "thethe"]
        seq = [m.session().send(p, max_tokens=10, **greedy) for p in prompts]
        out, most = send_together(m, prompts, max_tokens=10, **greedy)
        assert out == seq
        assert most > 1  # they really were decoded together
    finally:
        m.close()


def test_a_pack_keeps_the_altup_parts(model, tmp_path):
    from edgerun.tools.convert import convert

    out = convert(DATA / "f32.gguf", tmp_path / "pack", "keep", progress=False)
    pack = edgerun.load(out, n_ctx=64, threads=1, interleave=False)
    try:
        assert pack.spec == model.spec
        ids = _ids()[:20]
        assert np.array_equal(pack.logits(ids), model.logits(ids))
    finally:
        pack.close()


def test_under_a_budget_it_decodes_as_resident(tmp_path):
    """Dense streaming under a RAM budget (the FFNs' rows from storage, the per-layer
    table read by rows) gives the resident model's greedy text. In a fresh process, as
    the budget is the process's."""
    import subprocess
    import sys

    path = DATA / "q8_0.gguf"
    res = edgerun.load(path, n_ctx=64, threads=1, interleave=False)
    want = "".join(res.generate("The quick brown", max_tokens=8, **GREEDY))
    res.close()
    code = f"""
import edgerun
from edgerun.api import minimum_ram_budget
path = {str(path)!r}
need = minimum_ram_budget(path, n_ctx=64)
m = edgerun.load(path, n_ctx=64, threads=1, offload="dense", ram_budget=int(need * 1.05),
                 offload_options=dict(hold_after_warm_up=False, kv_loan_tiers=0))
assert m.transformer.per_layer.read_rows is not None  # the table is read by rows
print(repr("".join(m.generate("The quick brown", max_tokens=8, temperature=0.0, seed=0))))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == repr(want)


def test_info_shows_the_altup_fields(capsys):
    from edgerun.cli import main

    assert main(["info", str(DATA / "q8_0.gguf")]) == 0
    out = capsys.readouterr().out
    assert "KV shared:     2 layers read another's KV (4<-3, 5<-2)" in out
    assert "altup:         4 streams, stream 0 through the layers" in out
    assert "laurel:        low-rank residual of rank 16" in out
    assert "0.842 on layers 1; 1.64 on layers 0" in out


def test_gpu_placement_is_refused_by_name(model):
    from edgerun.errors import UnsupportedError
    from edgerun.gpu.place import move_layers

    with pytest.raises(UnsupportedError, match="gemma3n layers differ in shape"):
        move_layers(model.transformer, model.transformer.store, [0], "cpu")


def test_the_decode_step_is_the_general_path(model):
    """The bound decode step covers none of AltUp's steps: the general path decodes."""
    from edgerun.model.decode_step import DecodeStep

    assert not DecodeStep.supports(model.transformer)


def test_sparse_offload_is_refused_by_name():
    """The sparse offload plan predicts a token's neurons from a calibration that knows
    nothing of the gate's own cutoff: refused before it calibrates. In a fresh process, as
    the budget is the process's."""
    import subprocess
    import sys

    code = f"""
import edgerun
from edgerun.api import minimum_ram_budget
from edgerun.errors import UnsupportedError
path = {str(DATA / "q8_0.gguf")!r}
need = minimum_ram_budget(path, n_ctx=64)
try:
    edgerun.load(path, n_ctx=64, threads=1, offload="sparse", ram_budget=int(need * 1.05))
except UnsupportedError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Gemma 3n's activation sparsity" in r.stdout


def _metadata() -> dict:
    from edgerun.formats.gguf import read_gguf

    return dict(read_gguf(DATA / "f32.gguf").metadata)


def test_files_without_the_layout_keys_take_llama_cpps_fixed_layout():
    """Files converted before the converter wrote them: KV stored by the first 20 layers,
    the first 10 layers sparse at the 0.95 quantile (as llama.cpp's graph, which reads
    neither key)."""
    from edgerun.arch import spec_from_gguf

    meta = _metadata()
    n = 30  # E2B's layers, every fifth one full attention (the pattern's default)
    meta.update({"gemma3n.block_count": n, "gemma3n.feed_forward_length": 128})
    for key in ("attention.shared_kv_layers", "activation_sparsity_scale",
                "attention.sliding_window_pattern"):  # fmt: skip
        del meta[f"gemma3n.{key}"]
    s = spec_from_gguf(meta, "e2b")
    assert s.layer_kv_source == tuple(range(20)) + (18, 18, 18, 18, 19) * 2
    assert s.layer_ffn_sparsity == (pytest.approx(1.6448533535003662),) * 10 + (None,) * 20


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("activation_sparsity_scale", [1.0, 2.0], "should be 6 numbers"),
        ("activation_sparsity_scale", [float("nan")] * 6, "should be 6 numbers"),
        ("altup.num_inputs", 1, "altup.num_inputs"),
        ("altup.active_idx", 4, "altup.active_idx"),
        ("attention.shared_kv_layers", 6, "no earlier"),
    ],
)
def test_bad_metadata_is_a_clear_error(key, value, match):
    from edgerun.arch import spec_from_gguf
    from edgerun.errors import ModelFormatError

    meta = _metadata()
    meta[f"gemma3n.{key}"] = value
    with pytest.raises(ModelFormatError, match=match):
        spec_from_gguf(meta, "bad.gguf")


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(): return 0 if x else 1\n\n  Numbers like 12345",
    "Ünïcödé ✓ not in the vocabulary, and\ttabs",
    "  leading spaces and trailing  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokenizer_agrees_with_llama_cpp(model, text):
    """The SentencePiece vocabulary the converter writes (no space prefix, as Gemma's);
    llama.cpp reads it with vocab_only, as it cannot load this model's weights."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(DATA / "f32.gguf"), n_ctx=32, vocab_only=True, verbose=False)
    try:
        want = llm.tokenize(text.encode(), add_bos=True, special=True)
    finally:
        llm.close()
    got = model.tokenize(text)
    assert got == want
    assert model.detokenize(got[1:]) == text
