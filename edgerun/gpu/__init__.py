"""Hot layers on a torch device; the CPU computes the rest.

torch is imported lazily, only here and in this package's modules, and only when a
device is asked for: the CPU path never needs it. ``--gpu-device cpu`` runs the same
torch path on the CPU, so it is tested on machines without a GPU.

- ``import_torch()``: the torch module, or GpuUnavailableError naming the extra.
- ``resolve_device(name)``: "cpu", "cuda", "cuda:N" -> torch.device.
- ``weights``: QuantTensor -> dense tensor on the device (the dtype choice, measured).
- ``executors``: TorchFFN (an FFNExecutor) and TorchProjections (attention q, k, v, o).
- ``place``: move_layers(...) -> GpuPlacement; layer_device_bytes(spec, dtype).
- ``calibrate``: measure_device(device) -> matvec and transfer figures for a planner.
"""

from __future__ import annotations

import re

from edgerun.errors import GpuUnavailableError, InvalidArgumentError

__all__ = ["GpuUnavailableError", "import_torch", "resolve_device", "DEVICE_NAMES"]

DEVICE_NAMES = ("cpu", "cuda", "cuda:N")
_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def import_torch():
    """The torch module; GpuUnavailableError when it is not installed."""
    try:
        import torch
    except ImportError as e:
        raise GpuUnavailableError(
            "placing layers on a torch device needs PyTorch, which is not installed: "
            "pip install 'edgerun[gpu]' (or install a torch build for your GPU from "
            "https://pytorch.org), or run without --gpu-budget/--gpu-device"
        ) from e
    return torch


def resolve_device(name: str):
    """ "cpu", "cuda" or "cuda:N" -> torch.device, checked against what is visible."""
    m = _DEVICE_RE.match(name.strip().lower()) if isinstance(name, str) else None
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise InvalidArgumentError(
            f"unknown GPU device {name!r}: use 'cpu' (the torch path on the CPU, for "
            "testing), 'cuda' or 'cuda:N' (N = the device index)"
        )
    torch = import_torch()
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = getattr(torch.version, "cuda", None)
        why = (
            "this torch build has no CUDA support"
            if not build
            else f"torch {torch.__version__} (CUDA {build}) sees no GPU"
        )
        raise GpuUnavailableError(
            f"GPU device {name!r} asked for, but no CUDA device is visible ({why}); "
            "use --gpu-device cpu to test the torch path on the CPU, or run without "
            "--gpu-budget/--gpu-device"
        )
    if index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if int(index) >= count:
        raise InvalidArgumentError(
            f"GPU device {name!r}: only {count} CUDA device(s) visible (cuda:0"
            f"{f'..cuda:{count - 1}' if count > 1 else ''})"
        )
    return torch.device("cuda", int(index))
