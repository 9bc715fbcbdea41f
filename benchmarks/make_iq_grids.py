"""Write edgerun/quant/iq_grids.py: the lookup tables of GGML's 1-3 bit IQ formats.

    python benchmarks/make_iq_grids.py [path/to/ggml-common.h]

The tables come from llama.cpp's ggml-common.h (default: the llama-cpp-python sdist's
vendor/llama.cpp), the C source every GGUF writer and reader shares: ksigns_iq2xs (7 sign
bits + their parity as bit 7), iq2xxs_grid, iq2xs_grid, iq2s_grid (8 unsigned levels per
entry, one byte each), iq3xxs_grid, iq3s_grid (4 per entry) and iq1s_grid (8 signed
levels -1/0/1). The module stores each as its little-endian bytes, zlib-compressed and
base64-encoded, and decodes them into uint8/int8 numpy arrays on import, so that neither
the runtime nor its tests need llama.cpp's sources. Re-running it on the same header
rewrites the same file.
"""

from __future__ import annotations

import base64
import re
import sys
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "edgerun" / "quant" / "iq_grids.py"
DEFAULT_HEADER = Path("/work/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-common.h")
# name in ggml-common.h -> (C type, numpy dtype of one level, levels per entry)
TABLES = {
    "ksigns_iq2xs": ("uint8_t", np.uint8, 1),
    "iq2xxs_grid": ("uint64_t", np.uint8, 8),
    "iq2xs_grid": ("uint64_t", np.uint8, 8),
    "iq2s_grid": ("uint64_t", np.uint8, 8),
    "iq3xxs_grid": ("uint32_t", np.uint8, 4),
    "iq3s_grid": ("uint32_t", np.uint8, 4),
    "iq1s_grid": ("uint64_t", np.int8, 8),
}
_CTYPES = {"uint8_t": np.uint8, "uint32_t": "<u4", "uint64_t": "<u8"}


def read_table(header: str, name: str, ctype: str) -> np.ndarray:
    m = re.search(
        rf"GGML_TABLE_BEGIN\({ctype},\s*{name},\s*(\w+)\)(.*?)GGML_TABLE_END\(\)", header, re.S
    )
    if m is None:
        raise SystemExit(f"{name} not found in the header")
    values = [int(v, 0) for v in re.findall(r"0x[0-9a-fA-F]+|\d+", m.group(2))]
    return np.array(values, dtype=_CTYPES[ctype])


def main(argv: list[str]) -> int:
    header = Path(argv[0]) if argv else DEFAULT_HEADER
    text = header.read_text()
    lines = [
        '"""Lookup tables of GGML\'s 1-3 bit IQ formats (generated, do not edit).',
        "",
        "Written by benchmarks/make_iq_grids.py from llama.cpp's ggml-common.h: each table's",
        "little-endian bytes, zlib-compressed, base64-encoded. Decoded on import into:",
        "",
        "- KSIGNS uint8 [128]: 7 sign bits plus their parity as bit 7 (ksigns_iq2xs)",
        "- IQ2XXS_GRID [256, 8], IQ2XS_GRID [512, 8], IQ2S_GRID [1024, 8] uint8: levels 8/25/43",
        "- IQ3XXS_GRID [256, 4] uint8 (levels 4..62), IQ3S_GRID [512, 4] uint8 (1..15)",
        "- IQ1S_GRID int8 [2048, 8]: levels -1, 0, 1",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import base64",
        "import zlib",
        "",
        "import numpy as np",
        "",
        "__all__ = [",
    ]
    names = {n: n.replace("ksigns_iq2xs", "ksigns").upper() for n in TABLES}
    lines += [f'    "{names[n]}",' for n in sorted(TABLES, key=lambda n: names[n])]
    lines += ["]", "", "", "def _table(b64: str, dtype, width: int) -> np.ndarray:"]
    lines += [
        "    raw = zlib.decompress(base64.b64decode(b64))",
        "    t = np.frombuffer(raw, dtype=dtype)",
        "    t = t.reshape(-1, width) if width > 1 else t",
        "    t.flags.writeable = False",
        "    return t",
        "",
    ]
    for name, (ctype, dtype, width) in TABLES.items():
        raw = read_table(text, name, ctype).tobytes()
        b64 = base64.b64encode(zlib.compress(raw, 9)).decode()
        chunks = [b64[i : i + 88] for i in range(0, len(b64), 88)]
        body = "\n".join(f'    "{c}"' for c in chunks)
        dt = "np.int8" if dtype is np.int8 else "np.uint8"
        lines += ["", f"{names[name]} = _table(", body + ",", f"    {dt},", f"    {width},", ")"]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
