"""Mixture-of-experts models (qwen3moe, qwen2moe: the tiny reference models of
tests/data/families/) through the paths a model takes: batched decode of several sequences
equal to each alone bit for bit, a prompt pass equal to token-by-token decode within
rounding, generate, sessions and the batching scheduler, `edgerun info`, and the refusal
of a RAM budget (routed experts are not streamed from flash yet). Agreement with
transformers and llama.cpp is tests/reference/test_families.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from together import send_together

import edgerun
from edgerun.model.kvcache import KVCache
from edgerun.model.moe import MoEFFN

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
MODELS = [
    "qwen3moe/q8_0.gguf",
    "qwen2moe/q8_0.gguf",
    "qwen3moe-q4k/q4_k_m.gguf",
    "lfm2moe/q8_0.gguf",  # sigmoid routing with a bias, a dense first layer, conv states
    "granitehybrid-moe/q8_0.gguf",  # a shared expert on every layer, Mamba-2 states
    "gemma4-moe/q8_0.gguf",  # experts beside the dense MLP, gate+up fused, scaled per expert
]
DENSE_LEAD = {"lfm2moe/q8_0.gguf": 1}  # the models' leading dense FFN layers
GREEDY = dict(temperature=0.0, repeat_penalty=1.0)
TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|user|>assistant: {% endif %}"
)


@pytest.mark.parametrize("path", MODELS)
def test_batched_decode_equals_each_sequence_alone(path):
    m = edgerun.load(DATA / path, n_ctx=64, threads=2, kv_type="f32")
    try:
        tr = m.transformer
        moe = [isinstance(layer.ffn, MoEFFN) for layer in tr.layers]
        assert moe == [i >= DENSE_LEAD.get(path, 0) for i in range(len(moe))]
        prompts = [m.tokenize(t) for t in ("The quick brown", "Python is", "12345 and", "A")]
        alone, caches = [], []
        for p in prompts:  # each sequence alone: prompt, then one token at a time
            c = KVCache(m.spec, 64, "f32")
            rows = [tr.forward(p, c)]
            for _ in range(4):
                rows.append(tr.forward([int(rows[-1].argmax())], c))
            alone.append(rows)
        for p in prompts:
            caches.append(KVCache(m.spec, 64, "f32"))
            tr.forward(p, caches[-1])
        for step in range(4):  # the four decoded together, fed the tokens each chose alone
            tokens = [int(alone[b][step].argmax()) for b in range(4)]
            got = tr.forward_batch(tokens, caches)
            for b in range(4):
                assert np.array_equal(got[b], alone[b][step + 1]), (path, step, b)
    finally:
        m.close()


def test_prompt_pass_equals_token_by_token_within_rounding():
    m = edgerun.load(DATA / "qwen3moe" / "f32.gguf", n_ctx=64, threads=2, kv_type="f32")
    try:
        tr, ids = m.transformer, m.tokenize("The quick brown fox jumps over the lazy dog.")
        full = tr.forward(ids, KVCache(m.spec, 64, "f32"), all_logits=True)
        c = KVCache(m.spec, 64, "f32")
        steps = np.stack([tr.forward([t], c) for t in ids])
        spread = np.ptp(full, -1)
        assert (np.abs(full - steps).max(-1) / spread).max() < 1e-4
    finally:
        m.close()


def test_generate_sessions_and_scheduler_on_a_moe_model():
    m = edgerun.load(DATA / "qwen2moe" / "q8_0.gguf", n_ctx=256, threads=2, kv_type="f16")
    try:
        prompt = m.tokenize("The quick brown fox")
        tr, cache = m.transformer, KVCache(m.spec, 64, "f32")
        seq = [int(tr.forward(prompt, cache).argmax())]
        for _ in range(5):
            seq.append(int(tr.forward([seq[-1]], cache).argmax()))
        assert "".join(m.generate(prompt, max_tokens=6, **GREEDY)) == m.detokenize(seq)
        m.tokenizer.chat_template = TEMPLATE  # the tiny model is a base model
        prompts = ["hello world", "the lazy dog", "x", "Numbers like 12345"]
        sequential = [m.session().send(p, max_tokens=8, **GREEDY) for p in prompts]
        together, most = send_together(m, prompts, max_tokens=8, **GREEDY)
        assert together == sequential
        assert most > 1
    finally:
        m.close()


def test_a_moe_budget_below_its_minimum_is_refused():
    """A RAM budget streams a MoE's routed experts (tests/model/test_moe_offload.py); one
    below the minimum is refused with the minimum named, at a load and in `edgerun plan`."""
    from edgerun.errors import BudgetError

    path = DATA / "qwen3moe" / "q8_0.gguf"
    with pytest.raises(BudgetError, match=r"routed experts on flash: [\d,]+ MiB"):
        edgerun.load(path, n_ctx=64, threads=1, ram_budget="50M")
    plan = subprocess.run(
        [sys.executable, "-m", "edgerun", "plan", str(path), "--ram-budget", "50M"],
        capture_output=True,
        text=True,
    )
    assert plan.returncode != 0
    assert "below the minimum" in plan.stderr
    assert "Traceback" not in plan.stderr


def _greedy_logits(m, ids: list[int]) -> np.ndarray:
    c = KVCache(m.spec, 64, "f32")
    rows = [m.transformer.forward(ids[:4], c)]
    for t in ids[4:]:
        rows.append(m.transformer.forward([t], c))
    return np.stack([np.asarray(r, np.float32).reshape(-1) for r in rows])


@pytest.mark.parametrize("ram_budget", [None, "streamed"])
def test_a_gpu_budget_puts_a_moe_s_attention_on_the_device(ram_budget):
    """A GPU budget takes a MoE's attention layers (its routed experts stay on the CPU,
    resident or streamed from flash, as llama.cpp's -ot exps=CPU); on the torch CPU device
    the logits follow the CPU path's. Under a RAM budget the moved attention is never
    read into RAM (the placement reads it from the mapping)."""
    path = DATA / "qwen3moe" / "q8_0.gguf"
    kw = dict(n_ctx=64, threads=1, kv_type="f32")
    resident = edgerun.load(path, **kw)
    if ram_budget:
        from edgerun.api import minimum_ram_budget

        kw["ram_budget"] = minimum_ram_budget(path, n_ctx=64, kv_type="f32") + (4 << 20)
        kw["offload"] = "dense"  # the tiny model fits: its experts stream only when asked
    m = edgerun.load(path, gpu_budget="50M", gpu_device="cpu", **kw)
    try:
        p = m.plan
        assert p.mode == ("experts" if ram_budget else "resident")
        assert p.gpu_attention_layers == tuple(range(m.spec.n_layers))
        assert p.gpu_ffn_layers == () and 0 < p.gpu_bytes <= 50 << 20
        kinds = {type(layer.attn_proj).__name__ for layer in m.transformer.layers}
        assert kinds == {"TorchProjections"}
        assert all(type(layer.ffn).__name__.endswith("MoEFFN") for layer in m.transformer.layers)
        if ram_budget:
            names = {m.spec.layer_tensor("attn_q", i) for i in p.gpu_attention_layers}
            assert names <= m.loader.store._reader.mapped
        ids = m.tokenize("The quick brown fox jumps over the lazy dog and")
        got, want = _greedy_logits(m, ids), _greedy_logits(resident, ids)
        assert (got.argmax(1) == want.argmax(1)).all()
        assert float(np.abs(got - want).max()) < 1e-3 * float(np.ptp(want))
    finally:
        m.close()
        resident.close()


def test_info_shows_the_experts():
    out = subprocess.run(
        [sys.executable, "-m", "edgerun", "info", str(DATA / "qwen3moe-q4k" / "q4_k_m.gguf")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "experts:       8 per layer on 2 of 2 layers, 2 used per token" in out
    assert "width 256" in out and "MB per expert" in out


def test_a_pack_of_a_moe_model_gives_the_gguf_logits(tmp_path):
    """`edgerun convert --quant keep` stores the 3-D expert tensors as 2-D [n_expert * rows,
    cols]; the pack's experts are views of those rows, so its logits are the GGUF's."""
    from edgerun.tools.convert import convert

    src = DATA / "qwen2moe" / "q8_0.gguf"
    pack = convert(str(src), tmp_path / "pack", "keep", progress=False)
    ids = list(range(3, 40))
    # no interleaved copies: a GGUF's attention would take their kernels, a pack's not
    a = edgerun.load(src, n_ctx=64, threads=2, kv_type="f32", interleave=False)
    b = edgerun.load(pack, n_ctx=64, threads=2, kv_type="f32", interleave=False)
    assert all(isinstance(layer.ffn, MoEFFN) for layer in b.transformer.layers)
    assert np.array_equal(a.logits(ids), b.logits(ids))


class _Altered:
    """A weight store that answers for one tensor differently: absent (None) or another
    vector."""

    def __init__(self, store, name: str, vector=None) -> None:
        self._store, self._name, self._vector = store, name, vector

    def has(self, name: str) -> bool:
        return self._store.has(name) and (name != self._name or self._vector is not None)

    def vector(self, name: str):
        return self._vector if name == self._name else self._store.vector(name)

    def __getattr__(self, attr):
        return getattr(self._store, attr)


@pytest.mark.parametrize(
    "name, vector, message",
    [
        ("blk.1.ffn_gate_inp.scale", np.ones(63, np.float32), r"should have 64 values"),
        ("blk.1.ffn_down_exps.scale", np.ones(9, np.float32), r"should have 8 values"),
        ("blk.1.pre_ffw_norm_2.weight", None, r"'blk.1.pre_ffw_norm_2.weight' is missing"),
        ("blk.1.post_ffw_norm_1.weight", None, r"'blk.1.post_ffw_norm_1.weight' is missing"),
    ],
)
def test_gemma4_experts_tensors_are_checked_by_name(name, vector, message):
    """Gemma 4's router gain, per-expert scales and the norms around the MLP and the
    experts: a wrong size or a missing one is a clear error naming the tensor."""
    from edgerun.errors import ModelFormatError
    from edgerun.formats.gguf import read_gguf
    from edgerun.model.moe import moe_ffn
    from edgerun.model.weights import ResidentStore

    path = DATA / "gemma4-moe" / "q8_0.gguf"
    f = read_gguf(path)
    spec = edgerun.arch.spec_from_gguf(f.metadata, str(path))
    store = ResidentStore(f, str(path))
    moe = moe_ffn(store, spec, 1, str(path))
    assert moe.reads_stream and moe.expert_scales.shape == (8,)
    with pytest.raises(ModelFormatError, match=message):
        moe_ffn(_Altered(store, name, vector), spec, 1, str(path))
