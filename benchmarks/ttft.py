"""Time to first token in a fresh process (warm Numba cache), median of runs.

Each run starts a new Python process that imports edgerun, loads the model and
streams the first piece of an answer to a short prompt; the wall time from
process start to that piece is the figure a user waits for (interpreter exit
is not counted).

Usage: python benchmarks/ttft.py [-m MODEL] [-r 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CHILD = """
import sys, time
import edgerun
m = edgerun.load(sys.argv[1] if sys.argv[1] != "-" else None)
it = m.chat([{"role": "user", "content": "Hi!"}], stream=True, max_tokens=4, temperature=0)
next(it)
print("first-token", flush=True)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="-")
    ap.add_argument("-r", "--runs", type=int, default=5)
    args = ap.parse_args(argv)
    subprocess.run([sys.executable, "-c", CHILD, args.model], check=True, capture_output=True)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, args.model],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = child.stdout.readline()  # the moment the first piece exists, not process exit
        times.append(time.perf_counter() - t0)
        child.wait()
        if "first-token" not in line:
            raise RuntimeError(f"the child printed {line!r} instead of its first token")
    print(
        f"time to first token (fresh process, warm cache): median {statistics.median(times):.2f} s"
        f" (min {min(times):.2f}, max {max(times):.2f}, {args.runs} runs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
