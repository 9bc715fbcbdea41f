"""The bound one-token decode path (decode_step.py, ops/token_step.py) must give the
general forward pass's logits and KV rows bit for bit, and step aside wherever it does
not cover the model (hooks on the kernels, other executors, another kernel path)."""

from __future__ import annotations

import numpy as np
import pytest

import edgerun
from edgerun import registry
from edgerun.errors import ContextOverflowError
from edgerun.model.decode_step import DecodeStep
from edgerun.model.kvcache import KVCache
from edgerun.ops import qmatvec
from edgerun.ops.token_step import half_bits


def _general(tr) -> None:
    """Make the next forward calls take the general path."""
    tr._decode_step, tr._decode_key = False, tr._executors()


def _both(tr, kv_type: str, prompts: list[list[int]], steps: list[list[int]]):
    """Decode `steps` (one token per cache each) after `prompts` (one per cache) through
    the bound step and through the general path: (logits per step, caches) of each. One
    cache takes `forward`, several `forward_batch`."""
    out = []
    for bound in (True, False):
        caches = [tr.new_cache(32 + 5 * i, kv_type) for i in range(len(prompts))]
        for prompt, c in zip(prompts, caches):
            tr.forward(prompt, c)
        logits = []
        for tokens in steps:
            if bound:
                tr._decode_step = None
            else:
                _general(tr)
            if len(caches) == 1:
                logits.append(tr.forward(tokens, caches[0]))
            else:
                logits.append(tr.forward_batch(tokens, caches))
            assert isinstance(tr._decode_step, DecodeStep) is bound
            assert not bound or tr._decode_step._rows[len(caches)].key  # the bound rows ran
        out.append((logits, caches))
    tr._decode_step = None
    return out


def _assert_same(a, b) -> None:
    (la, ca), (lb, cb) = a, b
    for x, y in zip(la, lb):
        assert np.array_equal(x, y)
    for x, y in zip(ca, cb):
        assert x.tokens == y.tokens
        assert np.array_equal(x.k, y.k) and np.array_equal(x.v, y.v)
    for x, y in zip(ca, cb):  # both paths count the rows they wrote (clear() frees them)
        assert x.written == y.written == x.length


def _one(prompt: list[int], tokens: list[int]) -> tuple:
    return [prompt], [[t] for t in tokens]


