"""Write a synthetic `qwen3moe` GGUF at a Qwen3-30B-A3B layout (random weights, Q4_K).

No MoE weights are on PyPI, so the offload benchmark (benchmarks/moe_offload.py) runs on
this file: the real shapes of Qwen3-30B-A3B (d_model 2048, 128 experts, top-8, expert ff
768, 32 query / 4 KV heads of 128) with fewer layers, so the file is ~3.5 GB. The
tokenizer metadata is copied from the registry's Qwen2.5-Coder-0.5B GGUF, so prompts
tokenize as they would for a Qwen model and llama.cpp loads the file as well.

Why gguf-py's GGUFWriter and not a tiny HF model scaled up: the writer streams each
tensor to disk as it is made (a 3.5 GB model never sits in RAM) and needs no 3.5 GB
f32 checkpoint for the converter to read. The Q4_K blocks are real quantizations
(edgerun.quant.quantize) of Gaussian weights: a pool of quantized super-blocks is made
once and each tensor draws its blocks from it at random (quantizing 6e9 weights in numpy
would take hours; a tensor built of valid random blocks is what a quantized random
tensor is). Each tensor's scale is set by scaling the blocks' f16 d / dmin.

Routing: by default the router is Gaussian, so every expert is equally likely (the worst
case for an expert cache). `--zipf S` skews it: every token embedding carries a constant
`EMBED_CONST` in dimension 0 (the output projections are small, so the residual stream
keeps it through the layers), and router column 0 holds -S * ln(rank) / (that
dimension's normalised value), a per-expert logit bias that makes expert popularity
fall off as a power law of its rank (Zipf-like), as routers trained with little load
balancing show.

Usage:
  python benchmarks/make_moe_gguf.py [--out /work/models/qwen3moe-synth-q4k.gguf]
      [--layers 9] [--zipf 1.0] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

TOKENIZER_GGUF = Path.home() / ".cache/edgerun/models/qwen2.5-coder-0.5b-instruct.gguf"
EMBED_CONST = 6.0  # dimension 0 of every token embedding (the others ~ N(0, 1))
POOL_BLOCKS = 16384  # quantized Q4_K super-blocks each tensor draws from
Q4K_BYTES = 144  # one Q4_K super-block (256 weights)

FULL = dict(d_model=2048, experts=128, top_k=8, expert_ff=768, heads=32, kv_heads=4, head_dim=128)
TINY = dict(d_model=256, experts=8, top_k=2, expert_ff=256, heads=4, kv_heads=2, head_dim=64)


def q4k_pool(rng: np.random.Generator, first_const: float | None = None) -> np.ndarray:
    """POOL_BLOCKS Q4_K super-blocks of N(0, 1) weights, uint8 [POOL_BLOCKS, 144];
    with first_const, weight 0 of every block is that constant."""
    from edgerun.quant.quantize import quantize

    x = rng.standard_normal((POOL_BLOCKS, 256)).astype(np.float32)
    if first_const is not None:
        x[:, 0] = first_const
    return quantize(x, "q4_k", method="rtn")


def scaled(pool: np.ndarray, scale: float) -> np.ndarray:
    """The pool with every block's d and dmin (f16 at bytes 0-3) multiplied by scale."""
    out = pool.copy()
    f = out[:, :4].copy().view(np.float16).astype(np.float32) * scale
    out[:, :4] = f.astype(np.float16).view(np.uint8)
    return out


def q4k_tensor(
    rng: np.random.Generator, pool: np.ndarray, shape: tuple[int, ...], first: np.ndarray | None
) -> np.ndarray:
    """Raw Q4_K bytes uint8 [*shape[:-1], shape[-1] // 256 * 144] drawn from the pool
    (block 0 of each row from `first` when given)."""
    rows = int(np.prod(shape[:-1]))
    nb = shape[-1] // 256
    idx = rng.integers(0, len(pool), size=(rows, nb))
    out = pool[idx]
    if first is not None:
        out[:, 0] = first[rng.integers(0, len(first), size=rows)]
    return out.reshape(*shape[:-1], nb * Q4K_BYTES)


