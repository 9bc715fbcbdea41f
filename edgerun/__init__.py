"""edgerun: on-device LLM inference in pure numpy + Numba.

import edgerun
model = edgerun.load("smollm2-135m")
print(model.chat([{"role": "user", "content": "hi"}], max_tokens=32))
"""

from edgerun import _numba_env

_numba_env.configure()

from edgerun.api import Model, load  # noqa: E402
from edgerun.engine import GenerationStats  # noqa: E402
from edgerun.errors import EdgerunError  # noqa: E402
from edgerun.sampling import SamplingParams  # noqa: E402

__all__ = ["EdgerunError", "GenerationStats", "Model", "SamplingParams", "load"]
__version__ = "0.1.0"
