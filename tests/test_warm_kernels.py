"""Kernels are compiled in a child before a budgeted load, so the compiler's memory
never sits beside the budgeted weights (edgerun/tools/warm_kernels.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_budgeted_load_on_a_cold_cache_compiles_nothing_itself(smollm2_path, tmp_path):
    code = f"""
import json, edgerun
from edgerun.api import minimum_ram_budget
from edgerun.ops import qmatvec
from edgerun.tools.warm_kernels import ensure_kernels_compiled, warm_marker
need = minimum_ram_budget({str(smollm2_path)!r}, n_ctx=256)
m = edgerun.load({str(smollm2_path)!r}, n_ctx=256, threads=2, ram_budget=int(need * 1.1))
w = m.warm_up()
marker = warm_marker({str(smollm2_path)!r}, m.kv_type, qmatvec.kernel_path())
again = ensure_kernels_compiled({str(smollm2_path)!r}, m.kv_type, qmatvec.kernel_path())
print(json.dumps(dict(store=type(m.store).__name__, compiled=w.compiled,
                      marker=marker.exists(), again=again)))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))  # cold
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["store"] == "DenseStreamStore"
    assert res["marker"] and not res["again"]  # warmed once, then skipped
    assert res["compiled"] == 0  # the streamed and held rows hit the child's kernels
