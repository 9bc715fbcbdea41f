"""The system probe (`edgerun sysinfo`): facts, measurements cross-checked against plain
measurements, caching, and the CLI."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from edgerun.device import probe as probe_mod
from edgerun.offload.io import aligned_empty


def test_cpu_features_match_proc_cpuinfo():
    c = probe_mod.cpu_features()
    assert c["logical_cores"] >= c["usable_cores"] >= 1 and c["physical_cores"] >= 1
    assert c["kernel_path"] in ("portable", "vnni", "avx2")
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.lower().startswith(("flags", "features")):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert ("avx2" in c["simd"]) == ("avx2" in flags)
    assert ("neon" in c["simd"]) == ("asimd" in flags)
    assert ("avx512_vnni" in c["simd"]) == ("avx512_vnni" in flags)


def _plain_sequential_read(path, chunk: int) -> float:
    """Bytes/s of a plain O_DIRECT (or buffered) sequential read loop, one chunk at a time."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    buf = aligned_empty(chunk)
    size = os.fstat(fd).st_size
    t0 = time.perf_counter()
    done = 0
    try:
        while done < size:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return done / (time.perf_counter() - t0)


def test_storage_figures_agree_with_a_plain_read(tmp_path):
    st = probe_mod.measure_storage(tmp_path, nbytes=16 << 20, chunks=(4096, 1 << 20))
    assert set(st["sequential"]) == {4096, 1 << 20} and set(st["random"]) == {4096, 1 << 20}
    assert all(v > 1e5 for kind in ("sequential", "random") for v in st[kind].values())
    assert st["sequential"][1 << 20] > st["sequential"][4096]
    assert not list(tmp_path.glob(".probe-*"))  # the scratch file is gone
    # plain measurement of the same kind: a 16 MiB file read sequentially in 1 MiB reads,
    # alternated with the probe three times; shared storage drifts between single reads
    # (one CI run saw 4.2x), so the median ratio is held, which a wrong unit or loop fails
    f = tmp_path / "plain.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 16 << 20, np.uint8).tobytes())
    ratios = []
    for attempt in range(3):
        if attempt:
            st = probe_mod.measure_storage(tmp_path, nbytes=16 << 20, chunks=(1 << 20,))
        if hasattr(os, "posix_fadvise"):
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        plain = _plain_sequential_read(f, 1 << 20)
        ratios.append(st["sequential"][1 << 20] / plain)
        print(
            f"sequential 1 MiB: probe {st['sequential'][1 << 20] / 1e6:.0f} MB/s, plain "
            f"{plain / 1e6:.0f} MB/s"
        )
    assert 0.33 < float(np.median(ratios)) < 3.0


def test_bandwidth_figure_agrees_with_a_plain_copy():
    from edgerun.device.bandwidth import measure_bandwidth

    bw = measure_bandwidth(1, mbytes=256, repeats=3)
    a = np.ones(64 << 20, np.float32)  # 256 MiB
    b = np.empty_like(a)
    np.copyto(b, a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(3))
    plain = 2 * a.nbytes / best  # a copy reads and writes every byte
    print(f"bandwidth 1 thread: probe {bw / 1e9:.1f} GB/s, plain copy {plain / 1e9:.1f} GB/s")
    assert 0.3 < bw / plain < 6.0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_probe_is_cached_and_refreshed(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    calls = []

    def fake_storage(directory, nbytes=0, chunks=()):
        calls.append(str(directory))
        return {"direct": True, "sequential": {4096: 1e7}, "random": {4096: 4e6}}

    monkeypatch.setattr(probe_mod, "measure_storage", fake_storage)
    monkeypatch.setattr("edgerun.device.bandwidth.measure_bandwidth", lambda t, **kw: 1e10 * t)
    a = probe_mod.probe()
    b = probe_mod.probe()
    assert len(calls) == 1 and a["bandwidth_bytes_per_s"] == b["bandwidth_bytes_per_s"]
    assert (tmp_path / "sysinfo.json").exists()
    probe_mod.probe(refresh=True)
    assert len(calls) == 2
    text = probe_mod.format_probe(a)
    assert "IOPS" in text and "GB/s" in text and "kernels" in text


@pytest.mark.slow
def test_sysinfo_command_prints_the_report(tmp_path):
    env = {**os.environ, "EDGERUN_HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "edgerun", "sysinfo", "--json", "--storage-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["cpu"]["usable_cores"] >= 1 and p["memory"]["total_bytes"] > 0
    assert set(p["storage"]["sequential_bytes_per_s"]) == {str(c) for c in probe_mod.CHUNKS}
    r = subprocess.run(
        [sys.executable, "-m", "edgerun", "sysinfo"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0 and "storage" in r.stdout and "bandwidth" in r.stdout
