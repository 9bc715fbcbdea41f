"""Device figures for the placement planner, measured by a short calibration and cached.

The planner predicts a token's time from three rates, so it measures them on the
machine it runs on rather than assuming them:

- flash: O_DIRECT read throughput by chunk size (4 KiB to 1 MiB), with the offload
  reader's thread pool, on a scratch file in the directory the bundles live in;
- CPU: how many bytes of quantized weights a second the matvec kernels consume, per
  block format (a working set well past the last-level cache; on a compute-bound CPU
  the formats differ 5x), plus the fixed cost of one layer's kernel calls (small
  matrices, so the bytes do not matter);
- GPU (with a torch device): matvec bytes a second in the device dtype and the
  per-call host<->device round trip (edgerun/gpu/calibrate.py).

Results are cached as JSON under the cache directory, keyed by CPU model, thread
count, storage device, torch device and the kernels' sources (edgerun/ops), and
re-measured after a week or on request.
The whole calibration takes a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from edgerun.offload.plan import DENSITIES, DeviceFigures, OffloadFigures

__all__ = [
    "cached",
    "calibrate",
    "measure_cpu",
    "measure_flash",
    "measure_stream",
    "offload_figures",
]

CHUNKS = (4096, 32768, 131072, 1 << 20)
MAX_AGE_S = 7 * 24 * 3600
FLASH_FILE_BYTES = 64 << 20


def measure_flash(directory: Path, threads: int = 4, nbytes: int = FLASH_FILE_BYTES) -> dict:
    """Direct-I/O read bytes/s by chunk size from a scratch file in `directory`."""
    from edgerun.offload.io import DirectReader, aligned_empty, scratch_file

    rng = np.random.default_rng(0)
    with scratch_file(directory, nbytes, "calibrate") as path:
        out: dict[int, float] = {}
        with DirectReader(path, threads=threads) as r:
            for chunk in CHUNKS:
                # small chunks: fewer bytes, so each size costs about the same time
                total = min(nbytes, max(4 << 20, chunk * 1024))
                n = total // chunk
                offs = rng.permutation(nbytes // chunk)[:n] * chunk
                buf = aligned_empty(n * chunk)
                t0 = time.perf_counter()
                r.read_into([(int(o), chunk) for o in np.sort(offs)], buf)
                out[chunk] = n * chunk / (time.perf_counter() - t0)
        return out


def measure_stream(directory: Path, nbytes: int = FLASH_FILE_BYTES, cycles: int = 3) -> float:
    """Bytes/s of dense streaming's own reads: a RowStream (its READERS threads) over
    PIECE_BYTES pieces, taken in order as the decode takes them (the median of `cycles`
    passes).

    The planner once predicted dense decode from the 4-thread 1 MiB rate (1.43 GB/s
    here), but the row stream reads one piece at a time: Qwen2.5-1.5B ran at 0.62-0.67
    of that prediction at 800, 680 and 560 MiB, a steady 0.88-0.96 GB/s."""
    from edgerun.offload.io import DirectReader, scratch_file
    from edgerun.offload.rowstream import PIECE_BYTES, RowStream

    with scratch_file(directory, nbytes, "stream") as path:
        with DirectReader(path, threads=1) as r:
            stream = RowStream(r)
            try:
                n = max(2, nbytes // PIECE_BYTES)
                for k in range(n):
                    stream.add(k * PIECE_BYTES, PIECE_BYTES)
                rates = []
                for _ in range(cycles):
                    t0 = time.perf_counter()
                    for k in range(n):
                        stream.take(k)
                        stream.release()
                    rates.append(n * PIECE_BYTES / (time.perf_counter() - t0))
            finally:
                stream.close()
    return float(np.median(rates))  # a decode's reads meet the same drift: not the best


def _best(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls: noise on a shared machine only adds."""
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


# The block formats the registry models and the bundles' down columns use.
CPU_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")


