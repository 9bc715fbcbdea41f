"""Tiny random GGUF models of the families beyond llama/qwen2/gemma3, each with the
metadata keys and optional tensors llama.cpp's converter writes for it, and a byte-level
vocabulary (every byte a token) so that any text tokenizes and chat templates render.

They exercise the paths a model takes (generate, sessions, the batching scheduler,
offloading): their numbers are random, so the tests compare edgerun with itself there;
agreement with transformers is tests/reference's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from hostile import ARR, BOOL, F32, I32, STR, U32, GGUFBuilder, Tensor

from edgerun.quant.quantize import quantize_tensor

D, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 128, 4, 2, 16, 4
Q_DIM, KV_DIM = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
SPECIAL = ["<s>", "</s>"]


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 tokens, one per byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


TOKENS = SPECIAL + _byte_tokens() + ["th", "the"]
MERGES = ["t h", "th e"]
VOCAB = len(TOKENS)
TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

# per family: its metadata keys beyond the common ones (under its prefix), whether its
# blocks have pre-norms, its post norms, its q/k norm width, and extra tensors
FAMILIES: dict[str, dict[str, Any]] = {
    # Llama 3.1-style rope_freqs, q/k/v/o biases, a tied output and a sliding window
    "llama": dict(
        keys={"attention.sliding_window": (U32, 24)},
        rope_freqs=True,
        biases=True,
        tied=True,
    ),
    "qwen3": dict(qk_norm=HEAD_DIM),
    "smollm3": dict(tied=True),
    "granite": dict(
        keys={
            "embedding_scale": (F32, 12.0),
            "attention.scale": (F32, 0.1),
            "residual_scale": (F32, 0.25),
            "logit_scale": (F32, 4.0),
        }
    ),
    "olmo2": dict(pre_norms=False, post_norms=True, qk_norm="full"),
    "exaone4": dict(
        keys={
            "attention.sliding_window": (U32, 12),
            "attention.sliding_window_pattern": (ARR, (BOOL, [True, True, True, False])),
        },
        pre_norms=False,
        post_norms=True,
        qk_norm=HEAD_DIM,
        tied=True,
    ),
    # attention and final logit softcaps, windows on even layers, post norms, GeGLU
    "gemma2": dict(
        keys={
            "attn_logit_softcapping": (F32, 2.0),
            "final_logit_softcapping": (F32, 10.0),
            "attention.sliding_window": (U32, 12),
        },
        post_norms=True,
        tied=True,
    ),
    # fused attn_qkv and gate+up, partial rotary, LongRoPE factors
    "phi3": dict(
        keys={
            "rope.dimension_count": (U32, HEAD_DIM // 2),
            "attention.sliding_window": (U32, 0),
            "rope.scaling.attn_factor": (F32, 1.2),
            "rope.scaling.original_context_length": (U32, 16),
        },
        fused=("attn_qkv", "ffn_gate_up"),
        longrope=True,
    ),
    # fused gate+up, partial rotary, q/k/v biases, post norms
    "glm4": dict(
        keys={"rope.dimension_count": (U32, HEAD_DIM // 2)},
        fused=("ffn_gate_up",),
        biases="qkv",
        post_norms=True,
    ),
    # LayerNorm, parallel blocks, windows on 3 layers of 4 (global ones without RoPE)
    "cohere2": dict(
        keys={
            "attention.layer_norm_epsilon": (F32, 1e-5),
            "attention.sliding_window": (U32, 12),
            "logit_scale": (F32, 0.5),
        },
        norm_eps_key="layer_norm_epsilon",
        parallel=True,
        tied=True,
    ),
    # short-convolution layers 0 and 2 (a recurrent state) between attention layers with
    # per-head q/k norms; head_count_kv per layer (0: convolution), output norm renamed
    "lfm2": dict(
        keys={
            "shortconv.l_cache": (U32, 3),
            "attention.head_count_kv": (ARR, (U32, [0, KV_HEADS, 0, KV_HEADS])),
        },
        recurrent=(0, 2),
        qk_norm=HEAD_DIM,
        tied=True,
        output_norm="token_embd_norm.weight",
    ),
    # gated DeltaNet layers 0 and 2 (conv state and per-head matrices; 2 key heads over 4
    # value heads of 16) between attention layers whose q projection carries an output
    # gate, with per-head q/k norms and partial RoPE; the FFN's norm is named
    # post_attention_norm, as llama.cpp's converter writes it
    "qwen35": dict(
        keys={
            "ssm.conv_kernel": (U32, 4),
            "ssm.state_size": (U32, 16),
            "ssm.group_count": (U32, 2),
            "ssm.time_step_rank": (U32, 4),
            "ssm.inner_size": (U32, 64),
            "attention.recurrent_layers": (ARR, (BOOL, [True, False, True, False])),
            "rope.dimension_count": (U32, HEAD_DIM // 2),
        },
        recurrent=(0, 2),
        mixer="deltanet",
        qk_norm=HEAD_DIM,
        gated_q=True,
        ffn_norm="post_attention_norm",
    ),
    # Granite 4.0 H: Mamba-2 layers 0 and 2 (d_inner 128 in 8 heads of 16, 2 groups of B
    # and C of state size 16, a conv of 4 taps with a bias) between attention layers
    # without RoPE; Granite's multipliers
    "granitehybrid": dict(
        keys={
            "ssm.conv_kernel": (U32, 4),
            "ssm.state_size": (U32, 16),
            "ssm.group_count": (U32, 2),
            "ssm.time_step_rank": (U32, 8),
            "ssm.inner_size": (U32, 128),
            "attention.head_count_kv": (ARR, (U32, [0, KV_HEADS, 0, KV_HEADS])),
            "rope.scaling.finetuned": (BOOL, False),
            "embedding_scale": (F32, 6.0),
            "residual_scale": (F32, 0.5),
            "attention.scale": (F32, 0.125),
            "logit_scale": (F32, 2.0),
        },
        recurrent=(0, 2),
        mixer="mamba2",
        tied=True,
    ),
}


def _matrix(name: str, rows: int, cols: int, rng, qtype: str, scale: float = 0.15) -> Tensor:
    t = quantize_tensor(name, rng.normal(0, scale, (rows, cols)), qtype)
    return Tensor(name, (cols, rows), t.data.tobytes(), int(t.qtype))


def _vector(name: str, values: np.ndarray) -> Tensor:
    return Tensor(name, (values.size,), values.astype(np.float32).tobytes())


def _deltanet(b: str, rng, qtype: str) -> dict[str, Tensor]:
    """A gated DeltaNet layer's tensors (the qwen35 family's sizes above), as llama.cpp's
    converter names and lays them out."""
    hk, hv, dk, taps = 2, 4, 16, 4
    channels, value = (2 * hk + hv) * dk, hv * dk
    conv = rng.normal(0, 0.5, (channels, taps)).astype(np.float32)
    return {
        "qkv": _matrix(f"{b}attn_qkv.weight", channels, D, rng, qtype),
        "z": _matrix(f"{b}attn_gate.weight", value, D, rng, qtype),
        "beta": _matrix(f"{b}ssm_beta.weight", hv, D, rng, qtype),
        "alpha": _matrix(f"{b}ssm_alpha.weight", hv, D, rng, qtype),
        "out": _matrix(f"{b}ssm_out.weight", D, value, rng, qtype),
        "conv": Tensor(f"{b}ssm_conv1d.weight", (taps, channels), conv.tobytes()),
        "dt": _vector(f"{b}ssm_dt.bias", rng.normal(0, 1, hv)),
        "a": _vector(f"{b}ssm_a", -np.exp(rng.normal(0, 1, hv))),
        "norm": _vector(f"{b}ssm_norm.weight", rng.uniform(0.6, 1.4, dk)),
    }


def _mamba2(b: str, rng, qtype: str) -> dict[str, Tensor]:
    """A Mamba-2 layer's tensors (the granitehybrid family's sizes above), as llama.cpp's
    converter names and lays them out (ssm_a and ssm_d [1, heads], ssm_norm [groups,
    d_inner / groups])."""
    heads, p_dim, groups, state, taps = 8, 16, 2, 16, 4
    inner = heads * p_dim
    channels = inner + 2 * groups * state
    conv = rng.normal(0, 0.5, (channels, taps)).astype(np.float32)

    def per_head(name: str, values: np.ndarray) -> Tensor:
        return Tensor(name, (1, heads), values.astype(np.float32).tobytes())

    norm = rng.uniform(0.6, 1.4, inner).astype(np.float32)
    return {
        "in": _matrix(f"{b}ssm_in.weight", inner + channels + heads, D, rng, qtype),
        "out": _matrix(f"{b}ssm_out.weight", D, inner, rng, qtype),
        "conv": Tensor(f"{b}ssm_conv1d.weight", (taps, channels), conv.tobytes()),
        "conv_b": _vector(f"{b}ssm_conv1d.bias", rng.normal(0, 0.1, channels)),
        "dt": _vector(f"{b}ssm_dt.bias", rng.normal(0, 1, heads)),
        "a": per_head(f"{b}ssm_a", -np.exp(rng.normal(0, 1, heads))),
        "d": per_head(f"{b}ssm_d", rng.normal(1, 0.3, heads)),
        "norm": Tensor(f"{b}ssm_norm.weight", (inner // groups, groups), norm.tobytes()),
    }


def family_gguf(
    path: Path,
    family: str,
    qtype: str = "q8_0",
    seed: int = 0,
    d_ff: int = FF,
    vectors: dict[str, np.ndarray] | None = None,
    fused: bool = True,
    keys: dict[str, tuple[int, Any]] | None = None,
) -> Path:
    """Write a tiny random `family` model to `path` (matrices in `qtype`; a wide d_ff
    gives offloading FFN rows worth streaming; vectors: 1-D tensors that replace or join
    the model's, by name, for hostile-value tests). A family that fuses matrices (Phi-3's
    attn_qkv, a gate+up ffn_up) stores them fused as its converter does, or, fused False,
    the same rows as separate tensors. keys: metadata under the family's prefix that
    replaces its own (hostile-metadata tests), as (type, value)."""
    f = FAMILIES[family]
    a = family
    kvs: dict[str, tuple[int, Any]] = {
        "general.architecture": (STR, a),
        "general.name": (STR, f"tiny {a}"),
        "general.alignment": (U32, 32),
        f"{a}.block_count": (U32, LAYERS),
        f"{a}.context_length": (U32, 512),
        f"{a}.embedding_length": (U32, D),
        f"{a}.feed_forward_length": (U32, d_ff),
        f"{a}.attention.head_count": (U32, HEADS),
        f"{a}.attention.head_count_kv": (U32, KV_HEADS),
        f"{a}.attention.key_length": (U32, HEAD_DIM),
        f"{a}.attention.value_length": (U32, HEAD_DIM),
        f"{a}.rope.freq_base": (F32, 10000.0),
        f"{a}.rope.dimension_count": (U32, HEAD_DIM),
        f"{a}.attention.{f.get('norm_eps_key', 'layer_norm_rms_epsilon')}": (F32, 1e-5),
        f"{a}.vocab_size": (U32, VOCAB),
        **{f"{a}.{k}": v for k, v in {**f.get("keys", {}), **(keys or {})}.items()},
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.pre": (STR, "default"),
        "tokenizer.ggml.tokens": (ARR, (STR, TOKENS)),
        "tokenizer.ggml.token_type": (ARR, (I32, [3, 3] + [1] * (VOCAB - 2))),
        "tokenizer.ggml.merges": (ARR, (STR, MERGES)),
        "tokenizer.ggml.bos_token_id": (U32, 0),
        "tokenizer.ggml.eos_token_id": (U32, 1),
        "tokenizer.ggml.add_bos_token": (BOOL, False),
        "tokenizer.chat_template": (STR, TEMPLATE),
    }
    rng = np.random.default_rng(seed)

    def gains(n: int) -> np.ndarray:
        return rng.uniform(0.6, 1.4, n)

    tensors = [_matrix("token_embd.weight", VOCAB, D, rng, qtype, 0.5)]
    tensors.append(_vector(f.get("output_norm", "output_norm.weight"), gains(D)))
    if not f.get("tied"):
        tensors.append(_matrix("output.weight", VOCAB, D, rng, qtype, 0.5))
    if f.get("rope_freqs"):  # Llama 3's shape: 1 for fast frequencies, up to 8 for slow
        tensors.append(_vector("rope_freqs.weight", np.geomspace(1.0, 8.0, HEAD_DIM // 2)))
    if f.get("longrope"):  # over the rotated pairs (a quarter of the head)
        tensors.append(_vector("rope_factors_short.weight", rng.uniform(1.0, 2.0, HEAD_DIM // 4)))
        tensors.append(_vector("rope_factors_long.weight", rng.uniform(2.0, 8.0, HEAD_DIM // 4)))
    fuse = {
        "attn_qkv": ("attn_qkv", ("attn_q", "attn_k", "attn_v")),
        "ffn_gate_up": ("ffn_up", ("ffn_gate", "ffn_up")),
    }
    qk = f.get("qk_norm")
    qn, kn = (Q_DIM, KV_DIM) if qk == "full" else (qk, qk)
    for i in range(LAYERS):
        b = f"blk.{i}."
        mats = {
            role: _matrix(f"{b}{role}.weight", rows, cols, rng, qtype)
            for role, rows, cols in (
                ("attn_q", Q_DIM * (2 if f.get("gated_q") else 1), D),
                ("attn_k", KV_DIM, D),
                ("attn_v", KV_DIM, D),
                ("attn_output", D, Q_DIM),
                ("ffn_gate", d_ff, D),
                ("ffn_up", d_ff, D),
                ("ffn_down", D, d_ff),
            )
        }
        for kind in f.get("fused", ()) if fused else ():  # rows of each part, in order
            name, roles = fuse[kind]
            parts = [mats.pop(r) for r in roles]
            rows = sum(t.dims[1] for t in parts)
            data = b"".join(t.data for t in parts)
            mats[name] = Tensor(f"{b}{name}.weight", (D, rows), data, parts[0].type_id)
        if i in f.get("recurrent", ()) and f.get("mixer") == "deltanet":
            for role in ("attn_q", "attn_k", "attn_v", "attn_output"):
                del mats[role]
            mats.update(_deltanet(b, rng, qtype))
        elif i in f.get("recurrent", ()) and f.get("mixer") == "mamba2":
            for role in ("attn_q", "attn_k", "attn_v", "attn_output"):
                del mats[role]
            mats.update(_mamba2(b, rng, qtype))
        elif i in f.get("recurrent", ()):  # a short convolution in place of attention
            for role in ("attn_q", "attn_k", "attn_v", "attn_output"):
                del mats[role]
            mats["in"] = _matrix(f"{b}shortconv.in_proj.weight", 3 * D, D, rng, qtype)
            mats["out"] = _matrix(f"{b}shortconv.out_proj.weight", D, D, rng, qtype)
            conv = rng.normal(0, 0.5, (D, 3)).astype(np.float32)
            mats["conv"] = Tensor(f"{b}shortconv.conv.weight", (3, D), conv.tobytes())
        tensors += mats.values()
        if f.get("pre_norms", True):
            tensors.append(_vector(f"{b}attn_norm.weight", gains(D)))
            if not f.get("parallel"):  # parallel blocks norm once
                ffn_norm = f.get("ffn_norm", "ffn_norm")
                tensors.append(_vector(f"{b}{ffn_norm}.weight", gains(D)))
        if f.get("post_norms"):
            tensors.append(_vector(f"{b}post_attention_norm.weight", gains(D)))
            tensors.append(_vector(f"{b}post_ffw_norm.weight", gains(D)))
        if qk and i not in f.get("recurrent", ()):
            tensors.append(_vector(f"{b}attn_q_norm.weight", gains(qn)))
            tensors.append(_vector(f"{b}attn_k_norm.weight", gains(kn)))
        if f.get("biases"):  # "qkv": q/k/v only (GLM-4)
            roles = [("attn_q", Q_DIM), ("attn_k", KV_DIM), ("attn_v", KV_DIM), ("attn_output", D)]
            for role, n in roles[:3] if f["biases"] == "qkv" else roles:
                tensors.append(_vector(f"{b}{role}.bias", rng.normal(0, 0.1, n)))
    vectors = vectors or {}
    tensors = [t for t in tensors if t.name not in vectors]
    tensors += [_vector(name, v) for name, v in vectors.items()]
    return GGUFBuilder(kvs=kvs, tensors=tensors).write(path)
