"""Quantization table: size, bits per weight, perplexity and decode speed per format.

    python benchmarks/quant_table.py                       # SmolLM2-135M, default rows
    python benchmarks/quant_table.py --model qwen2.5-coder-0.5b --rows q8_0,q4_k_m
    python benchmarks/quant_table.py --tokens 4096 --ctx 512 --json out.json

Each row converts the model (from its GGUF weights, dequantized: the source is itself
quantized, so every row carries that first rounding too) into a pack, then measures
perplexity on the start of Python's pydoc_data.topics (edgerun.tools.perplexity) and greedy
decode speed. "rtn" rows use plain min/max round-to-nearest, "search" rows the
error-minimizing scale search, "imatrix" rows the search weighted by activation
statistics collected on the calibration part of the corpus (disjoint from the text
evaluated). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROWS_DEFAULT = (
    "keep,f16,q8_0,q5_0,q4_k_m,q4_1,q4_0,"
    "q3_g64:rtn,q3_g64:search,q3_g64:imatrix,q2_g64:rtn,q2_g64:search,q2_g64:imatrix,"
    "q3_g64_m:imatrix,q2_g64_m:imatrix"
)


def _bpw(pack) -> tuple[float, float]:
    """(bits per weight over the transformer blocks' matrices, over all tensors)."""
    mat_bits = mat_n = all_bits = all_n = 0
    for name in pack.tensor_names():
        t = pack.tensor(name)
        n = t.rows * t.cols
        all_bits += 8 * t.nbytes
        all_n += n
        if t.rows > 1 and name.startswith("blk."):
            mat_bits += 8 * t.nbytes
            mat_n += n
    return mat_bits / mat_n, all_bits / all_n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default=ROWS_DEFAULT, help="comma list of recipe[:method]")
    ap.add_argument("--tokens", type=int, default=2048, help="evaluation tokens")
    ap.add_argument("--ctx", type=int, default=512, help="perplexity chunk size")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="where packs are written (default: tmp)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--decode-only", action="store_true", help="skip perplexity (speed only)")
    args = ap.parse_args(argv)

    import numpy as np

    import edgerun
    from edgerun.api import resolve_model
    from edgerun.formats.pack import read_pack
    from edgerun.runtime.cpu_share import set_threads
    from edgerun.tools.convert import GGUFSource, _calibrate, convert
    from edgerun.tools.perplexity import perplexity

    set_threads(args.threads)
    src_path = resolve_model(args.model, auto_pull=False)
    source = GGUFSource(src_path)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="edgerun-qt-"))
    work.mkdir(parents=True, exist_ok=True)
    imat_file = work / f"imatrix-{src_path.stem}-{args.calib_tokens}.npz"
    imatrix = None
    results = []
    header = (
        "| recipe | method | bpw (layers) | bpw (all) | size MB | PPL | ± | decode tok/s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    print(
        f"model: {src_path.name}, eval: pydoc_data.topics first {args.tokens} tokens, "
        f"ctx {args.ctx}, threads {args.threads}",
        flush=True,
    )
    print(header, flush=True)
    for row in args.rows.split(","):
        recipe, _, method = row.strip().partition(":")
        method = method or "search"
        imat = None
        if method == "imatrix":
            if imatrix is None:
                if imat_file.exists():
                    from edgerun.tools.calibrate import load_imatrix

                    imatrix = load_imatrix(imat_file)
                else:
                    t0 = time.perf_counter()
                    imatrix = _calibrate(source, args.calib_tokens, 512, progress=False)
                    np.savez(imat_file, **imatrix)
                    print(
                        f"(imatrix: {args.calib_tokens} tokens in "
                        f"{time.perf_counter() - t0:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
            imat = imatrix
        out = work / f"{recipe}-{method}"
        if not (out / "edgerun.json").exists():
            import contextlib
            import io

            with contextlib.redirect_stderr(io.StringIO()):  # the double-quant warning
                convert(
                    src_path,
                    out,
                    recipe,
                    imatrix=imat,
                    method="rtn" if method == "rtn" else "search",
                    progress=False,
                    source=source,
                )
        pack = read_pack(out)
        bpw_m, bpw_a = _bpw(pack)
        size = pack.file_size / 1e6
        model = edgerun.load(
            out, n_ctx=max(args.ctx, 64 + args.decode_tokens), threads=args.threads
        )
        if args.decode_only:
            res = SimpleNamespace(ppl=float("nan"), stderr=float("nan"), n_scored=0)
        else:
            res = perplexity(model, n_ctx=args.ctx, limit_tokens=args.tokens)
        prompt = model.tokenize("def fibonacci(n):")
        list(model.generate(prompt, max_tokens=4, temperature=0))  # warm-up
        tps = 0.0
        for _ in range(5):  # best of 5: the machine is shared
            list(model.generate(prompt, max_tokens=args.decode_tokens, temperature=0))
            tps = max(tps, model.stats.generate_tps)
        label = method
        if recipe == "keep":
            label = "-"
        elif recipe in ("f32", "f16", "bf16", "q8_0", "q5_0", "q4_1", "q4_0"):
            label = "rtn (ggml)"  # these formats have one rounding rule, no search
        r = dict(
            recipe=recipe,
            method=label,
            bpw_matrices=bpw_m,
            bpw_all=bpw_a,
            size_mb=size,
            ppl=res.ppl,
            ppl_se=res.stderr,
            decode_tps=tps,
            n_scored=res.n_scored,
        )
        results.append(r)
        print(
            f"| {recipe} | {r['method']} | {bpw_m:.2f} | {bpw_a:.2f} | {size:.1f} | "
            f"{res.ppl:.3f} | {res.stderr:.3f} | {tps:.1f} |",
            flush=True,
        )
        del model, pack
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
