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


# -- the first run's KernelPool (offload/warm_kernels.py) and its display (tools/first_run.py)

# A stand-in child speaking tools/warm_kernels.py --serve's lines (no Numba: fast), which
# exits with status 3 when handed the part "die".
_FAKE_CHILD = """
import sys, time
delay = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0  # seconds a part takes
print("loaded 2 0.1", flush=True)
n = 2
for line in sys.stdin:
    part = line.strip()
    if part == "die":
        sys.exit(3)
    time.sleep(delay)
    print(f"fn kernel_{part}", flush=True)
    n += 3
    print(f"done {part} {n} 0.2", flush=True)
print(f"compiled {n} 0.3", flush=True)
"""


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_the_pool_compiles_each_part_once_and_marks_it(fake_model):
    from edgerun.offload.warm_kernels import KernelPool, part_marker

    parts = ["prompt", "decode", "batch"]
    cmd = [sys.executable, "-c", _FAKE_CHILD]
    pool = KernelPool.start(fake_model, "f32", "vnni", parts, workers=2, command=cmd)
    assert pool is not None and pool.processes == 2
    assert pool.wait(parts)
    pool.close()
    st = pool.state
    assert sorted(st.done) == sorted(parts) and not st.failed and st.functions == 3
    # each child counted its load's 2 compilations, then 3 a part it ran
    assert pool.compiled() == 2 * 2 + 3 * 3
    assert all(c.proc.returncode == 0 for c in pool.children)
    for p in parts:
        assert part_marker(fake_model, "f32", "vnni", "auto", p).exists()
    # marked parts are not compiled again; another kernel path or KV type is
    assert KernelPool.start(fake_model, "f32", "vnni", parts, command=cmd) is None
    again = KernelPool.start(fake_model, "f16", "vnni", ["decode"], workers=1, command=cmd)
    assert again is not None
    again.close()


def test_a_child_that_dies_leaves_its_part_to_the_caller(fake_model):
    from edgerun.offload.warm_kernels import KernelPool, part_marker

    cmd = [sys.executable, "-c", _FAKE_CHILD]
    pool = KernelPool.start(fake_model, "f32", "vnni", ["die", "prompt"], workers=1, command=cmd)
    assert pool is not None
    assert not pool.wait(["die", "prompt"])  # its only child died in "die"
    pool.close()
    assert pool.state.failed == {"die", "prompt"} and not pool.state.done
    assert not part_marker(fake_model, "f32", "vnni", "auto", "die").exists()


def test_parts_never_started_count_as_finished_once_the_pool_closes(fake_model):
    from edgerun.offload.warm_kernels import KernelPool

    cmd = [sys.executable, "-c", _FAKE_CHILD]
    pool = KernelPool.start(fake_model, "f32", "vnni", ["decode"], workers=1, command=cmd)
    assert pool is not None
    assert pool.wait(["decode"]) and pool.finished(["decode", "never asked"])
    with pool.cond:  # queued, not handed to the (idle) child yet
        pool.state.parts.append("prompt")
        pool.queue.append("prompt")
    assert not pool.finished(["prompt"])
    pool.close()
    # a prompt waiting on it takes its own kernels (compiling them) rather than wait on
    assert pool.finished(["prompt"]) and "prompt" not in pool.state.done


