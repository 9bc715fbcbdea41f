"""Every ModelSpec switch, on a tiny random model: the one layer definition (layer.py)
gives the same logits and KV rows through the general path (prompt and batched decode)
and through the bound decode step, bit for bit, and the switch changes the output."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgerun.arch.gemma4 import PER_LAYER_TENSORS, PLE_TENSORS
from edgerun.arch.spec import GLOBAL_TENSORS, LAYER_TENSORS, ModelSpec
from edgerun.errors import UnsupportedError
from edgerun.model.decode_step import DecodeStep
from edgerun.model.kvcache import KVCache
from edgerun.model.transformer import Transformer
from edgerun.model.weights import ResidentStore
from edgerun.quant.quantize import quantize_tensor

D, HEADS, KV_HEADS, HD, FF, VOCAB, LAYERS = 64, 4, 2, 16, 128, 160, 3

BASE = ModelSpec(
    arch="llama",
    name="tiny",
    n_layers=LAYERS,
    d_model=D,
    d_ff=FF,
    n_heads=HEADS,
    n_kv_heads=KV_HEADS,
    head_dim=HD,
    vocab_size=VOCAB,
    context_length=64,
    norm_eps=1e-5,
    rope_base=10000.0,
    rope_dim=HD,
)

SWITCHES = {
    "plain": {},
    "attn_bias": {"attn_bias": True},
    "qk_norm": {"qk_norm": True},
    "post_norms": {"post_norms": True},
    "windows": {"layer_windows": (4, 0, 4)},
    "rope_bases": {"layer_rope_bases": (10000.0, 1e6, 10000.0)},
    "neox": {"rope_style": "neox"},
    "gelu": {"activation": "gelu_tanh"},
    "embed_scale": {"embed_scale": 8.0},
    "softcap": {"final_logit_softcap": 3.0},
    "nope": {"layer_nope": (False, True, True)},
    "no_pre_norms": {"pre_norms": False},
    "qk_norm_full": {"qk_norm": True, "qk_norm_full": True},
    "attention_scale": {"attention_scale": 0.05},
    "residual_scale": {"residual_scale": 0.5},
    "logit_scale": {"logit_scale": 4.0},
    "rope_scale": {"rope_scale": 0.25},
    # optional tensors a file may carry whatever its spec says (EXTRA_TENSORS)
    "rope_freqs": {},
    "output_bias": {},
    "optional_qkv_bias": {},
    "attn_softcap": {"attn_softcap": 1.0},
    "partial_rope": {"rope_dim": 8},
    "longrope": {"rope_orig_context": 16, "rope_attn_factor": 1.25},
    "layer_norm": {"norm_kind": "layer"},
    "parallel_blocks": {"parallel_blocks": True},
    "yarn": {"rope_scale": 0.25, "yarn_orig_context": 8, "rope_attn_factor": 1.1},
    # floor 4: the prompts' and steps' positions (0..20) take five temperatures
    "attn_temperature": {"attn_temp_scale": 0.5, "attn_temp_floor": 4},
    # a hybrid: short-convolution layers (a recurrent state per sequence) around attention
    "shortconv": {"layer_mixers": ("shortconv", "attention", "shortconv"), "shortconv_l_cache": 3},
    # Qwen3.5: gated DeltaNet layers (conv and matrix states; 2 key heads over 4 value
    # heads) around an attention layer whose q projection carries an output gate
    "deltanet": {
        "layer_mixers": ("deltanet", "attention", "deltanet"),
        "ssm_conv_kernel": 4,
        "ssm_head_dim": 16,
        "ssm_k_heads": 2,
        "ssm_v_heads": 4,
    },
    "attn_output_gate": {"attn_output_gate": True},
    # Granite 4.0 H: Mamba-2 layers (conv and per-head states; 4 heads of 16 over 2
    # groups of B and C of state 16) around an attention layer
    "mamba2": {
        "layer_mixers": ("mamba2", "attention", "mamba2"),
        "ssm_conv_kernel": 4,
        "mamba_heads": 4,
        "mamba_head_dim": 16,
        "mamba_state": 16,
        "mamba_groups": 2,
    },
}

# switches that are tensors in the file rather than spec fields
EXTRA_TENSORS = {
    "rope_freqs": {"rope_freqs"},
    "output_bias": {"attn_output_bias"},
    "optional_qkv_bias": {"attn_q_bias", "attn_v_bias"},  # k's is missing: zeros
}
OPTIONAL_ROLES = {"attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias", "rope_freqs"}


class _Reader:
    """Tensors of a random model in memory, as a file reader hands them out."""

    def __init__(self, spec: ModelSpec, seed: int = 0, extra: frozenset = frozenset()) -> None:
        rng = np.random.default_rng(seed)
        s = spec
        qn, kn = (s.q_dim, s.kv_dim) if s.qk_norm_full else (s.head_dim, s.head_dim)
        mats = {"token_embd": (s.vocab_size, s.d_model), "output": (s.vocab_size, s.d_model)}
        vecs = {"output_norm": s.d_model}
        factors = {"rope_factors_short": s.rope_dim // 2, "rope_factors_long": s.rope_dim // 2}
        roles = {
            "attn_q": (s.q_dim * (2 if s.attn_output_gate else 1), s.d_model),
            "attn_k": (s.kv_dim, s.d_model),
            "attn_v": (s.kv_dim, s.d_model),
            "attn_output": (s.d_model, s.q_dim),
            "ffn_gate": (s.d_ff, s.d_model),
            "ffn_up": (s.d_ff, s.d_model),
            "ffn_down": (s.d_model, s.d_ff),
        }
        layer_vecs = {
            "attn_norm": s.d_model,
            "ffn_norm": s.d_model,
            "attn_q_bias": s.q_dim,
            "attn_k_bias": s.kv_dim,
            "attn_v_bias": s.kv_dim,
            "attn_q_norm": qn,
            "attn_k_norm": kn,
            "post_attention_norm": s.d_model,
            "post_ffw_norm": s.d_model,
            "attn_output_bias": s.d_model,
        }
        # a file carries the optional tensors only where the switch (or spec) has them
        wanted = set(extra) | (
            {"attn_q_bias", "attn_k_bias", "attn_v_bias"} if s.attn_bias else set()
        )
        layer_vecs = {r: n for r, n in layer_vecs.items() if r not in OPTIONAL_ROLES or r in wanted}
        self._t = {}
        for role, shape in mats.items():
            name = s.global_tensors[role]
            self._t[name] = quantize_tensor(name, rng.normal(0, 0.5, shape), "q8_0")
        for role, n in vecs.items():
            name = s.global_tensors[role]
            self._t[name] = quantize_tensor(name, rng.uniform(0.5, 1.5, n), "f32")
        for role, n in factors.items():  # LongRoPE's, read when the spec asks for them
            name = s.global_tensors[role]
            self._t[name] = quantize_tensor(name, rng.uniform(1.0, 8.0, n), "f32")
        if "rope_freqs" in wanted:  # Llama 3-like divisors: 1 (fast) .. 32 (slow)
            f = np.geomspace(1.0, 32.0, s.rope_dim // 2)
            self._t["rope_freqs.weight"] = quantize_tensor("rope_freqs.weight", f, "f32")
        # without pre-norms nothing rescales a layer's input, so the residual stream grows
        # by the weights' gain each layer: smaller weights keep it within f16 caches' range
        sd = 0.2 if s.pre_norms else 0.05
        for i in range(s.n_layers):
            for role, shape in _layer_shapes(s, i, roles, layer_vecs).items():
                name = s.layer_tensor(role, i)
                if isinstance(shape, tuple):
                    self._t[name] = quantize_tensor(name, rng.normal(0, sd, shape), "q8_0")
                else:
                    self._t[name] = quantize_tensor(name, rng.uniform(0.5, 1.5, shape), "f32")
            if s.mixer(i) == "shortconv":  # its mixer's tensors (the attention's go unread)
                d, width = s.d_model, s.shortconv_l_cache
                for role, shape, qtype in (
                    ("shortconv_in_proj", (3 * d, d), "q8_0"),
                    ("shortconv_out_proj", (d, d), "q8_0"),
                    ("shortconv_conv", (d, width), "f32"),
                ):
                    name = s.layer_tensor(role, i)
                    self._t[name] = quantize_tensor(name, rng.normal(0, sd, shape), qtype)
            if s.mixer(i) == "deltanet":
                self._deltanet(s, i, rng, sd)
            if s.mixer(i) == "mamba2":
                self._mamba2(s, i, rng, sd)
        if s.per_layer_input:  # Gemma 4's per-layer embeddings
            w = s.per_layer_input * s.n_layers
            for role, shape in (("ple_token_embd", (s.vocab_size, w)),
                                ("ple_model_proj", (w, s.d_model))):  # fmt: skip
                name = s.global_tensors[role]
                self._t[name] = quantize_tensor(name, rng.normal(0, 0.5, shape), "q8_0")
            name = s.global_tensors["ple_proj_norm"]
            self._t[name] = quantize_tensor(name, rng.uniform(0.5, 1.5, s.per_layer_input), "f32")

    def _deltanet(self, s: ModelSpec, i: int, rng, sd: float) -> None:
        """A gated DeltaNet layer's tensors (the attention's go unread)."""
        dk, hk, hv, d = s.ssm_head_dim, s.ssm_k_heads, s.ssm_v_heads, s.d_model
        channels = (2 * hk + hv) * dk
        for role, shape, qtype in (
            ("ssm_qkv", (channels, d), "q8_0"),
            ("ssm_gate", (hv * dk, d), "q8_0"),
            ("ssm_beta", (hv, d), "q8_0"),
            ("ssm_alpha", (hv, d), "q8_0"),
            ("ssm_out", (d, hv * dk), "q8_0"),
            ("ssm_conv1d", (channels, s.ssm_conv_kernel), "f32"),
        ):
            name = s.layer_tensor(role, i)
            self._t[name] = quantize_tensor(name, rng.normal(0, sd, shape), qtype)
        for role, values in (
            ("ssm_dt_bias", rng.normal(0, 1, hv)),
            ("ssm_a", -np.exp(rng.normal(0, 1, hv))),
            ("ssm_norm", rng.uniform(0.5, 1.5, dk)),
        ):
            name = s.layer_tensor(role, i)
            self._t[name] = quantize_tensor(name, values, "f32")

    def _mamba2(self, s: ModelSpec, i: int, rng, sd: float) -> None:
        """A Mamba-2 layer's tensors (the attention's go unread)."""
        heads, inner, d = s.mamba_heads, s.mamba_heads * s.mamba_head_dim, s.d_model
        channels = inner + 2 * s.mamba_groups * s.mamba_state
        for role, shape, qtype in (
            ("ssm_in", (inner + channels + heads, d), "q8_0"),
            ("ssm_out", (d, inner), "q8_0"),
            ("ssm_conv1d", (channels, s.ssm_conv_kernel), "f32"),
        ):
            name = s.layer_tensor(role, i)
            self._t[name] = quantize_tensor(name, rng.normal(0, sd, shape), qtype)
        for role, values in (
            ("ssm_conv1d_bias", rng.normal(0, 0.1, channels)),
            ("ssm_dt_bias", rng.normal(0, 1, heads)),
            ("ssm_a", -np.exp(rng.normal(0, 1, heads))),
            ("ssm_d", rng.normal(1, 0.3, heads)),
            ("ssm_norm", rng.uniform(0.5, 1.5, inner)),
        ):
            name = s.layer_tensor(role, i)
            self._t[name] = quantize_tensor(name, values, "f32")

    def tensor(self, name: str):
        return self._t[name]

    def drop(self, names: set[str]) -> None:
        for name in names:
            del self._t[name]

    def tensor_names(self) -> list[str]:
        return list(self._t)


def _layer_shapes(s: ModelSpec, i: int, roles: dict, vecs: dict) -> dict:
    """Layer i's tensor shapes (matrices as tuples, vectors as sizes) at its own head dim,
    KV heads and FFN width (the spec-wide ones where layers do not differ), with Gemma 4's
    per-layer embedding parts and scalar where the spec has them and no k, v or k norm on
    a layer that shares another's KV."""
    hd, kvh, ff = s.head_dim_of(i), s.kv_heads_of(i), s.d_ff_of(i)
    q_dim, kv_dim = s.n_heads * hd, kvh * hd
    q_rows = q_dim * (2 if s.attn_output_gate else 1)  # each head's q, then its gate
    own = {"attn_q": q_rows, "attn_k": kv_dim, "attn_v": kv_dim, "ffn_gate": ff, "ffn_up": ff}
    out: dict = {r: (own.get(r, shape[0]), shape[1]) for r, shape in roles.items()}
    out["attn_output"] = (s.d_model, q_dim)
    out["ffn_down"] = (s.d_model, ff)
    sizes = {"attn_q_bias": q_dim, "attn_k_bias": kv_dim, "attn_v_bias": kv_dim}
    if s.layered and not s.qk_norm_full:
        sizes |= {"attn_q_norm": hd, "attn_k_norm": hd}
    out |= {r: sizes.get(r, n) for r, n in vecs.items()}
    if s.per_layer_input:
        out |= {"ple_gate": (s.per_layer_input, s.d_model),
                "ple_proj": (s.d_model, s.per_layer_input), "ple_post_norm": s.d_model}  # fmt: skip
    if s.layer_output_scale:
        out["layer_output_scale"] = 1
    if s.kv_source(i) != i:
        for r in ("attn_k", "attn_v", "attn_k_norm", "attn_k_bias", "attn_v_bias"):
            out.pop(r, None)
    return out


