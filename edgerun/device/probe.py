"""System probe: what this machine is and can do, for `edgerun sysinfo` and benchmarks.

Facts from psutil and /proc (cores, SIMD features, memory, whether the page cache can
be dropped) and short measurements (memory streaming bandwidth with 1..n threads;
storage read throughput by chunk size, sequential and random, with direct I/O, on a
scratch file in the directory models are read from). The result is cached as JSON in
the cache directory (`probe(refresh=True)` measures again) and stored with benchmark
results, so a figure always comes with the machine it was measured on.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

__all__ = ["cpu_features", "measure_storage", "probe", "format_probe"]

CHUNKS = (4096, 16384, 65536, 262144, 1 << 20)
SCRATCH_BYTES = 64 << 20
MAX_AGE_S = 7 * 24 * 3600
# /proc/cpuinfo flag -> what we call it (x86 "flags", ARM "Features")
_FEATURES = {
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "amx_int8": "amx_int8",
    "asimd": "neon",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "sve": "sve",
}


def cpu_features() -> dict:
    """CPU model, core counts and the SIMD features the kernels care about."""
    import psutil

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "hardware", "cpu model") and name in ("", platform.machine()):
                name = val.strip()
            elif key in ("flags", "features"):
                flags |= set(val.split())
    except OSError:
        pass
    from edgerun.ops.qmatvec import kernel_path, uses_amx

    return {
        "model": name,
        "arch": platform.machine(),
        "logical_cores": psutil.cpu_count(logical=True) or 1,
        "physical_cores": psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
        "simd": sorted({ours for flag, ours in _FEATURES.items() if flag in flags}),
        "kernel_path": kernel_path(),
        "amx_prefill": uses_amx(),
    }


def memory() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": int(vm.total), "available_bytes": int(vm.available)}


def can_drop_page_cache() -> bool:
    """Whether this process may write /proc/sys/vm/drop_caches (root, not read-only)."""
    p = Path("/proc/sys/vm/drop_caches")
    return p.exists() and os.access(p, os.W_OK)


def measure_storage(
    directory: Path,
    nbytes: int = SCRATCH_BYTES,
    chunks: tuple[int, ...] = CHUNKS,
    throttle=None,
) -> dict:
    """Direct-I/O read bytes/s by chunk size, one read at a time (queue depth 1, as a
    storage datasheet quotes): {"sequential": {chunk: B/s}, "random": {...}, "direct":
    whether O_DIRECT was available}. With `throttle` (a device profile's), the reads go
    through it: what an emulated device delivers."""
    from edgerun.offload.io import DirectReader, aligned_empty, scratch_file

    rng = np.random.default_rng(0)
    with scratch_file(directory, nbytes, "probe") as path:
        size = path.stat().st_size
        out: dict = {"sequential": {}, "random": {}}
        with DirectReader(path, threads=1) as r:
            r.throttle = throttle
            out["direct"] = r.direct
            for chunk in chunks:
                n = min(size // chunk, max(256, (8 << 20) // chunk))
                buf = aligned_empty(chunk)
                for kind, offs in (
                    ("sequential", np.arange(n) * chunk),
                    ("random", rng.permutation(size // chunk)[:n] * chunk),
                ):
                    t0 = time.perf_counter()
                    for o in offs:
                        r.read_into([(int(o), chunk)], buf)
                    out[kind][chunk] = n * chunk / (time.perf_counter() - t0)
        return out


def _cache_path() -> Path:
    from edgerun.registry import cache_dir

    return cache_dir() / "sysinfo.json"


def probe(refresh: bool = False, storage_dir: Path | None = None) -> dict:
    """The machine's facts and measured figures (cached; a few seconds to measure)."""
    from edgerun.registry import cache_dir

    path = _cache_path()
    facts = {
        "cpu": cpu_features(),
        "memory": memory(),
        "can_drop_page_cache": can_drop_page_cache(),
    }
    if not refresh:
        try:
            if time.time() - path.stat().st_mtime < MAX_AGE_S:
                cached = json.loads(path.read_text())
                if cached.get("cpu", {}).get("model") == facts["cpu"]["model"]:
                    cached.update(facts)  # facts are cheap: always current
                    return cached
        except (OSError, ValueError):
            pass
    from edgerun.device.bandwidth import measure_bandwidth

    n = facts["cpu"]["usable_cores"]
    bw = {str(t): measure_bandwidth(t, mbytes=256, repeats=3) for t in range(1, n + 1)}
    storage_dir = storage_dir or cache_dir() / "models"
    st = measure_storage(storage_dir)
    result = {
        **facts,
        "bandwidth_bytes_per_s": bw,
        "storage": {
            "directory": str(storage_dir),
            "direct_io": st["direct"],
            "sequential_bytes_per_s": {str(k): v for k, v in st["sequential"].items()},
            "random_bytes_per_s": {str(k): v for k, v in st["random"].items()},
        },
        "measured_at": time.time(),
    }
    from edgerun.runtime.atomic import write_bytes_atomic

    write_bytes_atomic(path, json.dumps(result, indent=1).encode())
    return result


def format_probe(p: dict) -> str:
    """The probe as a short human-readable report."""
    c, m, s = p["cpu"], p["memory"], p["storage"]
    gib = 1 << 30
    lines = [
        f"CPU       {c['model']} ({c['arch']}): {c['logical_cores']} logical / "
        f"{c['physical_cores']} physical cores, {c['usable_cores']} usable",
        f"SIMD      {', '.join(c['simd']) or 'none detected'}; edgerun kernels: {c['kernel_path']}"
        + (", prefill on AMX tiles" if c.get("amx_prefill") else ""),
        f"memory    {m['total_bytes'] / gib:.1f} GiB total, "
        f"{m['available_bytes'] / gib:.1f} GiB available",
        "bandwidth "
        + ", ".join(
            f"{t} thread{'s' if t != '1' else ''} {b / 1e9:.1f} GB/s"
            for t, b in p["bandwidth_bytes_per_s"].items()
        ),
        f"storage   {s['directory']} ({'direct I/O' if s['direct_io'] else 'buffered'}"
        ", one read at a time)",
    ]
    for kind in ("sequential", "random"):
        vals = s[f"{kind}_bytes_per_s"]
        lines.append(
            f"  {kind:<10} "
            + ", ".join(f"{int(k) // 1024} KiB {v / 1e6:,.0f} MB/s" for k, v in vals.items())
        )
    rnd4 = s["random_bytes_per_s"].get("4096")
    if rnd4:
        lines.append(f"  random 4 KiB: {rnd4 / 4096:,.0f} IOPS")
    lines.append(
        "page cache can be dropped: " + ("yes" if p["can_drop_page_cache"] else "no (needs root)")
    )
    return "\n".join(lines)
