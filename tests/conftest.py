import os
import sys
from pathlib import Path

import pytest

from edgerun import registry

# Helpers that tests in several folders share: tests/hostile.py, tests/data/, and the
# import walker of tests/meta/test_layering.py
_HERE = Path(__file__).resolve().parent
for _d in (_HERE, _HERE / "data", _HERE / "meta", _HERE / "model"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

# Under pytest-xdist (`-n 2`, the README's test command) two workers compile into one
# Numba cache at once. Numba saves each file atomically, but two processes saving
# different signatures of one function can cross its index entries; the per-function lock
# (runtime/numba_cache_lock.py) prevents that, and a worker that waited for the other's
# compile of a kernel loads it from the cache instead of compiling it again.
if os.environ.get("PYTEST_XDIST_WORKER"):
    from edgerun.runtime.numba_cache_lock import install as _lock_numba_cache

    _lock_numba_cache()


@pytest.fixture(scope="session")
def smollm2_path():
    """The real default model. Fails (does not skip) when it is not installed."""
    m = registry.find("smollm2-135m")
    return registry.resolve_path(m)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    import edgerun

    return edgerun.load(smollm2_path, n_ctx=1024, threads=2)


@pytest.fixture(scope="module")
def resident(smollm2_path):
    """SmolLM2 resident with a 256-token context, on the row kernels (no interleaved
    copies): the reference offloaded and placed models are compared with, bit for bit."""
    import edgerun

    return edgerun.load(smollm2_path, n_ctx=256, threads=2, interleave=False)


@pytest.fixture(scope="module")
def text_ids(resident):
    """48 tokens of real text: a prompt and the resident model's greedy continuation."""
    prompt = "The three primary colours are red, yellow and"
    out = list(resident.generate(resident.tokenize(prompt), max_tokens=40, temperature=0.0))
    return resident.tokenize(prompt + "".join(out))[:48]