def test_a_prompt_takes_one_token_steps_while_its_kernels_compile(smollm2_path, monkeypatch):
    """A first run's prompt goes through the one-token step while other processes still
    compile the prompt's kernels (waiting once for the step's own), then in chunks. A
    model of its own: the test sets the engine's first-run hooks."""
    import numpy as np

    import edgerun
    from edgerun.generate.engine import Generator

    e = edgerun.load(smollm2_path, n_ctx=256, threads=2).engine
    sizes = []
    cls = type(Generator(e).model)  # what a generator's prefill calls
    real = cls.forward

    def spy(self, tokens, cache, all_logits=False):
        sizes.append(len(tokens))
        return real(self, tokens, cache, all_logits)

    ids = list(range(10, 20))
    ref = Generator(e).prefill(ids)
    monkeypatch.setattr(cls, "forward", spy)
    pending = iter([True] * 3 + [False] * 100)
    waited = []
    e.kernels_pending = lambda: waited.append(1)
    e.prompt_kernels_pending = lambda: next(pending)
    gen = Generator(e)
    logits = gen.prefill(ids)
    assert sizes == [1, 1, 1, 6, 1] and waited == [1]
    assert e.prompt_kernels_pending is None and e.kernels_pending is None
    assert gen.cache.tokens == ids
    # other kernels round differently: close, the same next token
    assert np.argmax(logits) == np.argmax(ref) and np.allclose(logits, ref, atol=0.05)


def test_first_run_prints_whole_lines_off_a_terminal(fake_model):
    import io

    from edgerun.tools.first_run import FirstRun

    out = io.StringIO()
    cmd = [sys.executable, "-c", _FAKE_CHILD]
    run = FirstRun.start(fake_model, "f32", ["prompt", "decode"], stream=out, command=cmd)
    assert run is not None
    run.wait_loaded()
    run.wait_all()
    warm = run.finish()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # what happens, and why only once
    assert "compiling this model's kernels" in lines[0] and "once" in lines[0]
    steps = [line for line in lines[1:] if line.startswith("compiling kernels")]
    # the load, the tokenizer (before this process encodes its prompt), the parts
    assert steps[0].endswith("0/4 steps (0%)") and "4/4 steps (100%), done in" in steps[-1]
    assert sorted(run.pool.state.done) == ["decode", "prompt", "tokenizer"]
    assert warm.processes == run.pool.processes and warm.compiled == run.pool.compiled()
    assert "processes" in str(warm)


def test_the_first_token_waits_for_no_prompt_kernel(fake_model):
    """A first answer's children compile the decode step's kernels before the prompt's
    ("prompt", "gemm"): the first token waits for the decode step's alone (the prompt
    takes one-token steps meanwhile). One child, so the parts run in the queue's order."""
    import io
    from types import SimpleNamespace

    from edgerun.generate.engine import DECODE_KERNEL_PARTS
    from edgerun.tools.first_run import FirstRun

    cmd = [sys.executable, "-c", _FAKE_CHILD, "0.2"]
    started = ["tokenizer", *DECODE_KERNEL_PARTS, "decode", "prompt"]  # as `generate` does
    run = FirstRun.start(fake_model, "f32", started, stream=io.StringIO(), workers=1, command=cmd)
    assert run is not None
    run.wait_loaded()
    transformer = SimpleNamespace(decode_kernels=lambda cache: [None] * len(DECODE_KERNEL_PARTS))
    engine = SimpleNamespace(new_cache=lambda n: None, transformer=transformer)
    model = SimpleNamespace(engine=engine, warm_up=lambda parts: None)
    # a prompt long enough for the GEMMs (SmolLM2's README question: Engine.answer_parts)
    run.warm(model, ("tokenizer", "prompt", "gemm", "decode"))
    assert run.first_step == list(DECODE_KERNEL_PARTS)
    engine.kernels_pending()  # the first one-token step's wait
    st = run.pool.state
    assert set(DECODE_KERNEL_PARTS) <= set(st.done)
    assert "prompt" not in st.done and "gemm" not in st.done  # still to come
    run.wait_all()
    run.finish()
    order = list(st.done)
    assert order.index("gemm") > order.index("decode") > max(map(order.index, DECODE_KERNEL_PARTS))


