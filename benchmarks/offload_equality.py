"""Greedy output under RAM budgets against the resident model's, token for token.

    python benchmarks/offload_equality.py -m qwen2.5-coder-1.5b --budgets 800M,560M

Each budget runs in its own process (the budget is the whole process, and the resident
model would count against it). Dense offloading computes exactly what the resident
model does (rows lent on the KV cache's reserve included), so the texts must be equal;
the script prints each budget's verdict, the MB read per forward pass and whether the
output head was streamed, and exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, edgerun
model, budget, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# resident: the row kernels, which offloaded layers compute with (not the copies)
kw = {"interleave": False} if budget == "none" else {"ram_budget": budget, "offload": "dense"}
m = edgerun.load(model, threads=2, **kw)
out = "".join(m.generate(prompt, max_tokens=n, temperature=0))
st = m.loader.offload_stats()
print(json.dumps({"out": out, "bytes_read": None if st is None else st["bytes_read"],
                  "lent": 0 if st is None else st.get("lent_bytes", 0),
                  "head_streamed": getattr(m.transformer, "head", None) is not None}))
"""


def run(model: str, budget: str, prompt: str, n: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, model, budget, prompt, str(n)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        sys.exit(f"{budget}: the run failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--budgets", default="800M,560M")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument(
        "--prompt", default="Write a Python function that checks whether a number is prime."
    )
    a = ap.parse_args()
    want = run(a.model, "none", a.prompt, a.n)["out"]
    same = True
    for b in a.budgets.split(","):
        got = run(a.model, b, a.prompt, a.n)
        ok = got["out"] == want
        same &= ok
        passes = a.n + 1  # the prompt's pass and one a generated token (the last one too)
        mb = got["bytes_read"] / passes / 1e6 if got["bytes_read"] is not None else 0.0
        print(
            f"{a.model} {b}: {'equal' if ok else 'DIFFERENT'} over {a.n} tokens, "
            f"~{mb:.0f} MB read a pass, head streamed: {got['head_streamed']}, "
            f"rows lent on the KV reserve: {got['lent'] / 2**20:.0f} MiB"
        )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
