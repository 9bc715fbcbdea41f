"""One mixture-of-experts FFN layer (model/moe.MoEFFN) at a real model's shape, against the
time its weight reads need at this machine's measured bandwidth.

The default shape is a Qwen3-30B-A3B layer: d_model 2048, 128 experts of width 768, top-8,
Q4_K experts from random blocks (~340 MB, far beyond the last-level cache, so every pass
reads its experts from DRAM), an F32 router. Each repeat draws new rows, so the router
picks other experts. Reported as medians:

- decode, 1 row: ms per token, and the bound: the 8 chosen experts' bytes + the router's
  at the measured streaming bandwidth;
- decode, 4 rows of different sequences (decode_batch): ms per pass (each chosen expert
  read once for the rows that chose it), and its bound (the distinct experts chosen);
- for scale: the router's and chosen experts' matvecs called directly, and one matvec of a
  dense matrix as large as the chosen experts (what the kernels reach on this machine);
- a 64-token prompt: ms per prompt and per token, and its bound (the distinct experts
  chosen, nearly all 128, read once).

Usage: python benchmarks/moe_ffn.py [-t THREADS] [-r REPEATS] [--experts 128 --used 8
       --d-model 2048 --ff 768 --format Q4_K --prompt 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=20)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()

    import numpy as np

    from edgerun.device.bandwidth import measure_bandwidth
    from edgerun.model.moe import MoEFFN, ResidentExperts
    from edgerun.ops import qmatvec
    from edgerun.quant.formats import QuantTensor, QuantType
    from edgerun.quant.reference import random_blocks
    from edgerun.runtime.cpu_share import set_threads

    set_threads(args.threads)
    qt = QuantType[args.format]
    d, ff, n = args.d_model, args.ff, args.experts
    rng = np.random.default_rng(0)

    def mat(name: str, rows: int, cols: int, q: QuantType = qt) -> QuantTensor:
        return QuantTensor(name, q, (rows, cols), random_blocks(q, rows, cols, rng, 0.02))

    experts = ResidentExperts(
        [mat(f"gate[{e}]", ff, d) for e in range(n)],
        [mat(f"up[{e}]", ff, d) for e in range(n)],
        [mat(f"down[{e}]", d, ff) for e in range(n)],
    )
    router = mat("router", n, d, QuantType.F32)
    moe = MoEFFN(router, experts, args.used, ff, norm=True)
    per_expert = sum(t.nbytes for t in experts.matrices(0))
    bw = measure_bandwidth(args.threads)
    print(
        f"{n} experts of {ff} x {d} {args.format} ({per_expert / 1e6:.2f} MB each, "
        f"{experts.nbytes / 1e6:.0f} MB in all), top-{args.used}, {args.threads} threads; "
        f"streaming bandwidth {bw / 1e9:.1f} GB/s"
    )
    qmatvec.warm_decode([qt, QuantType.F32], d)
    qmatvec.warm_prefill([qt, QuantType.F32], d)

    def run(rows: int, decode: bool) -> tuple[float, float]:
        """Median seconds of a pass of `rows` rows, and the median bound of its reads."""
        times, bounds = [], []
        for rep in range(args.repeats + 1):
            x = rng.standard_normal((rows, d)).astype(np.float32)
            chosen = np.unique(moe.routing(x, decode)[0])
            t0 = time.perf_counter()
            moe.decode_batch(x) if decode else moe(x)
            if rep:  # the first pass warms
                times.append(time.perf_counter() - t0)
                bounds.append((chosen.size * per_expert + router.nbytes) / bw)
        return statistics.median(times), statistics.median(bounds)

    from edgerun.ops.activations import glu

    dense = mat("dense", 3 * args.used * ff, d)

    def one_row() -> tuple[float, float, float, float]:
        """Medians, alternating within each repeat on the same row: MoEFFN on it, the
        router's and its experts' matvecs called directly, one matvec of a dense matrix as
        large as the chosen experts; and the bound of the MoE pass's reads."""
        times: list[list[float]] = [[], [], []]
        bounds = []
        for rep in range(args.repeats + 1):
            x = rng.standard_normal((1, d)).astype(np.float32)
            ids = moe.routing(x, False)[0][0]
            t0 = time.perf_counter()
            moe(x)
            t1 = time.perf_counter()
            qmatvec.matvec(router, x[0])
            for m in experts.experts(sorted(ids.tolist())):
                g, u = qmatvec.matvec_many((m.gate, m.up), x[0])
                qmatvec.matvec(m.down, glu(g[None], u[None], "silu")[0])
            t2 = time.perf_counter()
            qmatvec.matvec(dense, x[0])
            t3 = time.perf_counter()
            if rep:  # the first pass warms
                for i, t in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                    times[i].append(t)
                bounds.append((ids.size * per_expert + router.nbytes) / bw)
        return (*(statistics.median(t) for t in times), statistics.median(bounds))

    t, alone, dense_t, bound = one_row()
    print(
        f"{'decode, 1 row':<20} {t * 1e3:8.2f} ms per token; reads at bandwidth "
        f"{bound * 1e3:6.2f} ms: {bound / t:4.0%} of the bound"
    )
    print(f"{'  kernels alone':<20} {alone * 1e3:8.2f} ms (the router's and 8 experts' matvecs)")
    print(
        f"{'  one dense matvec':<20} {dense_t * 1e3:8.2f} ms (a matrix of the chosen experts' "
        "bytes)"
    )
    for label, rows, decode in (
        ("decode, 4 rows", 4, True),
        (f"prompt, {args.prompt} tokens", args.prompt, False),
    ):
        t, bound = run(rows, decode)
        print(
            f"{label:<20} {t * 1e3:8.2f} ms per pass ({t * 1e3 / rows:6.2f} ms per row); "
            f"reads at bandwidth {bound * 1e3:6.2f} ms: {bound / t:4.0%} of the bound"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