def _matrix(fmt: str, rows: int, cols: int, rng: np.random.Generator):
    """A `fmt` tensor of random quants with sane scales (timing only, not values)."""
    from edgerun.quant.formats import QuantTensor, QuantType
    from edgerun.quant.reference import random_blocks

    qt = QuantType[fmt]
    return QuantTensor("calib", qt, (rows, cols), random_blocks(qt, rows, cols, rng))


def measure_cpu(
    threads: int, repeats: int = 5, formats: tuple[str, ...] = CPU_FORMATS
) -> tuple[dict[str, float], float]:
    """({format: matvec bytes/s}, seconds of one layer's fixed cost).

    Each rate is the best of `repeats` passes over a 64 MB working set of 8960x1536
    matrices (Qwen2.5-1.5B's FFN shape), past the last-level cache.
    """
    from edgerun.ops import qmatvec
    from edgerun.ops.norm import rmsnorm
    from edgerun.runtime.cpu_share import set_threads

    set_threads(threads)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1536).astype(np.float32)
    rates: dict[str, float] = {}
    for fmt in formats:
        mats = []
        while sum(m.nbytes for m in mats) < 64e6:
            mats.append(_matrix(fmt, 8960, 1536, rng))
        for m in mats[:2]:
            qmatvec.matvec(m, x)
        seconds = _best(lambda mats=mats: [qmatvec.matvec(m, x) for m in mats], repeats)
        rates[fmt] = sum(m.nbytes for m in mats) / seconds
        del mats
    # A layer issues about a dozen kernel calls; on tiny shapes they cost only overhead.
    tiny = _matrix("Q4_K", 64, 256, rng)
    xt = rng.standard_normal(256).astype(np.float32)
    w = np.ones(256, np.float32)
    for _ in range(20):
        qmatvec.matvec(tiny, xt)
        rmsnorm(xt.reshape(1, -1), w, 1e-6)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        qmatvec.matvec(tiny, xt)
        rmsnorm(xt.reshape(1, -1), w, 1e-6)
    per_call = (time.perf_counter() - t0) / (2 * n)
    return rates, 12 * per_call


def _key(threads: int, directory: Path, gpu_device: str | None) -> str:
    dev = 0
    for d in (directory, *directory.parents):  # a directory not made yet: its parent's
        try:
            dev = os.stat(d).st_dev
            break
        except OSError:
            continue
    from edgerun.device.probe import cpu_features
    from edgerun.runtime.numba_env import sources_stamp

    # the kernels' and the readers' sources too: an upgrade that changes their speed
    # measures them again
    text = f"{cpu_features()['model']}|{os.cpu_count()}|{threads}|{dev}|{gpu_device or ''}"
    text += sources_stamp("ops") + sources_stamp("offload")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _paths(threads: int, directory: Path | None, gpu_device: str | None, cache: Path | None):
    from edgerun.registry import cache_dir

    directory = directory or cache_dir() / "offload"
    cache = cache or cache_dir() / "calibration"
    return directory, cache / f"{_key(threads, directory, gpu_device)}.json"


def cached(
    threads: int,
    directory: Path | None = None,
    gpu_device: str | None = None,
    cache: Path | None = None,
) -> DeviceFigures | None:
    """The cached figures for this machine, threads and device when fresh, else None."""
    _, path = _paths(threads, directory, gpu_device, cache)
    d = _fresh(path)
    if d is not None and "flash_stream_bytes_s" not in d:
        return None  # lacks the row stream's own figure: measured again
    try:
        return None if d is None else DeviceFigures(**_figures(d))
    except (KeyError, TypeError):
        return None  # broken: measured again