def test_an_embedding_kernel_compiles_its_own_format_alone(tmp_path):
    """The decode step's embedding kernel of one format compiles that format's
    dequantiser, not every format's (deq_row, its grid and newer formats' branches),
    and gives the reference's rows. On an empty cache, in a process of its own."""
    code = """
import json
import numpy as np
from numba.core import event
from edgerun.ops import qmatvec
from edgerun.quant.formats import QuantTensor, QuantType, row_bytes
from edgerun.quant.reference import dequantize

rng = np.random.default_rng(0)
names, equal = [], []
class Names(event.Listener):
    def on_start(self, ev):
        names.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Names())
for q in (QuantType.Q8_0, QuantType.Q4_K):
    data = rng.integers(0, 256, (8, row_bytes(q, 256)), dtype=np.uint8)
    rows = qmatvec.embedding_rows(QuantTensor("w", q, (8, 256), data), np.array([5, 2]))
    ref = dequantize(q, data)[[5, 2]]  # random f16 scales: some inf or NaN, in both
    equal.append(bool(np.array_equal(rows, ref, equal_nan=True)))
print(json.dumps(dict(names=names, equal=equal)))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))  # cold
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["equal"] == [True, True]
    kernels = [n for n in res["names"] if "embedding_rows" in n]
    assert len(kernels) == 2, res["names"]  # one a format
    assert not {"deq_row", "_deq_new", "deq_grid"} & set(res["names"]), res["names"]


# -- Numba's cache written by several processes (runtime/numba_cache_lock.py)

_TINY = "from numba import njit\n\n@njit(cache=True)\ndef add(a, b):\n    return a + b\n"

_COMPILER = """
import sys
from numba.core import event
from edgerun.runtime.numba_cache_lock import _function_lock, install, lock_path
install()
import tiny
compiles = []
class Count(event.Listener):
    def on_start(self, ev):
        compiles.append(1)
    def on_end(self, ev):
        pass
event.register("numba:compile", Count())
mode = sys.argv[1]
if mode == "hold":  # hold add's lock until told to go on, then compile under it
    with _function_lock(lock_path(tiny.add)):
        print("held", flush=True)
        sys.stdin.readline()
        tiny.add(1, 2)
    print(len(compiles), flush=True)
else:
    args = (1, 2) if mode == "int" else (1.5, 2.0) if mode == "float" else None
    results = [tiny.add(*args)] if args else [tiny.add(1, 2), tiny.add(1.5, 2.0)]
    print(len(compiles), *results, flush=True)
"""


def _tiny_env(tmp_path):
    (tmp_path / "tiny.py").write_text(_TINY)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


def test_a_process_that_waited_for_a_compile_loads_it_from_the_cache(tmp_path):
    env = _tiny_env(tmp_path)
    run = [sys.executable, "-c", _COMPILER]
    kw = dict(env=env, stdout=subprocess.PIPE, text=True)
    holder = subprocess.Popen([*run, "hold"], stdin=subprocess.PIPE, **kw)
    assert holder.stdout.readline().strip() == "held"
    waiter = subprocess.Popen([*run, "int"], **kw)
    try:
        waiter.wait(timeout=3)  # it blocks on the lock
        pytest.fail("the second process compiled while the first held the function's lock")
    except subprocess.TimeoutExpired:
        pass
    holder.stdin.write("go\n")
    holder.stdin.close()
    assert holder.stdout.read().split() == ["1"] and holder.wait() == 0
    out, _ = waiter.communicate(timeout=120)
    assert out.split() == ["0", "3"]  # no compile of its own: loaded the holder's


def test_two_processes_caching_signatures_of_one_function_keep_both(tmp_path):
    env = _tiny_env(tmp_path)
    run = [sys.executable, "-c", _COMPILER]
    kw = dict(env=env, stdout=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([*run, mode], **kw) for mode in ("int", "float")]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert outs == [["1", "3"], ["1", "3.5"]]
    # a third process loads both from the cache: its index kept both entries, each
    # naming its own machine code
    out = subprocess.run([*run, "both"], check=True, **kw).stdout.split()
    assert out == ["0", "3", "3.5"]
