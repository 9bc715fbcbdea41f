"""Weights on a torch device: a QuantTensor dequantized once, at load, to a dense dtype.

Why dense: low-bit weights with on-the-fly dequantization in plain torch ops materialize
the dense matrix on every call, 7-17x slower than reading f16 and less exact, and a fused
low-bit kernel would need a custom CUDA/Triton kernel per block format, which a
torch-only path does not have. So weights are dequantized at load (with the numpy
reference dequantizers of quant/reference.py, every format the registry models use).

One ``F.linear`` on the torch CPU device (torch 2.13.0+cpu, 2 cores, median of 20, random
weights; max error against a float64 product):

    matvec (n=1)             1536x576 (SmolLM2 FFN)  8960x1536 (Qwen 1.5B)   4096x4096
    f32                      0.12 ms, err 9e-7       4.59 ms, err 3e-6       4.51 ms, err 3e-6
    f16                      0.12 ms, err 2e-3       2.48 ms, err 2e-3       2.55 ms, err 2e-3
    bf16                     0.13 ms, err 1e-2       3.04 ms, err 1e-2       2.72 ms, err 1e-2
    int8 + row scale,        0.27 ms, err 3e-2      32.9  ms, err 4e-2      43.7  ms, err 4e-2
      dequantized per call

    prefill (n=64), 8960x1536: f32 49.9 ms, f16 122 ms, bf16 143 ms

End to end on SmolLM2-135M (Q4_1), all 30 layers' FFN + attention on the torch CPU
device, 64 teacher-forced tokens, logits up to |33|: max |logit diff| against the CPU
kernels 3.5e-5 (f32), 0.040 (f16), 0.37 (bf16); argmax agreement 100% for all three.
`bash benchmarks/gpu_check.sh` measures decode and prefill on a CUDA GPU against the CPU.

- CUDA: f16 (half the bytes of f32 per matvec; tensor cores for prefill; f16 keeps
  10 mantissa bits against bf16's 7, and the activations that could overflow it are
  computed in f32, see executors.py).
- CPU (``--gpu-device cpu``, the tested path): f32. It matches the CPU kernels best
  (error 1e-6 against 1e-3) and CPU f16/bf16 matmul is 2.5-3x slower for prefill.
"""

from __future__ import annotations

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.quant.formats import QuantTensor
from edgerun.quant.reference import dequantize

from . import import_torch

__all__ = ["DTYPES", "dtype_name", "element_bytes", "default_dtype", "torch_dtype", "to_device"]

# accepted names -> canonical name, bytes per element
DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("float16", 2),
    "f16": ("float16", 2),
    "half": ("float16", 2),
    "bfloat16": ("bfloat16", 2),
    "bf16": ("bfloat16", 2),
    "float32": ("float32", 4),
    "f32": ("float32", 4),
    "float": ("float32", 4),
}

# host memory for one dequantized chunk: big matrices go over in pieces, so loading
# never holds a whole float32 copy of a large matrix on the host
_CHUNK_BYTES = 32 << 20


def dtype_name(dtype) -> str:
    """A dtype given as a name ("f16", "float32", ...) or a torch.dtype -> canonical name."""
    if dtype is None:
        raise InvalidArgumentError("dtype_name: no dtype given")
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise InvalidArgumentError(
            f"unknown device weight dtype {dtype!r}: use float16, bfloat16 or float32"
        )
    return DTYPES[key][0]


def element_bytes(dtype) -> int:
    return DTYPES[dtype_name(dtype)][1]


def default_dtype(device) -> str:
    """f16 on CUDA, f32 on the CPU (see the measurements above)."""
    return "float16" if str(device).startswith("cuda") else "float32"


def torch_dtype(dtype):
    torch = import_torch()
    return getattr(torch, dtype_name(dtype))


def to_device(t: QuantTensor, device, dtype, out=None):
    """A 2-D QuantTensor as a dense torch tensor [rows, cols] of `dtype` on `device`,
    dequantized with the numpy reference a chunk of rows at a time. `out`: a tensor of
    that shape on the device to fill instead (e.g. a slice of a fused q|k|v matrix)."""
    torch = import_torch()
    tdt = torch_dtype(dtype)
    r0, r1 = 0, t.rows
    data = np.asarray(t.data).view(np.uint8).reshape(t.rows, -1)
    if out is None:
        out = torch.empty((t.rows, t.cols), dtype=tdt, device=device)
    elif tuple(out.shape) != t.shape:
        raise InvalidArgumentError(
            f"to_device: {t.name} {t.shape} does not fit a tensor of shape {tuple(out.shape)}"
        )
    step = max(1, _CHUNK_BYTES // max(1, 4 * t.cols))
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        chunk = dequantize(t.qtype, data[a:b])  # a fresh float32 array (F32 too: a copy)
        if chunk.shape != (b - a, t.cols):
            raise InvalidArgumentError(
                f"to_device: {t.name} dequantized to {chunk.shape}, expected {(b - a, t.cols)}"
            )
        out[a - r0 : b - r0].copy_(torch.from_numpy(chunk))
    return out