def copy_tokenizer(writer, path: Path) -> int:
    """Copy every tokenizer.* key of the GGUF at path; returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(path)
    vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        val = field.contents()
        if key == "tokenizer.ggml.tokens":
            vocab = len(val)
        writer.add_key_value(key, val, vtype, sub)
    return vocab


def zipf_bias(experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """A logit bias per expert: -s * ln(rank), ranks shuffled over the experts."""
    rank = rng.permutation(experts) + 1
    return (-s * np.log(rank)).astype(np.float32)


def write(
    out: Path, layers: int, zipf: float, dims: dict, seed: int, tokenizer: Path, ctx: int
) -> int:
    import gguf

    rng = np.random.default_rng(seed)
    d, ne, k, ff = dims["d_model"], dims["experts"], dims["top_k"], dims["expert_ff"]
    nh, nkv, hd = dims["heads"], dims["kv_heads"], dims["head_dim"]
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_name(f"qwen3moe-synth-{layers}L" + (f"-zipf{zipf:g}" if zipf else ""))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff * k)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(ne)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(ff)
    vocab = copy_tokenizer(w, tokenizer)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    print("quantizing the block pools ...", file=sys.stderr)
    unit = q4k_pool(rng)
    first = q4k_pool(rng, EMBED_CONST)
    # input projections see a unit-rms hidden state: weights 1/sqrt(fan_in); the output
    # projections are 10x smaller so the embedding (and its dimension 0) dominates the
    # residual stream through every layer
    pools = {}

    def pool_for(fan_in: int, gain: float) -> np.ndarray:
        key = (fan_in, gain)
        if key not in pools:
            pools[key] = scaled(unit, gain / np.sqrt(fan_in))
        return pools[key]

    Q4K = gguf.GGMLQuantizationType.Q4_K
    tensors: list[tuple[str, object]] = []  # name, maker, in header order

    def q(name, shape, fan_in, gain=1.0, first_rows=None):
        nbytes_shape = (*shape[:-1], shape[-1] // 256 * Q4K_BYTES)
        w.add_tensor_info(name, nbytes_shape, np.dtype(np.uint8), int(np.prod(nbytes_shape)), Q4K)
        tensors.append((name, lambda: q4k_tensor(rng, pool_for(fan_in, gain), shape, first_rows)))

    def f32(name, make):
        a = make()
        w.add_tensor_info(name, a.shape, np.dtype(np.float32), a.nbytes)
        tensors.append((name, lambda a=a: a))

    # the embedding: N(0, 1) with dimension 0 = EMBED_CONST (block 0 from `first`)
    q("token_embd.weight", (vocab, d), 1, 1.0, first_rows=first)
    f32("output_norm.weight", lambda: np.ones(d, np.float32))
    q("output.weight", (vocab, d), d)
    # dimension 0 of the normed hidden state: EMBED_CONST / rms of the stream (~1)
    x0 = EMBED_CONST / np.sqrt(1.0 + (EMBED_CONST**2 - 1.0) / d)
    bias = zipf_bias(ne, zipf, rng) if zipf else None
    for i in range(layers):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", lambda: np.ones(d, np.float32))
        f32(p + "ffn_norm.weight", lambda: np.ones(d, np.float32))
        f32(p + "attn_q_norm.weight", lambda: np.ones(hd, np.float32))
        f32(p + "attn_k_norm.weight", lambda: np.ones(hd, np.float32))
        q(p + "attn_q.weight", (nh * hd, d), d)
        q(p + "attn_k.weight", (nkv * hd, d), d)
        q(p + "attn_v.weight", (nkv * hd, d), d)
        q(p + "attn_output.weight", (d, nh * hd), nh * hd, 0.1)

        def router(bias=bias):
            r = (rng.standard_normal((ne, d)) / np.sqrt(d)).astype(np.float32)
            r[:, 0] = 0.0 if bias is None else bias / x0
            return r

        f32(p + "ffn_gate_inp.weight", router)
        q(p + "ffn_gate_exps.weight", (ne, ff, d), d)
        q(p + "ffn_up_exps.weight", (ne, ff, d), d)
        q(p + "ffn_down_exps.weight", (ne, d, ff), ff, 0.1)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    total = 0
    for _name, make in tensors:
        a = make()
        w.write_tensor_data(a)
        total += a.nbytes
        del a
    w.close()
    print(f"wrote {out} ({total / 1e9:.2f} GB of tensors, {time.perf_counter() - t0:.0f} s)")
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=None, help="default 9 (2 with --tiny)")
    ap.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of routing (0: random)")
    ap.add_argument("--tiny", action="store_true", help="small dims (a check, ~60 MB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER_GGUF)
    a = ap.parse_args()
    layers = a.layers or (2 if a.tiny else 9)
    if a.out is None:
        tag = "tiny" if a.tiny else f"{layers}L"
        z = f"-zipf{a.zipf:g}" if a.zipf else "-random"
        a.out = Path(f"/work/models/qwen3moe-synth-{tag}{z}-q4k.gguf")
    write(a.out, layers, a.zipf, TINY if a.tiny else FULL, a.seed, a.tokenizer, a.ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
