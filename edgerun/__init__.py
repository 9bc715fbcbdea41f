"""edgerun: on-device LLM inference in pure numpy + Numba.

import edgerun
model = edgerun.load("smollm2-135m")
print(model.chat([{"role": "user", "content": "hi"}], max_tokens=32))
"""

from edgerun import _numba_env

_numba_env.configure()

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from edgerun.api import Model, load
    from edgerun.engine import GenerationStats
    from edgerun.errors import EdgerunError
    from edgerun.sampling import SamplingParams
    from edgerun.sched.batching import Request, ResponseStats
    from edgerun.session import Session

__all__ = [
    "EdgerunError",
    "GenerationStats",
    "Model",
    "Request",
    "ResponseStats",
    "SamplingParams",
    "Session",
    "load",
]
__version__ = "0.1.0"

# The public names load lazily, so importing a lower layer (edgerun.quant,
# edgerun.formats, ...) does not pull in the model, the engine and the kernels.
_LAZY = {
    "Model": "edgerun.api",
    "load": "edgerun.api",
    "GenerationStats": "edgerun.engine",
    "EdgerunError": "edgerun.errors",
    "SamplingParams": "edgerun.sampling",
    "Session": "edgerun.session",
    "Request": "edgerun.sched.batching",
    "ResponseStats": "edgerun.sched.batching",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'edgerun' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
