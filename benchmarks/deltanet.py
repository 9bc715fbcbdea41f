"""The gated DeltaNet mixer at a real model's size: one token's step and a prompt, per
layer, for the kernels alone (conv + delta rule + gated norm) and for the whole mixer
(its projections included), with random weights.

Default dims are Qwen3.5-0.8B's linear-attention layers: d_model 1024, 16 key and 16
value heads of 128, conv width 4 (18 of its 24 layers). Prints microseconds per token per
layer and tokens/s of one layer.

    PYTHONPATH=. python benchmarks/deltanet.py --prompt 512 --qtype Q8_0
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.model.deltanet import L2_EPS, DeltaNet
from edgerun.model.state_cache import STATE_SHAPES
from edgerun.ops import gated_delta as gd
from edgerun.quant.quantize import quantize_tensor


class _Store:
    """One DeltaNet layer's tensors, random, as a WeightStore hands them out."""

    def __init__(self, spec: ModelSpec, qtype: str, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        d, dk, hk, hv = spec.d_model, spec.ssm_head_dim, spec.ssm_k_heads, spec.ssm_v_heads
        channels = (2 * hk + hv) * dk
        shapes = {
            "ssm_qkv": (channels, d),
            "ssm_gate": (hv * dk, d),
            "ssm_beta": (hv, d),
            "ssm_alpha": (hv, d),
            "ssm_out": (d, hv * dk),
        }
        self.m = {}
        for role, shape in shapes.items():
            name = spec.layer_tensor(role, 0)
            w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
            self.m[name] = quantize_tensor(name, w, qtype if shape[0] % 32 == 0 else "F32")
        conv = spec.layer_tensor("ssm_conv1d", 0)
        taps = rng.standard_normal((channels, spec.ssm_conv_kernel)).astype(np.float32) * 0.5
        self.m[conv] = quantize_tensor(conv, taps, "F32")
        self.v = {
            spec.layer_tensor("ssm_dt_bias", 0): rng.standard_normal(hv).astype(np.float32),
            spec.layer_tensor("ssm_a", 0): -np.exp(rng.standard_normal(hv)).astype(np.float32),
            spec.layer_tensor("ssm_norm", 0): np.ones(dk, np.float32),
        }

    def matrix(self, name: str):
        return self.m[name]

    def vector(self, name: str) -> np.ndarray:
        return self.v[name]


def _time(fn, repeats: int) -> float:
    fn()  # compile / warm
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16, help="key heads = value heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    args = ap.parse_args()
    h, dk = args.heads, args.head_dim
    spec = ModelSpec(
        arch="qwen35", name="bench", n_layers=1, d_model=args.d_model, d_ff=4 * args.d_model,
        n_heads=8, n_kv_heads=2, head_dim=256, vocab_size=1024, context_length=4096,
        norm_eps=1e-6, rope_base=1e7, rope_dim=64, layer_mixers=("deltanet",),
        ssm_conv_kernel=args.conv, ssm_head_dim=dk, ssm_k_heads=h, ssm_v_heads=h,
    )  # fmt: skip
    mixer = DeltaNet(spec, _Store(spec, args.qtype), 0, "bench")
    shapes = STATE_SHAPES["deltanet"](spec)

    def state() -> dict[str, np.ndarray]:
        return {k: np.zeros(s, np.float32) for k, s in shapes.items()}

    rng = np.random.default_rng(1)
    n = args.prompt
    x = rng.standard_normal((n, args.d_model)).astype(np.float32)
    channels = shapes["conv"][1]
    qkv = rng.standard_normal((n, channels)).astype(np.float32)
    zab = [rng.standard_normal((n, c)).astype(np.float32) for c in (h * dk, h, h)]

    def kernels(rows: slice) -> float:
        st = state()
        return _time(lambda: mixer._mix([qkv[rows], *(a[rows] for a in zab)], st), args.repeats)

    st1, stn = state(), state()
    figures = {
        "kernels, 1 token": kernels(slice(0, 1)),
        f"kernels, {n}-token prompt": kernels(slice(0, n)) / n,
        "mixer, 1 token": _time(lambda: mixer.decode(x[:1], [st1], [st1]), args.repeats * 20),
        f"mixer, {n}-token prompt": _time(lambda: mixer.prompt(x, stn), args.repeats) / n,
    }
    mib = sum(np.prod(s) for s in shapes.values()) * 4 / 2**20
    print(
        f"gated DeltaNet layer: d_model {args.d_model}, {h} heads of {dk}, conv {args.conv}, "
        f"{args.qtype} projections, state {mib:.2f} MiB"
    )
    for what, sec in figures.items():
        print(f"  {what:28s} {sec * 1e6:9.1f} us/token/layer  {1 / sec:9.0f} tok/s per layer")
    one = st1["ssm"][:1].copy()
    q = rng.standard_normal((1, 1, dk)).astype(np.float32)
    v = rng.standard_normal((1, 1, dk)).astype(np.float32)
    g, b = np.full((1, 1), -0.1, np.float32), np.full((1, 1), 0.5, np.float32)
    per_head = _time(lambda: gd.gated_delta(q, q, v, g, b, one, L2_EPS), args.repeats * 50)
    print(f"  delta rule, one head, 1 token {per_head * 1e6:9.2f} us")


if __name__ == "__main__":
    main()
