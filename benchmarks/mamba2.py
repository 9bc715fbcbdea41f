"""The Mamba-2 mixer at a real model's size: one token's step and a prompt, per layer, for
the kernel alone (conv + scan + gated norm) and for the whole mixer (in_proj and out_proj
included), with random weights.

Default dims are granite-4.0-h-micro's Mamba-2 layers: d_model 2048, 64 heads of 64
(d_inner 4096), state size 128, 1 group, conv width 4 (36 of its 40 layers). Prints
microseconds per token per layer.

    PYTHONPATH=. python benchmarks/mamba2.py --prompt 512 --qtype Q8_0
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.model.mamba2 import Mamba2
from edgerun.model.state_cache import STATE_SHAPES
from edgerun.quant.quantize import quantize_tensor


class _Store:
    """One Mamba-2 layer's tensors, random, as a WeightStore hands them out."""

    def __init__(self, spec: ModelSpec, qtype: str, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        d, heads = spec.d_model, spec.mamba_heads
        inner = heads * spec.mamba_head_dim
        channels = STATE_SHAPES["mamba2"](spec)["conv"][1]
        shapes = {
            "ssm_in": (inner + channels + heads, d, qtype),
            "ssm_out": (d, inner, qtype),
            "ssm_conv1d": (channels, spec.ssm_conv_kernel, "F32"),
            "ssm_conv1d_bias": (1, channels, "F32"),
            "ssm_dt_bias": (1, heads, "F32"),
            "ssm_a": (1, heads, "F32"),
            "ssm_d": (1, heads, "F32"),
            "ssm_norm": (spec.mamba_groups, inner // spec.mamba_groups, "F32"),
        }
        self.m = {}
        for role, (rows, cols, qt) in shapes.items():
            name = spec.layer_tensor(role, 0)
            w = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
            if role == "ssm_a":
                w = -np.exp(rng.standard_normal((rows, cols))).astype(np.float32)
            self.m[name] = quantize_tensor(name, w, qt)

    def matrix(self, name: str):
        return self.m[name]

    def has(self, name: str) -> bool:
        return name in self.m


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
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--conv", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    args = ap.parse_args()
    base = ModelSpec(arch="granitehybrid", name="bench", n_layers=1, d_model=args.d_model,
                     d_ff=1, n_heads=1, n_kv_heads=1, head_dim=1, vocab_size=1,
                     context_length=4096, norm_eps=1e-5, rope_base=1e4, rope_dim=0)  # fmt: skip
    spec = dataclasses.replace(
        base,
        layer_mixers=("mamba2",),
        ssm_conv_kernel=args.conv,
        mamba_heads=args.heads,
        mamba_head_dim=args.head_dim,
        mamba_state=args.state,
        mamba_groups=args.groups,
    )
    mixer = Mamba2(spec, _Store(spec, args.qtype), 0, "bench")
    shapes = STATE_SHAPES["mamba2"](spec)
    rng = np.random.default_rng(1)

    def fresh() -> dict[str, np.ndarray]:
        return {k: np.zeros(s, np.float32) for k, s in shapes.items()}

    one = rng.standard_normal((1, args.d_model)).astype(np.float32)
    many = rng.standard_normal((args.prompt, args.d_model)).astype(np.float32)
    proj1 = rng.standard_normal((1, mixer.in_proj.shape[0])).astype(np.float32)
    projn = rng.standard_normal((args.prompt, mixer.in_proj.shape[0])).astype(np.float32)
    y1 = np.empty((1, mixer.d_inner), np.float32)
    yn = np.empty((args.prompt, mixer.d_inner), np.float32)
    st = fresh()
    rows = [
        ("kernel, one token", _time(lambda: mixer._mix(proj1, st, y1), args.repeats), 1),
        ("kernel, prompt", _time(lambda: mixer._mix(projn, fresh(), yn), args.repeats),
         args.prompt),
        ("mixer, one token", _time(lambda: mixer.prompt(one, st), args.repeats), 1),
        ("mixer, prompt", _time(lambda: mixer.prompt(many, fresh()), args.repeats), args.prompt),
    ]  # fmt: skip
    state_kib = sum(4 * np.prod(s) for s in shapes.values()) / 1024
    print(f"Mamba-2 d_model {args.d_model}, {args.heads} heads of {args.head_dim}, state "
          f"{args.state}, {args.groups} group(s), conv {args.conv}, {args.qtype}; state "
          f"{state_kib:,.0f} KiB a layer")  # fmt: skip
    for what, secs, n in rows:
        print(f"  {what:<20} {secs / n * 1e6:9.1f} us/token/layer")


if __name__ == "__main__":
    main()
