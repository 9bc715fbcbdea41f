"""edgerun: on-device LLM inference in pure numpy + Numba.

import edgerun
model = edgerun.load("smollm2-135m")
print(model.chat([{"role": "user", "content": "hi"}], max_tokens=32))
"""

from edgerun.runtime import numba_env

numba_env.configure()

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from edgerun.api import Model, load
    from edgerun.errors import EdgerunError
    from edgerun.generate.engine import GenerationStats
    from edgerun.generate.sampling import SamplingParams
    from edgerun.serving.batching import Request, ResponseStats
    from edgerun.serving.session import Session

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
from edgerun._version import __version__ as __version__  # noqa: E402

# The public names load lazily, so importing a lower layer (edgerun.quant,
# edgerun.formats, ...) does not pull in the model, the engine and the kernels.
_LAZY = {
    "Model": "edgerun.api",
    "load": "edgerun.api",
    "GenerationStats": "edgerun.generate.engine",
    "EdgerunError": "edgerun.errors",
    "SamplingParams": "edgerun.generate.sampling",
    "Session": "edgerun.serving.session",
    "Request": "edgerun.serving.batching",
    "ResponseStats": "edgerun.serving.batching",
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
