"""Gemma 2, Phi-3, GLM-4 and Cohere 2 files end to end, on tiny random GGUFs written here.

Phi-3 stores q/k/v as one `attn_qkv` and gate+up as one `ffn_up`, GLM-4 gate+up as one
`ffn_up`; the GGUF reader splits them by rows (formats/gguf.split_fused). A file with the
fused tensors must give the same logits, bit for bit, as one with the parts stored
separately, resident and under a RAM budget (offloading streams the parts' rows from
their places inside the fused tensor); and each family must run through the generation
paths: greedy generate, a chat session, and the batching scheduler with two requests in
one batch, each equal to its own greedy continuation from full forward passes.

Correctness against transformers is tests/reference/test_families.py's (converted
reference models); these files check the plumbing."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import edgerun
from edgerun.formats.gguf import read_gguf
from edgerun.model.kvcache import KVCache

D, HEADS, KV_HEADS, HD, FF, LAYERS = 64, 4, 2, 32, 128, 3
SPECIALS = ["<eos>", "<bos>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-character map: one token per byte, as a byte-level BPE vocabulary."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


VOCAB = len(SPECIALS) + 256 + 1  # and one merged token, "he"


def _weights(arch: str, seed: int) -> dict[str, np.ndarray]:
    """Random weights by GGUF tensor name, in the split form ([rows, cols] float32)."""
    rng = np.random.default_rng(seed)
    q_dim, kv_dim = HEADS * HD, KV_HEADS * HD
    w = {
        "token_embd.weight": rng.normal(0, 0.5, (VOCAB, D)),
        "output_norm.weight": rng.uniform(0.5, 1.5, D),
    }
    if arch not in ("gemma2", "cohere2"):
        w["output.weight"] = rng.normal(0, 0.5, (VOCAB, D))
    for i in range(LAYERS):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = rng.uniform(0.5, 1.5, D)
        if arch != "cohere2":  # one norm per layer for its parallel blocks
            w[b + "ffn_norm.weight"] = rng.uniform(0.5, 1.5, D)
        for name, rows, cols in (
            ("attn_q", q_dim, D),
            ("attn_k", kv_dim, D),
            ("attn_v", kv_dim, D),
            ("attn_output", D, q_dim),
            ("ffn_gate", FF, D),
            ("ffn_up", FF, D),
            ("ffn_down", D, FF),
        ):
            w[b + name + ".weight"] = rng.normal(0, 0.25, (rows, cols))
        if arch in ("gemma2", "glm4"):
            w[b + "post_attention_norm.weight"] = rng.uniform(0.5, 1.5, D)
            w[b + "post_ffw_norm.weight"] = rng.uniform(0.5, 1.5, D)
        if arch == "glm4":
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                w[b + name + ".bias"] = rng.normal(0, 0.5, n)
    if arch == "phi3":  # LongRoPE factors over the 8 rotated pairs (rope_dim 16)
        w["rope_factors_short.weight"] = rng.uniform(1.0, 2.0, 8)
        w["rope_factors_long.weight"] = rng.uniform(2.0, 8.0, 8)
    return {k: v.astype(np.float32) for k, v in w.items()}


def _fuse(w: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """The same weights as the converter stores them for `arch`: Phi-3 q/k/v in one
    attn_qkv, gate then up in one ffn_up (Phi-3, GLM-4)."""
    out = dict(w)
    for i in range(LAYERS):
        b = f"blk.{i}."
        if arch == "phi3":
            parts = [out.pop(b + f"attn_{r}.weight") for r in "qkv"]
            out[b + "attn_qkv.weight"] = np.concatenate(parts)
        gate, up = out.pop(b + "ffn_gate.weight"), out.pop(b + "ffn_up.weight")
        out[b + "ffn_up.weight"] = np.concatenate([gate, up])
    return out


def write_tiny(path: Path, arch: str, fused: bool, qtype: str = "f32", seed: int = 0) -> Path:
    """A tiny random `arch` GGUF with a byte-level vocabulary and a chat template."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HD)
    w.add_value_length(HD)
    if arch == "cohere2":
        w.add_layer_norm_eps(1e-5)
        w.add_sliding_window(6)
        w.add_logit_scale(0.5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "cohere2":
        pass
    elif arch == "gemma2":
        w.add_attn_logit_softcapping(2.0)
        w.add_final_logit_softcapping(10.0)
        w.add_sliding_window(6)
    else:  # partial rotary: 16 of the head's 32 dims
        w.add_rope_dimension_count(16)
    if arch == "phi3":
        w.add_sliding_window(0)
        w.add_rope_scaling_orig_ctx_len(16)
        w.add_rope_scaling_attn_factors(1.2)
    T = gguf.GGUFValueType
    tokens = [*SPECIALS, *_byte_tokens(), "he"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_key_value("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING)
    types = [3] * len(SPECIALS) + [1] * 257
    w.add_key_value("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32)
    w.add_key_value("tokenizer.ggml.merges", ["h e"], T.ARRAY, T.STRING)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    weights = _weights(arch, seed)
    for name, a in (_fuse(weights, arch) if fused else weights).items():
        if qtype == "q8_0" and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


PROMPT = list(range(20, 58))  # 38 tokens: past gemma2's window 6 and phi3's 16


N_CTX = 96


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """ids and up to n greedy tokens after them (an end token stops them and is left
    out, as a request's history leaves it), each from a full forward pass of the whole sequence on a
    fresh cache of the model's context (LongRoPE picks its factors by the cache's length,
    so a cache sized to the prompt, as Model.logits makes, may rotate differently)."""
    ids = list(ids)
    for _ in range(n):
        cache = KVCache(model.spec, N_CTX, "f32")
        t = int(model.transformer.forward(ids, cache).argmax())
        if t in model.tokenizer.eos_ids:  # the end: not part of the history
            break
        ids.append(t)
    return ids


def _load(path: Path, **kw):
    return edgerun.load(path, n_ctx=N_CTX, threads=2, kv_type="f32", interleave=False, **kw)


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
@pytest.mark.parametrize("arch", ["phi3", "glm4"])
def test_a_fused_file_runs_as_its_split_twin(tmp_path, arch, qtype):
    fused = write_tiny(tmp_path / "fused.gguf", arch, True, qtype)
    split = write_tiny(tmp_path / "split.gguf", arch, False, qtype)
    names = read_gguf(fused).tensor_names()
    assert "blk.0.ffn_gate.weight" in names and "blk.0.attn_q.weight" in names
    assert "blk.0.attn_qkv.weight" not in names
    a, b = _load(fused), _load(split)
    la, lb = a.logits(PROMPT), b.logits(PROMPT)
    assert np.isfinite(la).all() and np.array_equal(la, lb)
    a.close()
    b.close()


def test_a_fused_tensor_of_the_wrong_size_is_a_clear_error(tmp_path):
    from edgerun.errors import ModelFormatError

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    for k, v in (("block_count", 1), ("embedding_length", D), ("feed_forward_length", FF)):
        w.add_uint32(f"phi3.{k}", v)
    w.add_uint32("phi3.attention.head_count", HEADS)
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32("phi3.vocab_size", VOCAB)
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((D + 1, D), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match=r"attn_qkv.weight' has 65 rows, expected 192"):
        read_gguf(path)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "glm4", "cohere2"])
def test_each_family_generates_chats_and_batches(tmp_path, arch):
    m = _load(write_tiny(tmp_path / "m.gguf", arch, arch in ("phi3", "glm4"), "q8_0"))
    want = _greedy(m, PROMPT, 6)
    # greedy generate (the scheduler's one-sequence decode)
    text = "".join(m.generate(PROMPT, max_tokens=6, temperature=0.0))
    assert text == m.detokenize(want[len(PROMPT) :])
    # two requests decoded in one batch, each its own greedy continuation
    other = PROMPT[::-1][:29]
    want_other = _greedy(m, other, 6)
    sched = m.serving.scheduler
    params = m.settings.sampling(None, temperature=0.0)
    reqs = [sched.submit(p, params, 6) for p in (PROMPT, other)]
    for r in reqs:
        r.finished.wait(120)
    assert [r.history for r in reqs] == [want, want_other]
    # a chat session's answer is the greedy continuation of the rendered conversation
    s = m.session()
    r = s.send("hello", stream=True, max_tokens=5, temperature=0.0)
    answer = "".join(r)
    ids = m.tokenize(m.render_chat([{"role": "user", "content": "hello"}]))
    assert r.history[: len(ids)] == ids
    assert r.history == _greedy(m, ids, 5) and answer == r.text
    m.close()


@pytest.mark.parametrize("arch", ["phi3", "glm4"])
def test_a_fused_family_offloaded_under_a_ram_budget_equals_resident(tmp_path, arch):
    path = write_tiny(tmp_path / "m.gguf", arch, True, "q8_0")
    resident = _load(path)
    want = resident.logits(PROMPT)
    resident.close()
    off = _load(path, ram_budget="4G", offload="dense")
    assert off.plan.mode == "dense" and off.loader.offload_stats() is not None
    got = off.logits(PROMPT)
    assert np.array_equal(got, want)
    want_ids = _greedy(off, PROMPT, 4)[len(PROMPT) :]
    assert "".join(off.generate(PROMPT, max_tokens=4, temperature=0.0)) == off.detokenize(want_ids)
    off.close()
