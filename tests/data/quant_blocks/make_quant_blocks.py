"""Write llama_cpp_blocks.npz: rows of real blocks that llama.cpp's quantizer wrote.

Run by hand (not by the tests), from the repository root:

    PYTHONPATH=$PWD python tests/data/quant_blocks/make_quant_blocks.py [QUANT_MODELS [IQ_MODELS]]

QUANT_MODELS (default $EDGERUN_QUANT_MODELS or /work/quant_models) holds llama.cpp's
requantisations of the registry's Qwen2.5-Coder models (llama_cpp.llama_model_quantize with
allow_requantize; see benchmarks/vs_llamacpp.py --agreement). They are the only files of
these formats edgerun has; the 0.5B's 896-column matrices fall back to Q5_1 / IQ4_NL there,
the 1.5B's take the K and IQ4_XS types. IQ_MODELS (default $EDGERUN_IQ_MODELS or
/work/models) holds the 1.5B's 1-3 bit IQ files that benchmarks/requant_iq.py writes (with
an imatrix; "-2L": the first two layers only, --keep-layers 2). For each format the
script takes 8 rows of two tensors: the rows with the smallest and the largest max|w|
(the extremes of the block scales) and 6 rows spread evenly over the tensor. The .npz
stores, per tensor, under the entry "<format>/<tensor name>":

    <entry>/raw        uint8 (rows, row bytes): the rows' blocks as the file holds them
    <entry>/ggml_type  int: the GGML type number
    <entry>/cols       int: the row length in weights
    <entry>/rows       int (rows,): the rows' indices in the tensor
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np

from edgerun.formats.gguf import read_gguf
from edgerun.quant.formats import QuantType, row_bytes

OUT = Path(__file__).with_name("llama_cpp_blocks.npz")
ROWS_PER_TENSOR = 8

# format -> (file, tensors): a square attention matrix and a feed-forward one (the wider
# ffn_down where the file holds it in this format, else ffn_gate)
SOURCES = {
    QuantType.Q5_K: ("qwen1.5b-q5_k_m.gguf", ("blk.0.attn_q.weight", "blk.3.ffn_down.weight")),
    QuantType.Q3_K: ("qwen1.5b-q3_k_m.gguf", ("blk.0.attn_q.weight", "blk.20.ffn_gate.weight")),
    QuantType.Q2_K: ("qwen1.5b-q2_k.gguf", ("blk.0.attn_q.weight", "blk.20.ffn_gate.weight")),
    QuantType.IQ4_XS: ("qwen1.5b-iq4_xs.gguf", ("blk.5.attn_q.weight", "blk.3.ffn_down.weight")),
    QuantType.Q5_1: ("qwen0.5b-q5_1.gguf", ("blk.0.attn_q.weight", "blk.10.ffn_down.weight")),
    QuantType.IQ4_NL: ("qwen0.5b-iq4_nl.gguf", ("blk.5.attn_q.weight", "blk.3.ffn_down.weight")),
}

# the same from IQ_MODELS
IQ_SOURCES = {
    QuantType.IQ3_S: (
        "qwen2.5-coder-1.5b-instruct-iq3_s.gguf",
        ("blk.0.attn_q.weight", "blk.20.ffn_gate.weight"),
    ),
    QuantType.IQ3_XXS: (
        "qwen2.5-coder-1.5b-instruct-iq3_xxs-2L.gguf",
        ("blk.0.ffn_gate.weight", "blk.1.ffn_down.weight"),
    ),
    QuantType.IQ2_S: (
        "qwen2.5-coder-1.5b-instruct-iq3_xxs-2L.gguf",
        ("blk.0.attn_q.weight", "blk.1.attn_k.weight"),
    ),
    QuantType.IQ2_XS: (
        "qwen2.5-coder-1.5b-instruct-iq2_xs-2L.gguf",
        ("blk.0.attn_q.weight", "blk.1.ffn_gate.weight"),
    ),
    QuantType.IQ2_XXS: (
        "qwen2.5-coder-1.5b-instruct-iq2_xxs-2L.gguf",
        ("blk.0.attn_q.weight", "blk.1.ffn_gate.weight"),
    ),
}


def pick_rows(w: np.ndarray, n: int) -> np.ndarray:
    """The rows with the smallest and largest max|w|, plus n - 2 spread evenly."""
    peak = np.abs(w).max(axis=1)
    rows = {int(peak.argmin()), int(peak.argmax())}
    rows |= set(np.linspace(0, len(w) - 1, n - 2).round().astype(int).tolist())
    for r in range(len(w)):  # where an extreme fell on a spread row
        if len(rows) >= n:
            break
        rows.add(r)
    return np.array(sorted(rows), np.int64)


def main(models: str, iq_models: str) -> None:
    arrays: dict[str, np.ndarray] = {}
    sources = [(models, q, fname, names) for q, (fname, names) in SOURCES.items()]
    sources += [(iq_models, q, fname, names) for q, (fname, names) in IQ_SOURCES.items()]
    for folder, q, fname, names in sources:
        f = read_gguf(os.path.join(folder, fname))
        for name in names:
            t = f.tensor(name)
            if t.qtype != q:
                raise SystemExit(f"{fname}: {name} is {t.qtype.name}, not {q.name}")
            raw = np.asarray(t.data)
            cols = t.shape[-1]
            assert raw.shape[1] == row_bytes(q, cols)
            w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(q)))
            rows = pick_rows(w, ROWS_PER_TENSOR)
            entry = f"{q.name}/{name}"
            arrays[f"{entry}/raw"] = np.ascontiguousarray(raw[rows])
            arrays[f"{entry}/ggml_type"] = np.array(int(q))
            arrays[f"{entry}/cols"] = np.array(cols)
            arrays[f"{entry}/rows"] = rows
            print(f"{entry}: {t.shape} rows {rows.tolist()}")
    np.savez_compressed(OUT, **arrays)
    print(f"{OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.environ.get("EDGERUN_QUANT_MODELS", "/work/quant_models"),
        sys.argv[2] if len(sys.argv) > 2 else os.environ.get("EDGERUN_IQ_MODELS", "/work/models"),
    )