def calibrate(
    threads: int,
    directory: Path | None = None,
    gpu_device: str | None = None,
    refresh: bool = False,
    cache: Path | None = None,
    isolate: bool = True,
) -> DeviceFigures:
    """This machine's DeviceFigures: from the cache when fresh, else measured (seconds).

    isolate: measure in a child process, so the buffers the measurement needs (~130 MB)
    never count against this process's RAM budget or peak RSS."""
    if not refresh:
        figs = cached(threads, directory, gpu_device, cache)
        if figs is not None:
            return figs
    directory, path = _paths(threads, directory, gpu_device, cache)
    directory.mkdir(parents=True, exist_ok=True)
    if isolate:
        return _calibrate_in_child(threads, directory, gpu_device, path)
    flash = measure_flash(directory)
    stream = measure_stream(directory)
    rates, layer_s = measure_cpu(threads)
    gpu: dict = {}
    if gpu_device is not None:
        from edgerun.gpu.calibrate import measure_device

        gpu = measure_device(gpu_device)
    figs = DeviceFigures(
        flash_read_bytes_s=flash[131072],
        ram_stream_bytes_s=float(np.mean(list(rates.values()))),
        cpu_by_format=tuple(sorted(rates.items())),
        flash_by_chunk=tuple(sorted(flash.items())),
        flash_stream_bytes_s=stream,
        layer_overhead_s=layer_s,
        gpu_matvec_bytes_s=float(gpu.get("matvec_bytes_per_s", 0.0)),
        gpu_call_s=float(gpu.get("roundtrip_seconds", 0.0)),
    )
    from edgerun.runtime.atomic import write_bytes_atomic

    data = json.dumps({**asdict(figs), "measured_at": time.time()}, indent=1)
    write_bytes_atomic(path, data.encode())
    return figs


