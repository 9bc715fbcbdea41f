"""Build the tiny reference models of tests/data/families/ (run by hand, not by CI).

For each variant: a tiny randomly initialised transformers model (fixed seed, float32)
configured so that the family's features change the logits within the test tokens, a
tiny tokenizer (byte-level BPE trained here, or a SentencePiece model for the families
whose converter reads ``tokenizer.model``), converted to GGUF f32 / f16 / q8_0 by
llama.cpp's own ``convert_hf_to_gguf.py``. Each folder holds:

- ``f32.gguf``, ``f16.gguf``, ``q8_0.gguf`` (the variant's ``outtypes``)
- ``<type>.gguf`` for each of the variant's ``quantized`` types: llama.cpp's own
  quantization of the f32 file (``llama_model_quantize``), for formats whose rows must be
  multiples of 256 (K-quants) and so need a wider model than the others
- ``reference.npz``: ``ids`` (int32 [n]) and ``logits`` (float32 [n, vocab], transformers'
  float32 logits at every position), and ``llama_cpp_<type>`` (llama.cpp's logits on each
  quantized file)
- ``reference.json``: the GGUF architecture, the transformers config, the features the
  variant exercises, how much turning each feature off moves the logits, and llama.cpp's
  own max |logits - reference| for the f32 file.

The converter names BPE pre-tokenizers by a hash of a test string's tokens; a tokenizer
trained here hashes to nothing it knows, so ``get_vocab_base_pre`` is patched to return
the name llama.cpp writes for real files of that family.

Usage (from the repository root)::

    python tests/data/families/make_family_models.py            # every variant
    python tests/data/families/make_family_models.py llama3 qwen3

Needs torch, transformers (5.x), tokenizers, sentencepiece, llama_cpp (for the check) and
the llama.cpp source tree (``--llama-cpp``, default the unpacked llama-cpp-python sdist).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LLAMA_CPP = Path("/work/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
OUTTYPES = ("f32", "f16", "q8_0")
N_TOKENS = 56
SEED = 1234
CANDIDATES = 48
MIN_MARGIN = 0.06

TEXT = """The quick brown fox jumps over the lazy dog. Python is a programming language
that lets you work quickly and integrate systems more effectively. Numbers like 12345
and symbols like {}[]() appear in code: def main(): return 0 if x else 1
A tokenizer splits text into pieces; a model predicts the next piece of the text.
Rotary position embeddings rotate pairs of query and key features by an angle that grows
with the position, so attention scores depend on the distance between two tokens.
Sliding window attention lets a token see only the most recent tokens of the sequence."""

# Shared by every variant: d_model 64, two query heads of 32 over one KV head (GQA), d_ff 128.
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    # Weights of std 0.2 make attention sharp and logits spread out, so that positions,
    # windows and scales show in the logits (std 0.02 leaves attention nearly uniform).
    initializer_range=0.2,
)
# Phi-3 vocabularies hold these; llama.cpp sets attributes on <|endoftext|> for phi3 models.
PHI3_SYMBOLS = ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>")
BPE_SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|user|>", "<|im_end|>"]


@dataclass
class Variant:
    """One reference model: a transformers class and config, its tokenizer and features."""

    name: str
    model_class: str  # transformers class name
    config_class: str
    config: dict
    tokenizer: str  # "bpe", "spm" or "gemma4" (BPE over "▁"-escaped UTF-8, byte fallback)
    pre: str | None  # tokenizer.ggml.pre that llama.cpp writes for real files of the family
    add_bos: bool
    features: list[str]
    # feature name -> config overrides that turn it off (same weights): the logits must move
    ablations: dict[str, dict] = field(default_factory=dict)
    # extra pieces of a SentencePiece vocabulary (llama.cpp's vocab loader looks some up by name)
    spm_symbols: tuple[str, ...] = ()
    # why llama.cpp cannot reproduce this variant (its figures are then recorded, not checked)
    llama_cpp_differs: str = ""
    # False where llama.cpp cannot even load the files (its check is then skipped)
    llama_cpp_loads: bool = True
    # extra arguments of convert_hf_to_gguf.py (Qwen3.5: --no-mtp, as transformers writes
    # its checkpoints without the multi-token-prediction tensors)
    convert_args: tuple[str, ...] = ()
    # the converter's outtypes kept in the folder (the others are not written)
    outtypes: tuple[str, ...] = OUTTYPES
    # llama.cpp quantizations of the f32 file (llama_model_quantize), each kept as
    # <type>.gguf with llama.cpp's own logits on it in reference.npz as llama_cpp_<type>
    quantized: tuple[str, ...] = ()
    # config.json fields rewritten after transformers saves the model, before conversion:
    # the hub's spelling where it differs from transformers' (Granite 4's layer_types)
    hub_config: dict = field(default_factory=dict)


def _rope(**kw) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, **kw}


# Gemma 4: sliding layers rotate every pair (theta 1e4), full layers a quarter of them
# (proportional RoPE, theta 1e6)
_GEMMA4_ROPE = {
    "sliding_attention": _rope(),
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
    },
}
_MISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}
_MISTRAL3_ROPE_NO_BETA = {**_MISTRAL3_ROPE, "llama_4_scaling_beta": 0.0}

# Granite 4.0 "H": Mamba-2 layers 0 and 2, attention (no RoPE) on 1 and 3; d_inner 128 in
# 8 heads of 16, 2 groups of B/C of state size 16, conv width 4; a chunk of 16 so that the
# reference's chunked scan crosses chunk boundaries within the 56 test tokens
_GRANITEHYBRID = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_head=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    mamba_conv_bias=True,
    position_embedding_type=None,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.25,
    logits_scaling=2.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# what the hub's Granite 4 configs write, and the only spelling llama.cpp's converter reads
_GRANITEHYBRID_HUB = {"layer_types": ["mamba", "attention", "mamba", "attention"]}
_GRANITEHYBRID_FEATURES = [
    "Mamba-2 layers 0 and 2: in_proj -> z, xBC, dt; causal conv (width 4, bias) + SiLU; "
    "selective scan over 8 heads of 16 with 2 groups of B/C (state 16), D skip; "
    "gated RMSNorm in 2 groups; out_proj",
    "attention without RoPE on layers 1 and 3",
    "embedding_multiplier 3, residual_multiplier 0.5, attention_multiplier 0.25, logits_scaling 2",
    "56 tokens: past the conv window and 3 scan chunks of 16",
]

VARIANTS = [
    Variant(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(rope_parameters=_rope(rope_theta=1000000.0), tie_word_embeddings=True),
        "bpe",
        "qwen2",
        False,
        ["q/k/v biases", "tied output"],
    ),
    Variant(
        "llama3",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=False,
        ),
        "bpe",
        "llama-bpe",
        True,
        ["llama3 rope scaling (rope_freqs.weight)", "untied output"],
        {"llama3 rope scaling": {"rope_parameters": _rope()}},
    ),
    Variant(
        "llama",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=_rope(rope_theta=500000.0), tie_word_embeddings=False),
        "bpe",
        "llama-bpe",
        True,
        ["plain llama: no biases, no rope scaling", "untied output"],
    ),
    Variant(
        "llama-bias",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=_rope(), attention_bias=True, tie_word_embeddings=True),
        "bpe",
        "llama-bpe",
        True,
        ["q/k/v/o biases", "tied output", "no rope scaling"],
    ),
    Variant(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(head_dim=32, rope_parameters=_rope(rope_theta=1000000.0), tie_word_embeddings=False),
        "bpe",
        "qwen2",
        False,
        ["per-head q/k RMSNorm", "untied output"],
    ),
    Variant(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            rope_parameters=_rope(),
            tie_word_embeddings=True,
        ),
        "spm",
        None,
        True,
        [
            "sliding window 8 on even layers, global on odd",
            "attention logit softcap 3",
            "final logit softcap 5",
            "(1 + w) RMSNorm, post-attention and post-FFN norms",
            "embeddings scaled by sqrt(d_model)",
            "gelu (tanh) gated FFN",
        ],
        {
            "sliding window": {"sliding_window": 4096},
            "attention softcap": {"attn_logit_softcapping": None},
            "final softcap": {"final_logit_softcapping": None},
        },
    ),
    Variant(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            rope_parameters=_rope(partial_rotary_factor=0.5),
            original_max_position_embeddings=128,
            tie_word_embeddings=False,
        ),
        "spm",
        None,
        True,
        ["partial rotary (16 of 32 dims)", "fused qkv and gate_up", "untied output"],
        {"partial rotary": {"rope_parameters": _rope()}},
        spm_symbols=PHI3_SYMBOLS,
    ),
    Variant(
        "phi3-longrope",
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 16,
                "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
            },
            original_max_position_embeddings=16,
            tie_word_embeddings=False,
        ),
        "spm",
        None,
        True,
        [
            "LongRoPE: long factors (the sequence and n_ctx exceed original_max_position_embeddings"
            " 16), attention factor sqrt(1 + ln(128/16) / ln(16))",
            "partial rotary (16 of 32 dims)",
        ],
        {
            "longrope": {
                "rope_parameters": _rope(partial_rotary_factor=0.5),
                "original_max_position_embeddings": 128,
            }
        },
        spm_symbols=PHI3_SYMBOLS,
    ),
    Variant(
        "lfm2",
        "Lfm2ForCausalLM",
        "Lfm2Config",
        dict(
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
            norm_eps=1e-5,
            rope_parameters=_rope(rope_theta=1000000.0),
            tie_word_embeddings=True,
        ),
        "bpe",
        "lfm2",
        True,
        [
            "double-gated short convolution (L 3) on layers 0 and 2: a recurrent state",
            "attention with per-head q/k RMSNorm on layers 1 and 3",
            "output norm stored as token_embd_norm",
            "tied output",
        ],
    ),
    Variant(
        "lfm2moe",
        "Lfm2MoeForCausalLM",
        "Lfm2MoeConfig",
        dict(
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3,
            norm_eps=1e-5,
            num_dense_layers=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            use_expert_bias=True,
            rope_parameters=_rope(rope_theta=1000000.0),
            tie_word_embeddings=True,
        ),
        "bpe",
        "lfm2",
        True,
        [
            "LFM2's short convolution on layers 0 and 2, attention on 1 and 3",
            "a dense FFN on layer 0, then 8 experts (top 2) on layers 1-3",
            "sigmoid router probabilities; experts picked by probability + expert bias",
        ],
    ),
    Variant(
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        dict(
            rope_parameters=_rope(),
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            logits_scaling=2.0,
            tie_word_embeddings=True,
        ),
        "bpe",
        "refact",
        False,
        [
            "embedding_multiplier 3",
            "residual_multiplier 0.5",
            "attention_multiplier 0.25 (instead of 1/sqrt(32))",
            "logits divided by logits_scaling 2",
        ],
        {
            "embedding_multiplier": {"embedding_multiplier": 1.0},
            "residual_multiplier": {"residual_multiplier": 1.0},
            "attention_multiplier": {"attention_multiplier": 32**-0.5},
        },
    ),
    Variant(
        "olmo2",
        "Olmo2ForCausalLM",
        "Olmo2Config",
        dict(rope_parameters=_rope(), tie_word_embeddings=False),
        "bpe",
        "dbrx",
        False,
        [
            "RMSNorm after attention and after the FFN (no pre-norms)",
            "q/k RMSNorm over the whole projection",
            "untied output",
        ],
    ),
    Variant(
        "smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        dict(
            rope_parameters=_rope(),
            no_rope_layer_interval=4,
            use_sliding_window=False,
            tie_word_embeddings=True,
        ),
        "bpe",
        "llama-bpe",
        False,
        ["no RoPE on every 4th layer (layer 3)", "tied output"],
        {"no-rope layers": {"no_rope_layers": [1, 1, 1, 1]}},
    ),
    Variant(
        "glm4",
        "Glm4ForCausalLM",
        "Glm4Config",
        dict(
            head_dim=32,
            rope_parameters=_rope(partial_rotary_factor=0.5),
            attention_bias=True,
            tie_word_embeddings=False,
        ),
        "bpe",
        "glm4",
        False,
        [
            "partial rotary (16 of 32 dims), interleaved pairs",
            "q/k/v biases",
            "post-attention and post-FFN RMSNorm",
            "fused gate_up",
            "untied output",
        ],
        {"partial rotary": {"rope_parameters": _rope(partial_rotary_factor=1.0)}},
    ),
    Variant(
        "exaone4",
        "Exaone4ForCausalLM",
        "Exaone4Config",
        dict(
            rope_parameters=_rope(),
            sliding_window=None,
            layer_types=["full_attention"] * 4,
            tie_word_embeddings=False,
        ),
        "bpe",
        "exaone4",
        False,
        [
            "global attention with RoPE on every layer (EXAONE-4.0-1.2B's form)",
            "q/k RMSNorm per head",
            "post-attention and post-FFN RMSNorm (no pre-norms)",
            "untied output",
        ],
    ),
    Variant(
        "exaone4-swa",
        "Exaone4ForCausalLM",
        "Exaone4Config",
        dict(
            rope_parameters=_rope(),
            sliding_window=8,
            sliding_window_pattern=4,
            tie_word_embeddings=False,
        ),
        "bpe",
        "exaone4",
        False,
        [
            "sliding window 8 on layers 0-2, global layer 3 without RoPE",
            "q/k RMSNorm per head",
            "post-attention and post-FFN RMSNorm (no pre-norms)",
            "untied output",
        ],
        {"sliding window": {"sliding_window": 4096}},
        llama_cpp_differs=(
            "llama.cpp's exaone4 turns sliding-window attention on only for 64-layer models"
            " (EXAONE-4.0-32B), whatever the GGUF's sliding_window_pattern says; at 4 layers it"
            " runs every layer global with RoPE"
        ),
    ),
    Variant(
        "cohere2",
        "Cohere2ForCausalLM",
        "Cohere2Config",
        dict(
            rope_parameters=_rope(),
            sliding_window=8,
            logit_scale=0.5,
            rotary_pct=1.0,  # not a transformers field; llama.cpp's converter reads it
            tie_word_embeddings=True,
        ),
        "bpe",
        "command-r",
        True,
        [
            "sliding window 8 on layers 0-2 (with RoPE), global layer 3 without RoPE",
            "parallel attention + FFN from one LayerNorm (no bias)",
            "logit_scale 0.5",
            "interleaved rope pairs",
            "tied output",
        ],
        {"sliding window": {"sliding_window": 4096}, "logit_scale": {"logit_scale": 1.0}},
    ),
    Variant(
        "qwen3moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            rope_parameters=_rope(rope_theta=1000000.0),
            tie_word_embeddings=False,
        ),
        "bpe",
        "qwen2",
        False,
        [
            "mixture of experts: 8 experts of width 64, top-2 per token on every layer",
            "top-k weights renormalised (norm_topk_prob)",
            "per-head q/k RMSNorm",
            "untied output",
        ],
        {"norm_topk_prob": {"norm_topk_prob": False}},
    ),
    Variant(
        "qwen3moe-q4k",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            hidden_size=256,
            head_dim=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            initializer_range=0.1,
            rope_parameters=_rope(rope_theta=1000000.0),
            tie_word_embeddings=False,
        ),
        "bpe",
        "qwen2",
        False,
        [
            "mixture of experts: 8 experts of width 256, top-2 per token",
            "Q4_K experts (rows of 256: K-quant super-blocks), llama.cpp's Q4_K_M mix",
        ],
        outtypes=(),
        quantized=("q4_k_m",),
    ),
    Variant(
        "qwen2moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            rope_parameters=_rope(rope_theta=1000000.0),
            tie_word_embeddings=False,
        ),
        "bpe",
        "qwen2",
        False,
        [
            "mixture of experts: 8 experts of width 64, top-2 per token, weights not renormalised",
            "shared expert of width 96 scaled by sigmoid(shared_expert_gate x)",
            "q/k/v biases",
            "untied output",
        ],
    ),
    Variant(
        "mistral3",
        "Ministral3ForCausalLM",
        "Ministral3Config",
        dict(
            head_dim=32,
            max_position_embeddings=64,  # YaRN's factor 4 = 64 / 16
            rope_parameters=_MISTRAL3_ROPE,
            tie_word_embeddings=False,
        ),
        "bpe",
        "tekken",
        True,
        [
            "YaRN rope (factor 4, original context 16)",
            "llama 4 attention temperature: q * (1 + 0.1 * ln(1 + floor(pos / 16)))",
            "untied output",
        ],
        {
            "yarn": {
                "rope_parameters": _rope(
                    original_max_position_embeddings=16, llama_4_scaling_beta=0.1
                )
            },
            "llama 4 temperature": {"rope_parameters": _MISTRAL3_ROPE_NO_BETA},
        },
    ),
    Variant(
        "gemma4",
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        dict(
            num_hidden_layers=5,
            head_dim=32,
            global_head_dim=64,
            sliding_window=8,
            # llama.cpp's KV reuse takes the last unshared layer for full layers and the one
            # before it for sliding ones (as Gemma 4's real files have them)
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input="vocab",  # the tokenizer's size (_build)
            final_logit_softcapping=5.0,
            rope_parameters=_GEMMA4_ROPE,
            tie_word_embeddings=True,
        ),
        "gemma4",
        None,
        True,
        [
            "per-layer embeddings (PLE, 16 per layer): token rows + projection, gated injection",
            "KV shared: layers 3 (sliding) and 4 (full) reuse layers 1 and 2",
            "head_dim 32 on sliding layers, 64 on full layers",
            "proportional RoPE (a quarter of the pairs) on full layers, theta 1e6",
            "double-wide FFN on the KV-shared layers",
            "v norm, q/k norms, attention scale 1, layer scalars",
            "sliding window 8, final logit softcap 5",
        ],
        {
            "sliding window": {"sliding_window": 4096},
            "final softcap": {"final_logit_softcapping": None},
        },
        llama_cpp_differs=(
            "llama.cpp's ggml_gelu (the per-layer embedding gate's GELU) rounds its input to "
            "float16 for a table lookup (GGML_GELU_FP16): its f32 file lands at ~1.2e-3 of "
            "the spread, above the 1e-3 it is held to"
        ),
    ),
    Variant(
        "gemma4-moe",
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            global_head_dim=64,
            sliding_window=8,
            # transformers makes the last layer full attention
            layer_types=["sliding_attention", "full_attention", "full_attention"],
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=48,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=5.0,
            rope_parameters=_GEMMA4_ROPE,
            tie_word_embeddings=True,
        ),
        "gemma4",
        None,
        True,
        [
            "mixture of experts beside the dense MLP on every layer (Gemma 4 26B-A4B's "
            "block): 8 experts of width 48, top-2, weights renormalised then scaled per "
            "expert",
            "router on RMSNorm(h) * scale / sqrt(d); experts on their own pre-norm; the "
            "MLP's and the experts' outputs post-normed apart, summed, post-normed",
            "head_dim 32 on sliding layers, 64 on full layers; sliding window 8",
        ],
        {"sliding window": {"sliding_window": 4096}, "experts": {"enable_moe_block": False}},
    ),
    Variant(
        "gemma3n",
        "Gemma3nForCausalLM",
        "Gemma3nTextConfig",
        dict(
            num_hidden_layers=6,
            head_dim=32,
            sliding_window=8,
            # KV shared on the last two layers: 4 (sliding) reads layer 3's, 5 (full) layer 2's
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            num_kv_shared_layers=2,
            altup_num_inputs=4,  # the only count llama.cpp's converter takes
            altup_active_idx=0,
            laurel_rank=16,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input="vocab",  # the tokenizer's size (_build)
            activation_sparsity_pattern=[0.95, 0.8, 0.0, 0.0, 0.0, 0.0],
            final_logit_softcapping=5.0,
            rope_parameters={
                "sliding_attention": _rope(),
                "full_attention": _rope(rope_theta=1000000.0),
            },
            tie_word_embeddings=True,
        ),
        "spm",
        None,
        True,
        [
            "AltUp: 4 streams (the embedding projected to 3 more, magnitudes matched), "
            "predicted and corrected per layer through tanh router modalities, the active "
            "stream 0 through the layer, merged back through the unembedding projections",
            "Laurel low-rank (16) residual beside attention, (attn + laurel) / sqrt(2)",
            "per-layer embeddings (16 per layer) gated by the corrected active stream, added "
            "to the other streams (scaled by altup_correct_scale)",
            "activation sparsity (gaussian top-k) on layers 0 (0.95) and 1 (0.8)",
            "KV shared: layers 4 (sliding) and 5 (full) reuse layers 3 and 2",
            "v norm, q/k norms, attention scale 1; sliding window 8; final logit softcap 5",
        ],
        {
            "sliding window": {"sliding_window": 4096},
            # Gemma3nTextConfig takes no None: a cap far above the logits is none
            "final softcap": {"final_logit_softcapping": 1e6},
            "activation sparsity": {"activation_sparsity_pattern": [0.0] * 6},
            "altup correct scale": {"altup_correct_scale": False},
        },
        llama_cpp_differs=(
            "llama.cpp's gemma3n graph fixes E2B / E4B's layout rather than reading the "
            "file's: KV shared from layer 20 on, activation sparsity on the first 10 layers "
            "at 0.95 (whatever activation_sparsity_scale says), laurel rank 64 and 256 "
            "per-layer values; this 6-layer model has none of those, and llama.cpp refuses "
            "to load it (per_layer_token_embd: expected 256 values per layer, found 16)"
        ),
        llama_cpp_loads=False,
    ),
    Variant(
        "qwen35",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        dict(
            head_dim=32,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            rope_parameters=_rope(
                rope_theta=1000000.0,
                partial_rotary_factor=0.5,
                mrope_section=[3, 3, 2],
                mrope_interleaved=True,
            ),
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            tie_word_embeddings=False,
        ),
        "bpe",
        "qwen35",
        False,
        [
            "gated DeltaNet layers 0 and 2 (conv1d, recurrent state, gated RMSNorm)",
            "4 value heads over 2 key heads (V heads reordered by the converter)",
            "full attention layers 1 and 3 with the output gate and per-head q/k norm",
            "partial multi-section RoPE (16 of 32 dims, text positions)",
            "untied output",
        ],
        convert_args=("--no-mtp",),
    ),
    Variant(
        "qwen35moe",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        dict(
            head_dim=32,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            rope_parameters=_rope(
                rope_theta=1000000.0,
                partial_rotary_factor=0.5,
                mrope_section=[3, 3, 2],
                mrope_interleaved=True,
            ),
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            tie_word_embeddings=False,
        ),
        "bpe",
        "qwen35",
        False,
        [
            "gated DeltaNet layers 0 and 2, full attention layers 1 and 3 (as qwen35)",
            "mixture of experts on every layer: top 2 of 8, renormalised",
            "a shared expert behind a sigmoid gate",
            "untied output",
        ],
        convert_args=("--no-mtp",),
    ),
    Variant(
        "granitehybrid",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        dict(
            _GRANITEHYBRID, num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=128
        ),
        "bpe",
        "refact",
        False,
        [*_GRANITEHYBRID_FEATURES, "dense SwiGLU FFN (shared_mlp)"],
        hub_config=_GRANITEHYBRID_HUB,
    ),
    Variant(
        "granitehybrid-moe",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        dict(
            _GRANITEHYBRID,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=64,
        ),
        "bpe",
        "refact",
        False,
        [
            *_GRANITEHYBRID_FEATURES,
            "8 experts (top 2, softmax over the picked) plus a shared expert on every layer",
        ],
        hub_config=_GRANITEHYBRID_HUB,
    ),
]


# ---------------------------------------------------------------------------------------------
# tokenizers


def _train_bpe(folder: Path, add_bos: bool) -> None:
    """A byte-level BPE (~384 ids) saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.splitlines() * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def _train_gemma4(folder: Path, add_bos: bool) -> None:
    """A Gemma 4-style tokenizer.json: BPE over UTF-8 characters with spaces as "▁" (no
    pre-split), byte fallback to the <0xNN> tokens, ids: specials, bytes, learnt pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False)
    tok.train_from_iterator(TEXT.splitlines() * 20, trainer)
    learnt = json.loads(tok.to_str())["model"]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {t: i for i, t in enumerate(GEMMA4_SPECIALS + bytes_)}
    for t in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [m if isinstance(m, str) else " ".join(m) for m in learnt["merges"]]
    full = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], byte_fallback=True)
    )
    full.normalizer = normalizers.Replace(" ", "\u2581")
    full.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    from tokenizers import AddedToken

    full.add_special_tokens([AddedToken(t, special=True) for t in GEMMA4_SPECIALS])
    full.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _train_spm(folder: Path, add_bos: bool, symbols: tuple[str, ...]) -> None:
    """A SentencePiece BPE (384 ids, byte fallback) saved as tokenizer.model."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines() * 20),
        model_writer=buf,
        vocab_size=384,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
        user_defined_symbols=list(symbols),
    )
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    cfg = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": add_bos, "add_eos_token": False}
    cfg.update(bos_token="<s>", eos_token="</s>")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _tokenize(folder: Path, kind: str) -> tuple[list[int], int, int, int]:
    """(ids of TEXT without specials, vocab size, bos id, eos id) of the tokenizer in folder."""
    if kind == "spm":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        return sp.encode(TEXT), sp.get_piece_size(), sp.bos_id(), sp.eos_id()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tok.token_to_id("<bos>" if kind == "gemma4" else "<|begin_of_text|>")
    eos = tok.token_to_id("<eos>" if kind == "gemma4" else "<|endoftext|>")
    return tok.encode(TEXT, add_special_tokens=False).ids, tok.get_vocab_size(), bos, eos


