"""Is the llama.cpp reference usable here? Probed in a child process, once per model.

llama-cpp-python is only a speed and memory reference for the benchmarks. A build can
import and still crash on its first decode: a wheel compiled with -DGGML_NATIVE=ON on
another CPU (AMX, AVX-512 kernels) dies with SIGSEGV or SIGILL here. A crash in the
benchmark's own process would take the edgerun figures with it, so the benchmarks ask
this module first and measure edgerun alone, saying why, when the reference fails.
"""

from __future__ import annotations

import functools
import importlib.util
import signal
import subprocess
import sys

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36'
# A preinstalled native build died with SIGSEGV on its first decode on an Intel Xeon with
# AMX (a 2-vCPU VM); this one, AVX-512 VNNI without AMX, built from the sdist, ran there
INSTALL_NO_AMX = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
    "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
    "-DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
    '-DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36'
)

_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=32, n_threads=1, n_threads_batch=1, verbose=False)
llm.eval([llm.token_bos() if llm.token_bos() >= 0 else 1, 100, 200])
print("ok")
"""


def describe_exit(returncode: int) -> str:
    """'exit 1' or 'signal SIGSEGV' for a child's return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


@functools.cache
def llama_cpp_unusable(model_path: str, timeout_s: float = 300.0) -> str | None:
    """None when llama.cpp loads `model_path` and decodes; otherwise why it cannot."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; for the comparison:\n  {INSTALL}"
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, model_path],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"llama-cpp-python did not decode {model_path} within {timeout_s:.0f} s"
    if out.returncode == 0 and out.stdout.strip().endswith("ok"):
        return None
    tail = out.stderr.strip().splitlines()[-1:] or [""]
    return (
        f"llama-cpp-python is installed but its probe decode of {model_path} failed "
        f"({describe_exit(out.returncode)}) {tail[0]}".rstrip()
        + f"; a build for this CPU:\n  pip uninstall -y llama-cpp-python && {INSTALL}"
        + f"\nor, where a native build crashes, one without AMX:\n  {INSTALL_NO_AMX}"
    )