def _model(switch: str, head_dim: int = HD) -> Transformer:
    fields = {"head_dim": head_dim, "rope_dim": head_dim, **SWITCHES[switch]}
    spec = dataclasses.replace(BASE, **fields)
    reader = _Reader(spec, extra=frozenset(EXTRA_TENSORS.get(switch, ())))
    return Transformer(spec, ResidentStore(reader, "tiny"), "tiny")


PROMPTS = [[1, 5, 9, 13, 40, 77, 2, 3], [4, 8], [150, 1, 2, 3, 5]]
STEPS = [[7, 11, 19], [23, 42, 159], [0, 3, 5], [99, 98, 97]]


def _run(tr: Transformer, bound: bool, batched: bool, kv_type: str):
    """Prompts, then decode STEPS (batched: all sequences in one step; else one at a time)
    with the bound step on or off. Returns the logits of every step and the caches."""
    caches = [tr.new_cache(32, kv_type) for _ in PROMPTS]  # keys centred where quantised
    out = [tr.forward(p, c, all_logits=True) for p, c in zip(PROMPTS, caches)]
    for tokens in STEPS:
        if bound:
            tr._decode_step = None
        else:  # the general path
            tr._decode_step, tr._decode_key = False, tr._executors()
        if batched:
            out.append(tr.forward_batch(tokens, caches))
        else:
            out.append(np.stack([tr.forward([t], c) for t, c in zip(tokens, caches)]))
        assert isinstance(tr._decode_step, DecodeStep) is bound
    tr._decode_step = None
    return out, caches