# ---------------------------------------------------------------------------------------------
# model, reference logits, conversion, check


def _build(variant: Variant, vocab: int, bos: int, eos: int, overrides: dict | None = None):
    import torch
    import transformers

    kw = {**BASE, **copy.deepcopy(variant.config), **(overrides or {})}
    kw.update(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    kw.update({k: vocab for k, v in kw.items() if v == "vocab"})
    cfg = getattr(transformers, variant.config_class)(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    return getattr(transformers, variant.model_class)(cfg).float().eval()


def _perturb(model) -> None:
    """Non-trivial norms and biases, so that a wrong mapping of either shows in the logits."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            if name.endswith("expert_bias"):  # LFM2-MoE's routing bias (zeros at init)
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
        for name, p in model.named_parameters():
            # Mamba-2's per-head decay and skip (log(1..heads) and ones at init)
            if name.endswith(("mamba.A_log", "mamba.D")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, p in model.named_parameters():
            # Gemma 4's router input gain and per-expert scales (ones at init)
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            # Gemma 3n's scale of the corrected active stream (zeros at init: it would
            # silence the per-layer embeddings)
            if name.endswith("altup.correct_output_scale"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


def _logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _margin(logits: np.ndarray) -> np.ndarray:
    """Top-two gap of each row of logits, as a fraction of the row's max - min."""
    top = np.sort(logits, axis=-1)
    return (top[..., -1] - top[..., -2]) / (top[..., -1] - top[..., 0])


def _decided_ids(model, first: list[int], pool: list[int]) -> list[int]:
    """N_TOKENS ids from first, each next id drawn (seeded) from the text's ids so that the
    logits after it have a clear winner (a top-two gap of MIN_MARGIN of the spread, or the
    widest of the candidates): random models' logits are flat, and a near-tie would let
    any rounding swap the argmax. The tests then check argmax at nearly every position."""
    import torch

    rng = np.random.default_rng(SEED)
    ids = list(first)
    while len(ids) < N_TOKENS:
        cands = rng.permutation(pool)[:CANDIDATES]
        with torch.no_grad():
            batch = torch.tensor([ids + [int(c)] for c in cands])
            last = model(batch).logits[:, -1].float().numpy()
        margin = _margin(last)
        good = np.flatnonzero(margin >= MIN_MARGIN)
        ids.append(int(cands[good[0] if good.size else int(margin.argmax())]))
    return ids


_CONVERT = """
import sys, runpy
from conversion import base
pre = {pre!r}
if pre is not None:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def _convert(
    llama_cpp: Path,
    hf_dir: Path,
    outtype: str,
    out: Path,
    pre: str | None,
    extra: tuple[str, ...] = (),
) -> None:
    code = _CONVERT.format(
        pre=pre,
        args=[str(hf_dir), "--outtype", outtype, "--outfile", str(out), *extra],
        script=str(llama_cpp / "convert_hf_to_gguf.py"),
    )
    env = dict(os.environ, PYTHONPATH=f"{llama_cpp / 'gguf-py'}{os.pathsep}{llama_cpp}")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert {hf_dir} -> {outtype} failed:\n{done.stderr[-4000:]}")


def _llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        logits_all=True,
        n_ctx=64,
        n_batch=64,
        n_threads=2,
        type_k=0,  # float32 KV cache: the default f16 cache alone costs ~2e-3 of the spread
        type_v=0,
        flash_attn=False,
        verbose=False,
    )
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


_QUANT_FTYPES = {"q4_k_m": 15, "q4_k_s": 14}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_K_M, _S


def _quantize(src: Path, dst: Path, qtype: str) -> None:
    """llama.cpp's own quantization of a GGUF (llama_model_quantize, as llama-quantize)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _QUANT_FTYPES[qtype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {qtype} failed ({rc})")


def make(variant: Variant, llama_cpp: Path, check: bool) -> dict:
    folder = HERE / variant.name
    folder.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / variant.name
        hf_dir.mkdir()
        if variant.tokenizer == "spm":
            _train_spm(hf_dir, variant.add_bos, variant.spm_symbols)
        elif variant.tokenizer == "gemma4":
            _train_gemma4(hf_dir, variant.add_bos)
        else:
            _train_bpe(hf_dir, variant.add_bos)
        text_ids, vocab, bos, eos = _tokenize(hf_dir, variant.tokenizer)
        model = _build(variant, vocab, bos, eos)
        _perturb(model)
        first = [bos] if variant.add_bos else text_ids[:1]
        ids = _decided_ids(model, first, sorted(set(text_ids)))
        ref = _logits(model, ids)
        spread = ref.max(-1) - ref.min(-1)

        effects = {}
        for feature, overrides in variant.ablations.items():
            other = _build(variant, vocab, bos, eos, overrides)
            # an ablation that removes a block (Gemma 4's experts) leaves its weights over
            missing, _ = other.load_state_dict(model.state_dict(), strict=False)
            if missing:
                raise RuntimeError(f"{variant.name}: ablation {feature!r} lacks {missing}")
            effects[feature] = float((np.abs(_logits(other, ids) - ref).max(-1) / spread).max())

        model.save_pretrained(hf_dir, safe_serialization=True)
        if variant.hub_config:
            saved = json.loads((hf_dir / "config.json").read_text())
            (hf_dir / "config.json").write_text(json.dumps({**saved, **variant.hub_config}))
        for outtype in OUTTYPES:
            out = folder if outtype in variant.outtypes else Path(tmp)
            _convert(
                llama_cpp,
                hf_dir,
                outtype,
                out / f"{outtype}.gguf",
                variant.pre,
                variant.convert_args,
            )
        extra = {}
        for qtype in variant.quantized:
            f32 = (folder if "f32" in variant.outtypes else Path(tmp)) / "f32.gguf"
            _quantize(f32, folder / f"{qtype}.gguf", qtype)
            extra[f"llama_cpp_{qtype}"] = _llama_cpp_logits(folder / f"{qtype}.gguf", ids)

        margin = _margin(ref)
        info = {
            "variant": variant.name,
            "transformers_class": variant.model_class,
            "features": variant.features,
            "tokenizer": variant.tokenizer,
            "tokenizer_ggml_pre": variant.pre or "default",
            "add_bos": variant.add_bos,
            "n_tokens": len(ids),
            "vocab_size": vocab,
            "spread": "per position: max - min of the reference logits",
            "min_top2_margin_over_spread": float(margin.min()),
            "feature_effect_max_diff_over_spread": effects,
            "config": json.loads(model.config.to_json_string()),
        }
        for feature, effect in effects.items():
            if effect < 1e-2:
                raise AssertionError(f"{variant.name}: {feature} moves the logits {effect:.2e}")
        for qtype in variant.quantized:
            got = extra[f"llama_cpp_{qtype}"]
            err = np.abs(got - ref).max(-1) / spread
            info.setdefault("llama_cpp_quantized_vs_transformers", {})[qtype] = {
                "max_abs_diff": float(np.abs(got - ref).max()),
                "max_diff_over_spread": float(err.max()),
                "mean_diff_over_spread": float(err.mean()),
                "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
            }
        if check and variant.outtypes and variant.llama_cpp_loads:
            errors = {}
            for outtype in variant.outtypes:
                got = _llama_cpp_logits(folder / f"{outtype}.gguf", ids)
                err = np.abs(got - ref).max(-1) / spread
                errors[outtype] = {
                    "max_abs_diff": float(np.abs(got - ref).max()),
                    "max_diff_over_spread": float(err.max()),
                    "mean_diff_over_spread": float(err.mean()),
                    "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                }
            if variant.llama_cpp_differs:
                info["llama_cpp_vs_transformers_not_comparable"] = errors
            else:
                info["llama_cpp_vs_transformers"] = errors
                if errors["f32"]["max_diff_over_spread"] > 1e-3:
                    raise AssertionError(f"{variant.name}: llama.cpp disagrees: {errors['f32']}")
        if variant.llama_cpp_differs:  # with or without the check: the tests' q8_0 bound
            info["llama_cpp_differs"] = variant.llama_cpp_differs
        first_file = (variant.outtypes or variant.quantized)[0]
        info["arch"] = _gguf_arch(folder / f"{first_file}.gguf", llama_cpp)
    np.savez_compressed(
        folder / "reference.npz",
        ids=np.asarray(ids, np.int32),
        logits=ref.astype(np.float32),
        **{k: v.astype(np.float32) for k, v in extra.items()},
    )
    (folder / "reference.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def _gguf_arch(path: Path, llama_cpp: Path) -> str:
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    field_ = gguf.GGUFReader(path).get_field("general.architecture")
    return field_.contents()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="variant names (default: all)")
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    parser.add_argument("--no-check", action="store_true", help="skip llama.cpp's own check")
    args = parser.parse_args()
    names = args.variants or [v.name for v in VARIANTS]
    known = {v.name: v for v in VARIANTS}
    for name in names:
        if name not in known:
            parser.error(f"unknown variant {name!r}; known: {', '.join(known)}")
    for name in names:
        info = make(known[name], args.llama_cpp, not args.no_check)
        size = sum(p.stat().st_size for p in (HERE / name).iterdir()) / 1e6
        print(f"{name} ({info['arch']}): {size:.2f} MB", flush=True)
        print(f"  feature effects: {info['feature_effect_max_diff_over_spread']}", flush=True)
        for outtype, err in info.get("llama_cpp_vs_transformers", {}).items():
            print(f"  llama.cpp {outtype}: {err}", flush=True)


if __name__ == "__main__":
    main()
