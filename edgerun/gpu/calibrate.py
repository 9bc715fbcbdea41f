"""Measure a torch device for a planner: matvec throughput and transfer costs (< 3 s).

``measure_device("cuda")`` ->
    {
      "device": "cuda:0", "dtype": "float16",
      "matvec_bytes_per_s": weight bytes read per second by a [4096, 4096] matvec,
      "matvec_seconds": one such matvec (median),
      "roundtrip_seconds": one d_model-sized (4096 float32) vector host -> device ->
                           host, as each executor call does (median),
      "h2d_bytes_per_s", "d2h_bytes_per_s": a 64 MiB float32 copy each way (median),
      "seconds": how long the measurement took,
    }
Timings use torch.cuda.synchronize on CUDA; host buffers are ordinary (pageable)
numpy-backed memory, as the executors use.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from . import import_torch, resolve_device
from .weights import default_dtype, dtype_name, element_bytes, torch_dtype

__all__ = ["measure_device"]


def measure_device(
    device: str = "cuda",
    dtype=None,
    dim: int = 4096,
    vector: int = 4096,
    copy_bytes: int = 64 << 20,
    repeats: int = 7,
) -> dict:
    """Short measurement of `device` (see the module doc for the keys)."""
    torch = import_torch()
    t_start = time.perf_counter()
    dev = resolve_device(device)
    dt = dtype_name(dtype if dtype is not None else default_dtype(dev))
    tdt = torch_dtype(dt)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn, n: int = repeats) -> float:
        fn()  # warm-up: kernel selection, allocator
        sync()
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.rand((dim, dim), generator=gen) - 0.5).to(dev, tdt)
    x = (torch.rand((1, dim), generator=gen) - 0.5).to(dev, tdt)
    linear = torch.nn.functional.linear
    mv = timed(lambda: linear(x, w), n=max(repeats, 11))

    host_vec = np.random.default_rng(0).standard_normal((1, vector)).astype(np.float32)

    def roundtrip() -> None:
        torch.from_numpy(host_vec).to(dev).to("cpu").numpy()

    rt = timed(roundtrip, n=max(repeats, 21))

    n_el = copy_bytes // 4
    host_big = torch.from_numpy(np.ones(n_el, np.float32))
    dev_big = host_big.to(dev) if cuda else host_big.clone()
    h2d = timed(lambda: dev_big.copy_(host_big), n=repeats)
    back = torch.empty_like(host_big)
    d2h = timed(lambda: back.copy_(dev_big), n=repeats)
    return {
        "device": str(dev),
        "dtype": dt,
        "matvec_bytes_per_s": dim * dim * element_bytes(dt) / mv,
        "matvec_seconds": mv,
        "roundtrip_seconds": rt,
        "h2d_bytes_per_s": n_el * 4 / h2d,
        "d2h_bytes_per_s": n_el * 4 / d2h,
        "seconds": time.perf_counter() - t_start,
    }
