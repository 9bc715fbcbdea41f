"""Static cost of the matvec kernels' inner loops on a 64-bit ARM core (llvm-mca).

Nothing here runs on ARM hardware, and emulated code says nothing about speed, so this
compiles the Q4_K and Q4_1 decode kernels as aarch64 code (run it under
`benchmarks/aarch64_qemu.sh python`), takes each kernel's hot inner loop from the
assembly (int8: the loop with the most NEON widening multiplies; portable float: the one
converting the most weights to float) and asks LLVM's machine-code analyser for its
cycles per iteration on a core's scheduling model. Weights per iteration: four per
`smull`/`smull2` (one int16 product per weight: the two activation levels share a word)
and one per scalar (four per vector) int-to-float conversion.

Usage (llvm-mca from Debian's llvm-14 on the host; the emulated process starts it):
    benchmarks/aarch64_qemu.sh python benchmarks/aarch64_loops.py [--cpu cortex-a72]
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
from collections import Counter

import numpy as np

from edgerun.ops import int8
from edgerun.ops.portable import kernels as portable  # first: sets Numba's flags
from edgerun.quant.formats import QuantType
from edgerun.quant.reference import random_blocks

LABEL = re.compile(r"^(\.LBB\d+_\d+):")
BRANCH = re.compile(r"^\s+(?:b\.\w+|b|cbn?z|tbn?z)\s+(?:[^,]+,\s*)*(\.LBB\d+_\d+)\s*$")


def kernel_asm(fmt: str) -> dict[str, str]:
    """aarch64 assembly of the int8 and portable matvec kernels of `fmt` ("q4_k", "q4_1")."""
    from numba import njit

    q = {"q4_k": QuantType.Q4_K, "q4_1": QuantType.Q4_1}[fmt]
    rng = np.random.default_rng(0)
    data = random_blocks(q, 16, 512, rng)
    x = rng.standard_normal(512).astype(np.float32)
    out = np.empty(16, np.float32)
    e, e0 = np.empty((0, 1), np.uint8), np.empty(0, np.float32)
    fi = njit(getattr(int8, "mv_" + fmt).py_func)  # uncached: inspect_asm needs a compile
    fi(data, e, e, x, out, e0, e0)
    fp = njit(getattr(portable, "mv_" + fmt).py_func)
    fp(data, x, out)
    return {
        "int8": "".join(fi.inspect_asm().values()),
        "portable": "".join(fp.inspect_asm().values()),
    }


def inner_loops(lines: list[str]) -> list[list[str]]:
    """The instructions of each innermost loop (a backward branch with no loop inside)."""
    where: dict[str, int] = {}
    spans = []
    for i, line in enumerate(lines):
        if m := LABEL.match(line):
            where[m.group(1)] = i
        if (b := BRANCH.match(line)) and b.group(1) in where:
            spans.append((where[b.group(1)], i))
    inner = [s for s in spans if not any(s[0] < t[0] and t[1] <= s[1] for t in spans if t != s)]
    code = [ln.startswith("\t") and not ln.strip().startswith(".") for ln in lines]
    return [[lines[i] for i in range(a + 1, b + 1) if code[i]] for a, b in inner]


def weights_per_iteration(body: list[str], kind: str) -> int:
    ops = Counter(ln.split()[0] for ln in body)
    if kind == "int8":
        return 4 * sum(ops[k] for k in ("smull", "smull2", "smlal", "smlal2"))
    vector = sum(1 for ln in body if re.match(r"^\s+[us]cvtf\s+v\d+\.4s", ln))
    return ops["ucvtf"] + ops["scvtf"] + 3 * vector


def hot_loop(asm: str, kind: str) -> tuple[list[str], int]:
    loops = [(weights_per_iteration(b, kind), b) for b in inner_loops(asm.splitlines())]
    weights, body = max(loops, key=lambda t: t[0])
    return body, weights


def mca_cycles(body: list[str], cpu: str, mca: str) -> float:
    run = subprocess.run(
        [mca, "-mtriple=aarch64", f"-mcpu={cpu}", "-iterations=200"],
        input="\n".join(body) + "\n",
        capture_output=True,
        text=True,
        check=True,
    )
    return int(re.search(r"Total Cycles:\s+(\d+)", run.stdout).group(1)) / 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", default="cortex-a72", help="llvm-mca's -mcpu (a Pi 4: cortex-a72)")
    ap.add_argument("--mca", default=shutil.which("llvm-mca-14") or "llvm-mca")
    args = ap.parse_args()
    if platform.machine().lower() not in ("aarch64", "arm64"):
        raise SystemExit("run this as aarch64 code: benchmarks/aarch64_qemu.sh python ...")
    print(f"llvm-mca -mcpu={args.cpu}, inner loops of the decode kernels as compiled here")
    print("| kernel | path | instructions (NEON) | weights | cycles / iteration | per weight |")
    print("|---|---|---|---|---|---|")
    for fmt in ("q4_k", "q4_1"):
        for kind, asm in kernel_asm(fmt).items():
            body, weights = hot_loop(asm, kind)
            neon = sum(1 for ln in body if re.search(r"\bv\d+\.", ln))
            cycles = mca_cycles(body, args.cpu, args.mca)
            print(
                f"| {fmt.upper()} | {kind} | {len(body)} ({neon}) | {weights} | {cycles:.1f} "
                f"| {cycles / weights:.3f} |"
            )


if __name__ == "__main__":
    main()