# (KV type, head_dim): q8_0 / q4_0 rows are whole 32-value blocks, so those run at
# head_dim 64 (the decode and tiled prefill kernels) and 32 (the one-row kernel), keys
# and values of different types at 32.
KV_CASES = [("f32", HD), ("f16", HD), ("q8_0", 64), ("q4_0", 64), ("q8_0/f16", 32)]


@pytest.mark.parametrize("kv_type, head_dim", KV_CASES)
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_every_path_of_the_layer_is_bit_identical(switch, kv_type, head_dim):
    tr = _model(switch, head_dim)
    assert DecodeStep.supports(tr)
    ref_logits, ref_caches = _run(tr, bound=False, batched=False, kv_type=kv_type)
    for bound, batched in ((True, False), (False, True), (True, True)):
        logits, caches = _run(tr, bound, batched, kv_type)
        for a, b in zip(ref_logits, logits):
            assert np.array_equal(a, b), (switch, bound, batched)
        for a, b in zip(ref_caches, caches):
            assert a.tokens == b.tokens
            assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
            sa, sb = a.state.arrays(), b.state.arrays()
            assert sa.keys() == sb.keys()
            assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert all(np.isfinite(x).all() for x in ref_logits)


@pytest.mark.parametrize("switch", sorted(set(SWITCHES) - {"plain"}))
def test_each_switch_changes_the_output(switch):
    """A switch the layer ignored would pass the equality test above; its logits must
    differ from the plain model's on the same weights."""
    plain, _ = _run(_model("plain"), bound=True, batched=True, kv_type="f32")
    other, _ = _run(_model(switch), bound=True, batched=True, kv_type="f32")
    if switch == "windows":  # a window only matters past its width: the 8-token prompt
        assert not np.array_equal(plain[0][-1], other[0][-1])
    else:
        assert not np.array_equal(plain[-1], other[-1])


