"""Kernels are compiled in children before a budgeted load, so the compiler's memory
never sits beside the budgeted weights, and each child stays within what the budget
leaves (edgerun/offload/warm_kernels.py)."""

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
from edgerun.offload.warm_kernels import ensure_kernels_compiled, warm_marker
need = minimum_ram_budget({str(smollm2_path)!r}, n_ctx=256)
m = edgerun.load({str(smollm2_path)!r}, n_ctx=256, threads=2, ram_budget=int(need * 1.1))
w = m.warm_up()
marker = warm_marker({str(smollm2_path)!r}, m.kv_type, qmatvec.kernel_path())
again = ensure_kernels_compiled({str(smollm2_path)!r}, m.kv_type, qmatvec.kernel_path())
print(json.dumps(dict(store=type(m.store).__name__, compiled=w.compiled,
                      marker=marker.read_text(), again=again)))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))  # cold
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["store"] == "DenseStreamStore"
    assert not res["again"]  # warmed once, then skipped
    # The budget (the minimum + 10%) leaves the children less than all of the compiles
    # take, so each stopped at its ceiling and the next went on from the cache
    words = res["marker"].split()  # "N functions compiled in S s by K processes"
    assert words[1:3] == ["functions", "compiled"] and int(words[0]) > 10, res["marker"]
    assert int(words[-2]) > 1, res["marker"]
    assert res["compiled"] == 0  # the streamed and held rows hit the children's kernels


@pytest.mark.slow
def test_after_the_warm_up_no_kernel_loads_even_for_rows_held_later(smollm2_path):
    """The warm-up loads every kernel decode and prompts use, for every weight format,
    including rows dense offloading holds only after it: a kernel loaded later runs LLVM,
    which faults its library back into the page cache the warm-up gave back (70 MiB on
    the 1.5B). Counted as Numba signatures, in a fresh process."""
    code = f"""
import json, sys, edgerun
from numba.core.registry import CPUDispatcher
from edgerun.api import minimum_ram_budget

def signatures():
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("edgerun"):
            n += sum(len(v.signatures) for v in vars(mod).values()
                     if isinstance(v, CPUDispatcher))
    return n

need = minimum_ram_budget({str(smollm2_path)!r}, n_ctx=256)
m = edgerun.load({str(smollm2_path)!r}, n_ctx=256, threads=2, offload="dense",
                 ram_budget=int(need * 1.1),
                 offload_options=dict(kv_loan_tiers=0, hold_after_warm_up=False))
m.warm_up()
m.store.hold_more(4 << 20)  # rows held after the warm-up
# and rows lent on the budget's unused memory (offload/kv_loan.py): a third part of
# each matrix, which once took a kernel signature the warm-up had not loaded
loan = m.store.lend(4 << 20)
assert loan is not None
warm = signatures()
prompt = "The three laws of thermodynamics are " * 20  # past MVB_PREFILL_MAX: GEMMs
list(m.generate(prompt, max_tokens=8, temperature=0))
s = m.session()
s.send("Hi", max_tokens=4)
print(json.dumps(dict(warm=warm, after=signatures(), held=m.store.held_neurons)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["held"] > 0 and res["warm"] > 0
    assert res["after"] == res["warm"]