def _several(n: int) -> tuple:
    """n prompts of different lengths, three steps."""
    return [list(range(1, 3 + 2 * i)) for i in range(n)], [
        [7 + i + 100 * step for i in range(n)] for step in range(3)
    ]


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0", "q4_0"])
def test_bound_decode_equals_general_path_smollm2(smollm2, kv_type):
    tr = smollm2.transformer
    assert DecodeStep.supports(tr)
    _assert_same(*_both(tr, kv_type, *_one([1, 504, 2823, 28], [30, 7, 1234, 49151, 2])))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_bound_decode_equals_general_path_other_families(name):
    """Qwen2 (q/k/v biases, mixed Q5_0/Q8_0/Q6_K), Gemma 3 (q/k norms, post norms, GELU,
    sliding windows, per-layer RoPE bases, embedding scale, logit softcap)."""
    model = edgerun.load(registry.resolve_path(registry.find(name)), n_ctx=64, threads=2)
    tr = model.transformer
    assert DecodeStep.supports(tr)
    for kv_type in ("f32", "f16", "q8_0", "q4_0"):
        _assert_same(*_both(tr, kv_type, *_one([2, 100, 2000, 31], [9, 404, 17, 3])))


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0", "q8_0/f16"])
@pytest.mark.parametrize("n", [2, 4])
def test_bound_batch_equals_general_path_smollm2(smollm2, kv_type, n):
    _assert_same(*_both(smollm2.transformer, kv_type, *_several(n)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_bound_batch_equals_general_path_other_families(name):
    model = edgerun.load(registry.resolve_path(registry.find(name)), n_ctx=64, threads=2)
    for kv_type in ("f32", "f16", "q8_0", "q4_0"):
        _assert_same(*_both(model.transformer, kv_type, *_several(3)))


def test_mixed_cache_types_take_the_general_path(smollm2):
    tr = smollm2.transformer
    caches = [KVCache(tr.spec, 16, "f32"), KVCache(tr.spec, 16, "f16")]
    for c in caches:
        tr.forward([1, 2], c)
    step = tr._step()
    assert not step.takes(caches)
    solo = [KVCache(tr.spec, 16, t) for t in ("f32", "f16")]
    want = []
    for c in solo:
        tr.forward([1, 2], c)
        want.append(tr.forward([9], c))
    got = tr.forward_batch([9, 9], caches)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_dropped_cache_is_not_held(smollm2):
    import gc
    import weakref

    tr = smollm2.transformer
    for n in (1, 2):
        caches = [KVCache(tr.spec, 16) for _ in range(n)]
        for c in caches:
            tr.forward([1, 2], c)
        tr.forward_batch([3] * n, caches)
        refs = [weakref.ref(c.k) for c in caches]
        del caches, c
        gc.collect()
        assert all(r() is None for r in refs)


def test_batched_rows_equal_bound_decode(smollm2):
    """A session decodes the same tokens alone (bound path) or batched with others."""
    tr = smollm2.transformer
    a, b = KVCache(tr.spec, 32), KVCache(tr.spec, 32)
    tr.forward([1, 2, 3], a)
    tr.forward([1, 5, 6, 7, 8], b)
    solo = KVCache(tr.spec, 32)
    tr.forward([1, 2, 3], solo)
    want = tr.forward([44], solo)
    assert isinstance(tr._decode_step, DecodeStep)
    got = tr.forward_batch([44, 45], [a, b])
    assert np.array_equal(got[0], want)


def test_steps_aside_for_hooks_executors_and_kernel_paths(smollm2):
    tr = smollm2.transformer
    cache = KVCache(tr.spec, 32)
    tr.forward([1, 2], cache)
    tr.forward([3], cache)
    assert isinstance(tr._decode_step, DecodeStep)
    # a hook on the kernel entry points (tools/calibrate) must see the decode projections
    from edgerun.tools.calibrate import ImatrixCollector

    stats = ImatrixCollector()
    with stats.hooked():
        tr.forward([4], cache)
    assert tr._decode_step is False
    assert stats.counts[tr.layers[0].q.name] == 1
    tr.forward([5], cache)
    assert isinstance(tr._decode_step, DecodeStep)
    # another executor in one layer: the general path runs it
    layer = tr.layers[3]
    dense = layer.ffn
    calls = []

    class Wrapped:
        d_model, d_ff = dense.d_model, dense.d_ff

        def __call__(self, x):
            calls.append(x.shape)
            return dense(x)

    layer.ffn = Wrapped()
    try:
        tr.forward([6], cache)
        assert calls == [(1, tr.spec.d_model)] and tr._decode_step is False
    finally:
        layer.ffn = dense
    tr.forward([7], cache)
    assert isinstance(tr._decode_step, DecodeStep)


@pytest.mark.skipif(len(qmatvec.available_paths()) < 2, reason="one kernel path on this CPU")
def test_portable_kernel_path_is_bound_too(smollm2):
    tr = smollm2.transformer
    before = qmatvec.kernel_path()
    qmatvec.set_kernel_path("portable")
    try:
        _assert_same(*_both(tr, "f32", *_one([1, 2, 3], [4, 5])))
        tr.forward([1], KVCache(tr.spec, 4))
        assert tr._decode_step.path == "portable"
    finally:
        qmatvec.set_kernel_path(before)
    tr.forward([1], KVCache(tr.spec, 4))
    assert tr._decode_step.path == before


def test_errors_are_the_general_paths(smollm2):
    tr = smollm2.transformer
    cache = KVCache(tr.spec, 2)
    tr.forward([1, 2], cache)
    with pytest.raises(ContextOverflowError):
        tr.forward([3], cache)
    with pytest.raises(ValueError, match="out of range"):
        tr.forward([tr.spec.vocab_size], KVCache(tr.spec, 4))
    assert cache.length == 2


def test_half_bits_rounds_as_numpy():
    rng = np.random.default_rng(3)
    n = 1 << 20
    anywhere = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    # exponents around half's range: normals, subnormals, ties, overflow to infinity
    near = (
        rng.integers(0, 1 << 23, n, dtype=np.uint32)
        | (rng.integers(96, 146, n, dtype=np.uint32) << 23)
        | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    )
    ties = (rng.integers(0, 1 << 10, n, dtype=np.uint32) << 13 | 0x1000) | (
        rng.integers(100, 144, n, dtype=np.uint32) << 23
    )
    for bits in (anywhere, near, ties):
        f = bits.view(np.float32)
        got = np.empty(n, np.uint16)
        half_bits(f, got)
        with np.errstate(over="ignore"):
            want = f.astype(np.float16)
        nan = np.isnan(f)
        assert np.array_equal(got[~nan], want.view(np.uint16)[~nan])
        assert np.isnan(got.view(np.float16)[nan]).all()


def test_the_step_kernels_one_a_part_cover_the_step(smollm2_path, tmp_path):
    """A first run compiles the step's kernels one a part in parallel processes
    (Engine.warm_part "decode:i"): attention first, then the matvecs; after all of them
    the whole step ("decode") finds every kernel it runs loaded already."""
    import json
    import subprocess
    import sys

    code = f"""
import json
from numba.core import event
import edgerun
from edgerun.generate.engine import DECODE_KERNEL_PARTS
from edgerun.model.kvcache import KVCache
m = edgerun.load({str(smollm2_path)!r}, n_ctx=16, threads=1)
e = m.engine
kernels = e.transformer.decode_kernels(KVCache(e.spec, 1, e.kv_type))
names = [getattr(k, "__qualname__", getattr(k, "__name__", "?")) for k, _ in kernels]
for part in DECODE_KERNEL_PARTS:
    e.warm_part(part)
with event.install_recorder("numba:compile") as rec:
    e.warm_part("decode")
print(json.dumps(dict(names=names, after=sum(1 for ev in rec.buffer if ev[1].is_start))))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    names = res["names"]
    assert names[0] == "attend_one64" and len(set(names)) == len(names)
    assert names.index("matvec") < names.index("prepare_token")  # the output head's
    assert {"Transformer.embed", "add_normed", "_glu_rows_serial"} <= set(names)
    assert res["after"] == 0  # nothing left for the whole step to compile or load


def test_the_attention_is_two_calls_on_the_cache(smollm2):
    """One sequence's bound attention: prepare_token (biases, norms, RoPE, the KV store),
    then the split-position kernel of the model's head size, which reads the position
    from the step's positions buffer (rebinding nothing between tokens)."""
    from edgerun.ops.attention_decode import attend_one64
    from edgerun.ops.token_step import prepare_token

    tr = smollm2.transformer
    tr._decode_step = None
    cache = KVCache(tr.spec, 8, "f16")
    tr.forward([1, 2], cache)
    tr.forward([3], cache)
    calls = [k for k, _ in tr._decode_step._rows[1].calls]
    assert calls.count(prepare_token) == calls.count(attend_one64) == tr.spec.n_layers
    at = calls.index(prepare_token)
    assert calls[at + 1] is attend_one64