# Switches the bound decode step does not cover (Gemma 4's): the general path only, where
# a prompt, one-token steps and batched decode rows must still agree bit for bit.
G4_TENSORS = {**LAYER_TENSORS, **PER_LAYER_TENSORS}
G4_GLOBALS = {**GLOBAL_TENSORS, **PLE_TENSORS}
GENERAL_SWITCHES = {
    "v_norm": {"v_norm": True},
    "layer_output_scale": {"layer_output_scale": True, "layer_tensors": G4_TENSORS},
    "per_layer_input": {
        "per_layer_input": 32,
        "layer_tensors": G4_TENSORS,
        "global_tensors": G4_GLOBALS,
    },
    "layer_head_dims": {
        "head_dim": 32,
        "rope_dim": 32,
        "layer_head_dims": (16, 32, 16),
        "layer_rope_dims": (16, 32, 8),
        "qk_norm": True,
    },
    "layer_kv_heads": {"n_kv_heads": 4, "layer_kv_heads": (2, 4, 2)},
    "layer_d_ff": {"d_ff": 256, "layer_d_ff": (128, 256, 128)},
    "layer_kv_source": {"layer_kv_source": (0, 1, 1), "qk_norm": True},
}


def _general_model(switch: str) -> Transformer:
    spec = dataclasses.replace(BASE, **GENERAL_SWITCHES[switch])
    return Transformer(spec, ResidentStore(_Reader(spec), "tiny"), "tiny")


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("switch", sorted(GENERAL_SWITCHES))
def test_general_only_switches_agree_on_every_general_path(switch, kv_type):
    tr = _general_model(switch)
    assert not DecodeStep.supports(tr)
    ref_logits, ref_caches = _run(tr, bound=False, batched=False, kv_type=kv_type)
    logits, caches = _run(tr, bound=False, batched=True, kv_type=kv_type)
    for a, b in zip(ref_logits, logits):
        assert np.array_equal(a, b), switch
    for a, b in zip(ref_caches, caches):
        assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
    # a prompt's logits equal its tokens' one-token steps (up to the prompt kernels' sums)
    cache = KVCache(tr.spec, 32, kv_type)
    steps = np.stack([tr.forward([t], cache) for t in PROMPTS[0]])
    assert np.allclose(ref_logits[0], steps, rtol=0, atol=1e-3 * np.ptp(steps))
    assert all(np.isfinite(x).all() for x in ref_logits)


