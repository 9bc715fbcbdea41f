#!/usr/bin/env bash
# GPU hand-off check (issue #11): decode and prefill tok/s of qwen2.5-coder-1.5b on the
# CPU alone and with `--gpu-budget 2G --gpu-device cuda`, and their ratio.
#
# Runs as is on a Linux machine with one CUDA GPU, from anywhere in the repository:
#   bash benchmarks/gpu_check.sh
# It installs edgerun with the gpu extra (torch from the registry, unless a CUDA torch
# is importable already), pulls the model (skipped when installed), prints the device's
# measured figures, then benches twice. Everything is bounded to stay within 10 minutes.
# Environment: PYTHON (default python3), MODEL, GPU_BUDGET (2G), GPU_DEVICE (cuda),
# N_PROMPT (64), N_GEN (64), REPS (3), BENCH_TIMEOUT (200 s per bench run).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
GPU_BUDGET=${GPU_BUDGET:-2G}
GPU_DEVICE=${GPU_DEVICE:-cuda}
N_PROMPT=${N_PROMPT:-64}
N_GEN=${N_GEN:-64}
REPS=${REPS:-3}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
OUT=${OUT_DIR:-$(mktemp -d)}
T0=$(date +%s)
step() { echo "== [$(($(date +%s) - T0)) s] $*" >&2; }

step "install: pip install -e '.[gpu]'"
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
    && "$PY" -c 'import edgerun' 2>/dev/null; then
    echo "edgerun and a CUDA torch are importable already; not installing" >&2
else
    timeout 300 "$PY" -m pip install -q -e ".[gpu]"
fi
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch: this check needs one GPU")
p = torch.cuda.get_device_properties(0)
print(f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB")
EOF

step "edgerun pull $MODEL"
timeout 300 "$PY" -m edgerun pull "$MODEL"

step "device figures (edgerun.gpu.calibrate.measure_device)"
GPU_DEVICE="$GPU_DEVICE" timeout 60 "$PY" - <<'EOF'
import os
from edgerun.gpu.calibrate import measure_device
m = measure_device(os.environ["GPU_DEVICE"])
print(
    f"{m['device']} {m['dtype']}: matvec {m['matvec_bytes_per_s'] / 1e9:.0f} GB/s "
    f"({m['matvec_seconds'] * 1e6:.0f} us for 4096x4096), round trip of a vector "
    f"{m['roundtrip_seconds'] * 1e6:.0f} us, H2D {m['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
    f"D2H {m['d2h_bytes_per_s'] / 1e9:.1f} GB/s ({m['seconds']:.1f} s)"
)
EOF

bench() {  # bench <label> [extra args...]: JSON report to $OUT/<label>.json
    local label=$1
    shift
    step "edgerun bench -m $MODEL $* ($label)"
    timeout "$BENCH_TIMEOUT" "$PY" -m edgerun bench -m "$MODEL" -p "$N_PROMPT" -n "$N_GEN" \
        -r "$REPS" --no-bandwidth --json "$@" >"$OUT/$label.json"
}
bench cpu
bench gpu --gpu-budget "$GPU_BUDGET" --gpu-device "$GPU_DEVICE"

step "results ($OUT)"
OUT="$OUT" GPU_BUDGET="$GPU_BUDGET" GPU_DEVICE="$GPU_DEVICE" "$PY" - <<'EOF'
import json, os

out = os.environ["OUT"]


def tok_s(label):
    with open(os.path.join(out, f"{label}.json")) as f:
        rep = json.load(f)
    rep = rep[0] if isinstance(rep, list) else rep
    rows = {r["test"][:2]: r for r in rep["rows"]}  # "pp64" / "tg64" -> row
    return rep, {k: (r["test"], r["median"], r["spread"]) for k, r in rows.items()}


cpu_rep, cpu = tok_s("cpu")
gpu_rep, gpu = tok_s("gpu")
print(f"model {cpu_rep['model']}, kernel path {cpu_rep['kernel_path']}")
for g in gpu_rep.get("gpu") or []:  # what the plan put on the device
    print(f"gpu run placement: {g}")
for label, rep in (("cpu", cpu_rep), ("gpu", gpu_rep)):
    for t, pr in (rep.get("predicted") or {}).items():
        print(f"{label} run, planner's predicted decode ({t} threads): {pr['tok_s']:.1f} tok/s")
gpu_label = f"gpu ({os.environ['GPU_BUDGET']} on {os.environ['GPU_DEVICE']})"
print(f"{'test':<6} {'cpu tok/s':>15} {gpu_label + ' tok/s':>29} {'ratio':>7}")
for k in ("pp", "tg"):
    if k in cpu and k in gpu:
        (name, c, cs), (_, g, gs) = cpu[k], gpu[k]
        print(f"{name:<6} {c:>8.1f} ± {cs:<4.1f} {g:>22.1f} ± {gs:<4.1f} {g / c:>6.2f}x")
EOF
step "done"
