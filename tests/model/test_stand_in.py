"""A first run's compile children load stand-in weights (offload/stand_in.py): the file's
tensor table over zero pages, so a child holds no copy of the model, yet gives every
kernel the argument types the real weights give (the signatures the serving process
then loads from the cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest


def _rss() -> int:
    from edgerun.runtime.sysinfo import proc_status_bytes

    return proc_status_bytes("VmRSS") or 0


def test_reading_zero_pages_takes_no_resident_memory():
    from edgerun.offload.stand_in import zero_pages

    a = zero_pages((64, 1 << 20))  # 64 MiB
    before = _rss()
    assert int(a.sum(dtype=np.int64)) == 0 and not a.flags.writeable
    assert _rss() - before < 8 << 20


def _kernel_types(model) -> list[tuple]:
    from numba import typeof

    from edgerun.model.kvcache import KVCache

    t = model.engine.transformer
    calls = t.decode_kernels(KVCache(model.spec, 16, model.kv_type))

    def type_of(a) -> object:  # a kernel's Numba type; a plain function's argument: its class
        try:
            return typeof(a)
        except ValueError:
            return type(a)

    return [
        (getattr(k, "py_func", k).__qualname__, tuple(type_of(a) for a in args))
        for k, args in calls
    ]


def test_stand_in_weights_give_the_kernels_the_real_argument_types(smollm2_path):
    """The decode step's kernels (DecodeStep.kernels, the model's own list) take the same
    Numba types on stand-ins as on the weights, interleaved copies included, and the
    stand-in model's decode step reads its matrices without making them resident."""
    import edgerun
    from edgerun.generate.engine import _weight_matrices
    from edgerun.tools.warm_kernels import stand_in_weights

    real = edgerun.load(smollm2_path, n_ctx=16, threads=1, kv_type="f32")
    real.engine.warm_part("decode")
    before = _rss()
    with stand_in_weights():
        stand = edgerun.load(smollm2_path, n_ctx=16, threads=1, kv_type="f32")
    stand.engine.warm_part("decode")  # reads every matrix (or its copy) once
    grown = _rss() - before
    kernels = _kernel_types(real)
    assert kernels and _kernel_types(stand) == kernels
    from numba import typeof

    ws, ss = (_weight_matrices(m.engine.transformer) for m in (real, stand))
    assert [w.name for w in ws] == [s.name for s in ss]
    for w, s in zip(ws, ss):
        assert (s.qtype, s.shape, typeof(s.data)) == (w.qtype, w.shape, typeof(w.data))
        if w.interleaved is None:
            assert s.interleaved is None
        else:
            assert s.interleaved.shape == w.interleaved.shape
            assert typeof(s.interleaved) == typeof(w.interleaved)
            assert not s.interleaved.any()  # zero pages, not a copy
    # the real model's copies alone take about the file's size (98 MB)
    assert grown < os.path.getsize(smollm2_path) // 3, grown


@pytest.mark.slow
def test_after_the_children_the_serving_process_compiles_nothing(smollm2_path, tmp_path):
    """On an empty cache, KernelPool children (stand-in weights) compile the parts one
    answer runs; the serving process then loads the real model and runs those parts
    without compiling a function: the children cached the signatures it takes."""
    code = f"""
import json, edgerun
from numba.core import event
from edgerun.offload.warm_kernels import KernelPool
from edgerun.ops import qmatvec

parts = ["tokenizer", "prompt", "decode"]
pool = KernelPool.start({str(smollm2_path)!r}, "f32", qmatvec.kernel_path(), parts, workers=2)
pool.wait(parts)
pool.close()
done = sorted(pool.state.done)
compiled = pool.compiled()
with event.install_recorder("numba:compile") as rec:
    m = edgerun.load({str(smollm2_path)!r}, kv_type="f32")
    m.engine.warm_up(parts)
here = sum(1 for e in rec.buffer if e[1].is_start)
print(json.dumps(dict(done=done, compiled=compiled, here=here)))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))  # cold
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["done"] == ["decode", "prompt", "tokenizer"]
    assert res["compiled"] > 10  # the children did compile, on a cold cache
    assert res["here"] == 0