def test_a_layer_without_attn_v_takes_ks_projection_as_v():
    """Gemma 4's K = V attention: a file without attn_v on a layer (v-normed family) reads
    k's projection as v, as a file holding k's matrix under attn_v would."""
    spec = dataclasses.replace(BASE, v_norm=True, qk_norm=True)
    dropped, copied = _Reader(spec), _Reader(spec)
    dropped.drop({"blk.1.attn_v.weight"})
    copied._t["blk.1.attn_v.weight"] = copied._t["blk.1.attn_k.weight"]
    a, b = (Transformer(spec, ResidentStore(r, "tiny"), "tiny") for r in (dropped, copied))
    assert a.layers[1].v is a.layers[1].k
    la = a.forward(PROMPTS[0], KVCache(spec, 16, "f32"), all_logits=True)
    lb = b.forward(PROMPTS[0], KVCache(spec, 16, "f32"), all_logits=True)
    assert np.array_equal(la, lb)


def test_a_layer_head_dim_q8_0_rows_cannot_hold_is_refused():
    tr = _general_model("layer_head_dims")  # layers of head_dim 16 beside 32
    with pytest.raises(UnsupportedError, match="block size 32"):
        KVCache(tr.spec, 32, "q8_0")


@pytest.mark.parametrize(
    "switch", ["v_norm", "layer_output_scale", "per_layer_input", "layer_kv_source"]
)
def test_each_general_only_switch_changes_the_output(switch):
    """On the same weights (the per-layer shapes have no same-weights model without them:
    the equality test above covers them)."""
    fields = GENERAL_SWITCHES[switch]
    on_spec = dataclasses.replace(BASE, **fields)
    off_spec = dataclasses.replace(BASE, **{k: v for k, v in fields.items() if k == "qk_norm"})
    # the file of whichever spec reads more tensors; the other ignores the rest
    reader = _Reader(off_spec if switch == "layer_kv_source" else on_spec)
    on, off = (Transformer(s, ResidentStore(reader, "tiny"), "tiny") for s in (on_spec, off_spec))
    a = on.forward(PROMPTS[0], KVCache(on.spec, 16, "f32"), all_logits=True)
    b = off.forward(PROMPTS[0], KVCache(off.spec, 16, "f32"), all_logits=True)
    assert a.shape == b.shape and not np.allclose(a, b)


def test_the_program_is_the_layers_definition():
    """The general path and the bound step both come from Transformer.program."""
    tr = _model("post_norms")
    assert len(tr.program) == LAYERS
    kinds = [type(s).__name__ for s in tr.program[0]]
    assert kinds == ["Attention", "Residual", "FeedForward", "Residual"]
    # the last layer norms for the head, the others for the next layer
    assert tr.program[-1][-1].norm is tr.output_norm
    assert tr.program[0][-1].norm is tr.layers[1].attn_norm
