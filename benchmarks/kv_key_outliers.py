"""Why Qwen2.5's keys do not survive q4_0: layer 0's attention, exactly, in numpy.

Layer 0's queries and keys need only the token embeddings, one RMSNorm and the q / k
projections (+ bias, RoPE), so they are computed exactly here from the GGUF (gguf-py's
dequantisation) for `-n` tokens of argparse.py. Each key treatment is scored by the mean
KL between the causal attention distributions on the exact keys and on the keys rounded
through it, averaged over heads and query positions:

- plain: ggml's 32-value blocks of the key rows (what llama.cpp stores);
- rotated: of R k (ops/kv_blocks.rotation: fixed signs, then Walsh-Hadamard per head);
- bias-centred: of k - c, c the k bias on the RoPE pairs that turn less than 0.5 rad over
  the trained context (those channels of RoPE(bias) are constant up to that angle); a
  constant subtracted from every key moves each query's scores by one constant, which
  the softmax removes exactly (models without a logit softcap);
- mean-centred: of k - the mean of RoPE_p(bias) over the trained context's positions p
  (the constant nearest every position's RoPE(bias) in the mean square);
- pi/3-centred: as bias-centred, on the pairs RoPE turns < pi / 3 (what
  model/kvcache.key_centre stores: no trained position keeps more offset than without);
- data-centred: of k - mean over positions (an upper bound on what a centre buys).

    python benchmarks/kv_key_outliers.py [-m qwen2.5-coder-1.5b-instruct-q4_k_m.gguf]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from edgerun.ops.kv_blocks import rotation
from edgerun.quant.legacy import Q4_0, Q8_0

MODEL = Path.home() / ".cache/edgerun/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def _layer0(path: str, n: int) -> tuple[np.ndarray, ...]:
    """(q [n, heads, hd], k [n, kv heads, hd] after RoPE, the k bias on the slow pairs
    [kv heads, hd], the mean of RoPE(k bias) over the trained positions, trained context)
    of layer 0 on n tokens of argparse.py (a Qwen2-layout GGUF)."""
    import llama_cpp
    from gguf import GGUFReader
    from gguf.quants import dequantize

    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()[5000:]
    vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    ids = vocab.tokenize(text[: 12 * n].encode(), add_bos=False)[:n]
    r = GGUFReader(path)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    meta = {k: r.fields[k].parts[-1][0] for k in r.fields if k.startswith(arch + ".")}
    tensors = {t.name: t for t in r.tensors}

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), np.float32)

    heads, kv_heads = (
        int(meta[f"{arch}.attention.head_count"]),
        int(meta[f"{arch}.attention.head_count_kv"]),
    )
    x = get("token_embd.weight")[ids]
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    x = x / np.sqrt((x * x).mean(1, keepdims=True) + eps) * get("blk.0.attn_norm.weight")
    q = x @ get("blk.0.attn_q.weight").T + get("blk.0.attn_q.bias")
    k = x @ get("blk.0.attn_k.weight").T + get("blk.0.attn_k.bias")
    hd = q.shape[1] // heads
    q, k = q.reshape(len(ids), heads, hd), k.reshape(len(ids), kv_heads, hd)
    inv = float(meta[f"{arch}.rope.freq_base"]) ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(len(ids))[:, None, None] * inv
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(a: np.ndarray) -> np.ndarray:  # NeoX pairs (i, i + hd / 2)
        a1, a2 = a[..., : hd // 2], a[..., hd // 2 :]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], -1)

    ctx = int(meta[f"{arch}.context_length"])
    bias = get("blk.0.attn_k.bias").reshape(kv_heads, hd)
    slow = np.tile(inv * ctx < 0.5, 2)  # the pairs RoPE turns < 0.5 rad over the context
    # the mean of RoPE_p(bias) over the trained context's positions
    z = np.exp(1j * np.arange(ctx)[:, None] * inv).mean(0)
    a1, a2 = bias[:, : hd // 2], bias[:, hd // 2 :]
    mean = np.concatenate([a1 * z.real - a2 * z.imag, a2 * z.real + a1 * z.imag], -1)
    third = np.tile(inv * ctx < np.pi / 3, 2)  # model/kvcache.key_centre's pairs
    return rope(q), rope(k), np.where(slow, bias, 0.0), mean, np.where(third, bias, 0.0), ctx


def _attention_kl(q: np.ndarray, k: np.ndarray, kk: np.ndarray) -> float:
    """Mean KL(softmax(q k) || softmax(q kk)) over heads and causal query positions."""
    n, heads, hd = q.shape
    group = heads // k.shape[1]
    mask = np.triu(np.ones((n, n), bool), 1)
    out = []
    for h in range(heads):
        s = [(q[:, h] @ a[:, h // group].T / np.sqrt(hd)).astype(np.float64) for a in (k, kk)]
        ls = []
        for x in s:
            x[mask] = -np.inf
            ls.append(x - np.logaddexp.reduce(x, 1, keepdims=True))
        p = np.exp(ls[0])
        d = np.where(mask, 0.0, ls[0] - np.where(mask, 0.0, ls[1]))
        out.append((p * d).sum(1).mean())
    return float(np.mean(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(MODEL))
    ap.add_argument("-n", type=int, default=768, help="tokens")
    args = ap.parse_args()
    q, k, centre, mean, third, ctx = _layer0(args.model, args.n)
    hd = k.shape[-1]
    r = rotation(hd)
    data = k.mean(0, keepdims=True)
    print(f"layer 0 of {Path(args.model).name}: {len(q)} tokens, head_dim {hd}, trained "
          f"context {ctx}; key rms {np.sqrt((k * k).mean()):.2f}, after the bias centre "
          f"{np.sqrt(((k - centre) ** 2).mean()):.2f}, after the data centre "
          f"{np.sqrt(((k - data) ** 2).mean()):.2f}")  # fmt: skip
    print(f"  {'type':<5} {'plain':>9} {'rotated':>9} {'bias-centred':>13} {'+ rotated':>10} "
          f"{'mean-centred + rotated':>23} {'pi/3-centred + rotated':>23} "
          f"{'data-centred + rotated':>23}"
          "   (mean attention KL)")  # fmt: skip
    for name, fmt in (("q8_0", Q8_0), ("q4_0", Q4_0)):

        def rounded(a: np.ndarray, fmt=fmt) -> np.ndarray:
            blocks = fmt.quantize_blocks(np.ascontiguousarray(a, np.float32).reshape(-1, 32))
            return fmt.dequantize_blocks(blocks).reshape(a.shape)

        kinds = (
            rounded(k),
            rounded(k @ r.T) @ r,
            rounded(k - centre) + centre,
            rounded((k - centre) @ r.T) @ r + centre,
            rounded((k - mean) @ r.T) @ r + mean,
            rounded((k - third) @ r.T) @ r + third,
            rounded((k - data) @ r.T) @ r + data,
        )
        kl = [_attention_kl(q, k, kk) for kk in kinds]
        print(f"  {name:<5} {kl[0]:9.4g} {kl[1]:9.4g} {kl[2]:13.4g} {kl[3]:10.4g} "
              f"{kl[4]:23.4g} {kl[5]:23.4g} {kl[6]:23.4g}")  # fmt: skip


if __name__ == "__main__":
    main()
