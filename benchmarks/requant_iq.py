"""Requantize a GGUF into llama.cpp's 2-3 bit IQ types, with an importance matrix.

    python benchmarks/requant_iq.py [--src GGUF] [--out DIR] [--types iq2_xxs,iq3_s,...]
                                    [--calib-tokens 2048] [--keep-layers N]

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ1_S/IQ1_M need an importance matrix in llama.cpp's
quantizer (llama-quant.cpp's tensor_requires_imatrix). This tool collects one with
edgerun's own calibration (edgerun.tools.calibrate.collect_imatrix: mean x^2 per input
column of every matrix, the quantity llama-imatrix stores) on the calibration part of
edgerun.corpus, hands it to `llama_cpp.llama_model_quantize` as llama_model_imatrix_data,
and writes `<stem>-<type>.gguf` under --out. The files are references for
`benchmarks/vs_llamacpp.py --agreement` and the tests' real-block data, never runtime
inputs; llama-cpp-python is a benchmark-only dependency.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import numpy as np

# llama.h's llama_ftype numbers of the IQ file types
FTYPES = {
    "iq2_xxs": 19,
    "iq2_xs": 20,
    "iq3_xxs": 23,
    "iq1_s": 24,
    "iq3_s": 26,
    "iq3_m": 27,
    "iq2_s": 28,
    "iq2_m": 29,
    "iq1_m": 31,
}
DEFAULT_SRC = Path.home() / ".cache/edgerun/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def imatrix_for(src: Path, n_tokens: int, cache: Path) -> dict[str, np.ndarray]:
    """edgerun's imatrix of src over n_tokens of calibration text (kept in `cache`)."""
    if cache.is_file():
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    import edgerun
    from edgerun.corpus import calibration_text
    from edgerun.tools.calibrate import collect_imatrix, save_imatrix

    model = edgerun.load(str(src), n_ctx=512)
    ids = model.tokenize(calibration_text())[:n_tokens]
    t0 = time.perf_counter()
    imat = collect_imatrix(model.transformer, ids, n_ctx=512, chunk=128)
    print(f"imatrix: {len(imat)} matrices over {len(ids)} tokens, {time.perf_counter() - t0:.0f} s")
    save_imatrix(cache, imat)
    return imat


def quantize(
    src: Path, dst: Path, ftype: int, imat: dict[str, np.ndarray], prune: list[int] = ()
) -> None:
    """llama.cpp's quantizer: src -> dst in file type `ftype`, with the imatrix; `prune`:
    layer indices left out of dst (a smaller file of real blocks, quantized faster)."""
    import llama_cpp

    entries = (llama_cpp.llama_model_imatrix_data * (len(imat) + 1))()
    keep = []
    for i, (name, v) in enumerate(sorted(imat.items())):
        arr = np.ascontiguousarray(v, dtype=np.float32)
        keep.append((name.encode(), arr))
        entries[i].name = keep[-1][0]
        entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = arr.size
    entries[len(imat)].name = None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    params.imatrix = ctypes.cast(entries, type(params.imatrix))
    pruned = (ctypes.c_int32 * (len(prune) + 1))(*prune, -1)
    if prune:
        params.prune_layers = ctypes.cast(pruned, type(params.prune_layers))
        # the embedding stays whole: Q4_K quantizes it in seconds, an IQ type in minutes
        params.token_embedding_type = 12  # GGML_TYPE_Q4_K
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize ftype {ftype}: rc {rc}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC)
    ap.add_argument("--out", type=Path, default=Path("/work/models"))
    ap.add_argument("--types", default="iq3_s,iq3_xxs,iq2_xs,iq2_xxs")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument(
        "--keep-layers", type=int, default=0,
        help="keep only the first N layers (0: all): real blocks of a type in minutes",
    )  # fmt: skip
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.src.stem.removesuffix("-q4_k_m")
    imat = imatrix_for(args.src, args.calib_tokens, args.out / f"{stem}-imatrix.npz")
    n_layer = 1 + max(int(k.split(".")[1]) for k in imat if k.startswith("blk."))
    prune = list(range(args.keep_layers, n_layer)) if args.keep_layers else []
    for t in args.types.split(","):
        part = f"-{args.keep_layers}L" if prune else ""
        dst = args.out / f"{stem}-{t}{part}.gguf"
        t0 = time.perf_counter()
        quantize(args.src, dst, FTYPES[t], imat, prune)
        print(f"{dst}: {dst.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