def _calibrate_in_child(
    threads: int, directory: Path, gpu_device: str | None, path: Path
) -> DeviceFigures:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "edgerun.device.calibration", str(threads), str(directory)]
    cmd += [str(path)] + ([gpu_device] if gpu_device else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    from edgerun.errors import EdgerunError

    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EdgerunError(f"device calibration failed ({' '.join(cmd)}): {tail[0]}")
    d = _fresh(path)
    if d is None:
        raise EdgerunError(f"device calibration wrote no figures to {path}")
    return DeviceFigures(**_figures(d))


def _fresh(path: Path) -> dict | None:
    """A cache file's JSON when it is younger than MAX_AGE_S, else None."""
    try:
        if time.time() - path.stat().st_mtime >= MAX_AGE_S:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # missing or broken: measured again


def _pairs(d: dict, *keys: str) -> dict:
    """JSON lists of pairs back to the tuples the frozen dataclasses hold."""
    return {**d, **{k: tuple(tuple(p) for p in d[k]) for k in keys}}


def _figures(d: dict) -> dict:
    d = {k: v for k, v in d.items() if k != "measured_at"}
    return _pairs(d, "flash_by_chunk", "cpu_by_format")


if __name__ == "__main__":  # the isolated measurement: threads, directory, cache file, [gpu]
    import sys

    _t, _dir, _path = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    _gpu = sys.argv[4] if len(sys.argv) > 4 else None
    calibrate(_t, _dir, _gpu, refresh=True, cache=_path.parent, isolate=False)


# ------------------------------------------------------------------ offload path, per bundle
def measure_offload(bundle_file: Path, threads: int, io_threads: int = 4) -> OffloadFigures:
    """Per-neuron seconds of the offload executors' own reads and kernels on a real bundle.

    A rate model from plain reads and dense matvecs predicts 2.3x too fast on
    Qwen2.5-1.5B at 800 MiB (the executors read through a staging buffer and a gather,
    in scratch-sized calls, and their row kernels differ from the dense ones), so this
    times what they do: chunks of SCRATCH_NEURONS records read with `read_records` at
    several miss densities, gate rows + records read contiguously (dense streaming), and
    the up / down / gate row kernels on records just read; each the best of a few
    repeats. About two seconds. (Timing the sparse executor itself, reads overlapped
    with its compute, predicts 1.4-1.6x too slow: in a real token attention also hides
    reads.) `python benchmarks/offload.py` sets the prediction against the measurement.
    """
    from edgerun.offload.bundle import Bundle
    from edgerun.offload.io import aligned_empty
    from edgerun.offload.plan import SCRATCH_NEURONS
    from edgerun.ops import sparse_ffn as sf
    from edgerun.runtime.cpu_share import set_threads

    set_threads(threads)
    rng = np.random.default_rng(2)
    with Bundle(bundle_file, threads=io_threads) as b:
        layers = b.layers
        ly = b.layer(layers[0])
        n, d = ly.d_ff, ly.d_model
        chunk = min(n, SCRATCH_NEURONS)
        rec = aligned_empty(chunk * ly.record_bytes).reshape(chunk, ly.record_bytes)
        gate = aligned_empty(chunk * ly.gate_row_bytes).reshape(chunk, ly.gate_row_bytes)
        x = rng.standard_normal(d).astype(np.float32)
        out = np.zeros(d, np.float32)
        coeff = rng.standard_normal(chunk).astype(np.float32)

        def compute(m: int) -> None:
            up = sf.matvec_rows(ly.up_format, d, rec[:m], None, x)
            sf.accumulate_q8_0_rows(rec[:m], coeff[:m] * up, out, None, offset=ly.up_row_bytes)

        compute(chunk)  # compile / warm
        sf.matvec_rows(ly.gate_format, d, gate, None, x)
        pick = iter(layers[i % len(layers)] for i in range(1, 10**6))

        read: list[tuple[float, float]] = []
        for q in DENSITIES:
            ids = np.flatnonzero(rng.random(n) < q).astype(np.int32)
            if ids.size == 0:
                ids = np.array([n // 2], np.int32)

            def read_sparse(ids=ids) -> None:
                layer = next(pick)  # another layer each time: nothing is cached anywhere
                for c0 in range(0, ids.size, chunk):
                    m = ids[c0 : c0 + chunk]
                    b.read_records(layer, m, out=rec[: m.size])

            read.append((q, _best(read_sparse, 3) / ids.size))
        ids = np.arange(n, dtype=np.int32)

        def read_stream() -> None:  # dense streaming's reads: gate rows + records
            layer = next(pick)
            for c0 in range(0, n, chunk):
                m = ids[c0 : c0 + chunk]
                b.read_gate_rows(layer, m, out=gate[: m.size])
                b.read_records(layer, m, out=rec[: m.size])

        stream_s = _best(read_stream, 3) / n
        # Records just read (not cache-warm): compute over a full layer's worth of chunks.
        bufs = [rec.copy() for _ in range(max(1, min(8, n // chunk)))]

        def compute_all() -> None:
            for r in bufs:
                up = sf.matvec_rows(ly.up_format, d, r, None, x)
                sf.accumulate_q8_0_rows(r, coeff * up, out, None, offset=ly.up_row_bytes)

        neuron_s = _best(compute_all, 3) / (len(bufs) * chunk)
        gate_s = _best(lambda: sf.matvec_rows(ly.gate_format, d, gate, None, x), 5) / chunk
    return OffloadFigures(
        sparse_read_s=tuple(read),
        stream_read_s=stream_s,
        neuron_compute_s=neuron_s,
        gate_compute_s=gate_s,
    )


def offload_figures(bundle_file: Path, threads: int, refresh: bool = False) -> OffloadFigures:
    """measure_offload for `bundle_file`, cached beside the device figures."""
    from edgerun.registry import cache_dir
    from edgerun.runtime.atomic import write_bytes_atomic

    key = _key(threads, bundle_file.parent, None)
    path = cache_dir() / "calibration" / f"{bundle_file.stem}-{key}.offload.json"
    d = None if refresh else _fresh(path)
    if d is not None:
        try:
            return OffloadFigures(**_pairs(d, "sparse_read_s"))
        except (KeyError, TypeError):
            pass  # broken: measured again
    figs = measure_offload(bundle_file, threads)
    write_bytes_atomic(path, json.dumps(asdict(figs), indent=1).encode())
    return figs
