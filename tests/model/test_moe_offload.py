"""Routed experts streamed from flash (offload/experts.py) on a tiny qwen3moe GGUF written
on the fly by benchmarks/make_moe_gguf.py: the streamed model computes what the resident
one does, the expert cache counts hits and misses as it should, prefetching changes no
result, and the plan's budget covers the expert cache."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

DIMS = dict(d_model=256, experts=16, top_k=4, expert_ff=256, heads=4, kv_heads=2, head_dim=64)
LAYERS = 3
N_CTX = 64
PROMPT = [1, 17, 300, 4001, 52, 9, 777, 12]


def _writer():
    spec = importlib.util.spec_from_file_location(
        "make_moe_gguf", ROOT / "benchmarks" / "make_moe_gguf.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_moe_gguf", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"
    _writer().write(path, LAYERS, 0.0, DIMS, seed=3, tokenizer=Path(smollm2_path), ctx=N_CTX)
    return path


def _open(path):
    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf

    f = read_gguf(path)
    return f, spec_from_gguf(f.metadata, str(path))


def _streamed(path, slots: int | None = None, prefetch: bool = True, budget_extra: int = 0):
    """(spec, footprint, plan, store, Transformer) with the routed experts on flash: the
    plan of the smallest budget (2 layers' experts cached), or one of `slots` slots."""
    from edgerun.model.transformer import Transformer
    from edgerun.offload.experts import ExpertStreamStore
    from edgerun.offload.plan import experts_plan, footprint, minimum_experts_budget
    from edgerun.offload.store import OffloadOptions

    f, spec = _open(path)
    fp = footprint(spec, f, "f32")
    budget = minimum_experts_budget(fp, 0, N_CTX) + budget_extra
    p = experts_plan(fp, budget, 0, N_CTX)
    if slots is not None:
        p.expert_slots = slots
    opts = OffloadOptions(io_threads=2, prefetch_layers=2 if prefetch else 0)
    store = ExpertStreamStore(f, str(path), spec, p, opts)
    return spec, fp, p, store, Transformer(spec, store, str(path))


def _resident(path):
    from edgerun.model.transformer import Transformer
    from edgerun.model.weights import ResidentStore

    f, spec = _open(path)
    return Transformer(spec, ResidentStore(f, str(path)), str(path))


def _greedy(t, n: int = 8, prompt=None) -> tuple[list[int], list[np.ndarray]]:
    from edgerun.model.kvcache import KVCache

    cache = KVCache(t.spec, N_CTX, "f32")
    logits = [np.asarray(t.forward(prompt or PROMPT, cache), np.float32).reshape(-1)]
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        logits.append(np.asarray(t.forward([tok], cache), np.float32).reshape(-1))
    return out, logits


@pytest.mark.parametrize("prefetch", [False, True])
def test_streamed_experts_compute_what_the_resident_model_does(moe_file, prefetch):
    """At the smallest budget (8 of 48 experts cached: nearly every pick misses and
    evicts), with and without prefetching, greedy tokens equal the resident model's and
    the logits agree to float rounding."""
    want_tokens, want_logits = _greedy(_resident(moe_file))
    spec, fp, p, store, t = _streamed(moe_file, prefetch=prefetch)
    assert p.mode == "experts" and p.expert_slots == 2 * spec.n_expert_used
    got_tokens, got_logits = _greedy(t)
    assert got_tokens == want_tokens
    for g, w in zip(got_logits, want_logits):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    st = store.stats
    assert st.bytes_read > 0 and st.needed > 0
    assert store.experts.cache.evictions > 0
    assert st.hits + st.prefetch_used <= st.needed
    if prefetch:
        assert st.prefetched > 0 and st.prefetch_used > 0
    else:
        assert st.prefetched == st.prefetch_used == 0
    store.close()


def test_expert_cache_counts_hits_misses_and_bytes(moe_file):
    """With every expert of the model cached, the first pass misses each expert once
    (bytes read = distinct experts x expert bytes) and a repeat of the same prompt hits
    every one and reads nothing."""
    from edgerun.model.kvcache import KVCache

    _, spec = _open(moe_file)
    total = LAYERS * spec.n_expert
    spec, fp, p, store, t = _streamed(moe_file, slots=total, prefetch=False)
    t.forward(PROMPT, KVCache(spec, N_CTX, "f32"))
    st = store.stats
    distinct = len(store.experts.cache)
    assert 0 < distinct <= total
    assert st.needed - st.hits == distinct  # each expert missed once, then cached
    size = store.direct.size  # each expert's three block-aligned reads
    want = sum(
        n
        for ly, e in store.experts.cache.slot_of
        for _, n, _ in store.experts.layers[ly].aligned_ranges(e, size)
    )
    assert distinct * fp.expert_bytes <= st.bytes_read == want
    store.reset_offload_stats()
    t.forward(PROMPT, KVCache(spec, N_CTX, "f32"))
    assert st.needed > 0 and st.hits == st.needed and st.bytes_read == 0
    assert store.direct.bytes_read == 0
    assert store.experts.cache.evictions == 0
    store.close()


def test_prompt_rows_split_to_fit_a_small_cache(moe_file):
    """A prompt chunk picks more experts than the smallest cache holds at once: its rows
    are run in groups whose picks fit, with the resident model's result."""
    from edgerun.model.kvcache import KVCache

    spec, fp, p, store, t = _streamed(moe_file, prefetch=False)
    ffn = t.layers[0].ffn
    assert ffn.max_rows < len(PROMPT)
    want = _resident(moe_file).forward(PROMPT, KVCache(spec, N_CTX, "f32"))
    got = t.forward(PROMPT, KVCache(spec, N_CTX, "f32"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    store.close()


def test_the_plan_counts_the_expert_cache_in_the_budget(moe_file):
    """The expert cache takes what the budget leaves: a larger budget holds more slots,
    the planned total never passes the budget, the cache's buffer is the planned bytes,
    and a budget below the minimum is refused with the minimum in the message."""
    from edgerun.errors import BudgetError
    from edgerun.offload.plan import experts_plan, footprint, minimum_experts_budget

    f, spec = _open(moe_file)
    fp = footprint(spec, f, "f32")
    assert fp.n_expert == spec.n_expert and fp.expert_bytes > 0
    low = minimum_experts_budget(fp, 0, N_CTX)
    small = experts_plan(fp, low, 0, N_CTX)
    big = experts_plan(fp, low + 10 * fp.expert_bytes, 0, N_CTX)
    slot = small.cache_bytes // small.expert_slots  # an expert and its reads' block padding
    assert fp.expert_bytes < slot < 2 * fp.expert_bytes
    assert big.expert_slots - small.expert_slots in (10 * fp.expert_bytes // slot + np.arange(2))
    for p in (small, big):
        assert p.used_bytes <= p.budget
        assert p.cache_bytes >= p.expert_slots * fp.expert_bytes
        text = p.describe()
        assert "expert cache" in text and "routed experts" in text
    assert small.read_bytes_per_token > big.read_bytes_per_token
    with pytest.raises(BudgetError, match=f"{-(-low // 2**20)}M"):
        experts_plan(fp, low - 2**20, 0, N_CTX)
    _, _, p, store, _ = _streamed(moe_file, budget_extra=5 * fp.expert_bytes)
    assert store.experts.cache.nbytes <= p.cache_bytes
    assert store.experts.cache.capacity == p.expert_slots
    store.close()


def test_batched_decode_with_streamed_experts_equals_the_resident_model(moe_file):
    """Two sequences decoded in one batched step (each selected expert read once for the
    rows that chose it) give the resident model's logits for each."""
    from edgerun.model.kvcache import KVCache

    res = _resident(moe_file)
    spec, fp, p, store, t = _streamed(moe_file)
    prompts = [PROMPT, PROMPT[::-1]]
    out = []
    for model in (res, t):
        caches = [KVCache(spec, N_CTX, "f32") for _ in prompts]
        for c, ids in zip(caches, prompts):
            model.forward(ids, c)
        out.append(np.asarray(model.forward_batch([5, 6], caches), np.float32))
    np.testing.assert_allclose(out[1], out[0], rtol=1e-4, atol=1e-4)
    store.close()


API_RUN = """
import json, sys
import edgerun
from edgerun.api import minimum_ram_budget
path = sys.argv[1]
need = minimum_ram_budget(path, n_ctx=64)
m = edgerun.load(path, n_ctx=64, threads=2, ram_budget=int(need * 1.03))  # floor drift
ids = [1, 17, 300, 4001, 52]
streamed = list(m.generate(ids, max_tokens=8, temperature=0.0))
st = m.loader.offload_stats()
r = edgerun.load(path, n_ctx=64, threads=2)
resident = list(r.generate(ids, max_tokens=8, temperature=0.0))
print(json.dumps({"mode": m.plan.mode, "slots": m.plan.expert_slots,
                  "total": m.plan.experts_total, "needed": st["experts_needed"],
                  "same": streamed == resident, "resident_mode": r.plan and r.plan.mode}))
"""


def test_a_ram_budget_streams_a_moe_through_the_api(tmp_path, smollm2_path):
    """edgerun.load with a RAM budget below the file's needs plans the experts mode at
    the API (its own process: a budget changes process-wide allocator and page-cache
    settings), and generates the tokens the resident load does."""
    import json
    import os
    import subprocess

    dims = dict(DIMS, experts=64, expert_ff=512)  # experts the bulk of the file
    path = tmp_path / "moe.gguf"
    _writer().write(path, LAYERS, 0.0, dims, seed=3, tokenizer=Path(smollm2_path), ctx=N_CTX)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", API_RUN, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mode"] == "experts" and r["resident_mode"] is None
    assert 2 * DIMS["top_k"] <= r["slots"] < r["total"] == LAYERS * 64
    assert r["needed"] > 0
    assert r["same"]


@pytest.mark.parametrize(
    "name, dense_lead, gating",
    [("lfm2moe", 1, "sigmoid"), ("granitehybrid-moe", 0, "softmax"), ("gemma4-moe", 0, "softmax")],
)
def test_a_hybrid_moe_streams_its_experts_beside_its_recurrent_states(name, dense_lead, gating):
    """LFM2-MoE (tests/data/families/lfm2moe: a dense first layer, sigmoid routing with an
    expert bias, short-convolution states) and Granite 4.0 H's MoE form (a shared expert on
    every layer, Mamba-2 states), and Gemma 4's MoE form (experts beside every layer's
    dense MLP, their gate and up rows fused in one tensor): experts streamed at the
    smallest cache give the resident model's greedy tokens, and a dense layer's FFN counts
    as resident."""
    path = Path(__file__).resolve().parents[1] / "data" / "families" / name / "q8_0.gguf"
    prompt = [1, 40, 200, 7, 99, 300]  # the tiny vocabulary's ids
    want_tokens, want_logits = _greedy(_resident(path), prompt=prompt)
    spec, fp, p, store, t = _streamed(path, prefetch=True)
    assert p.mode == "experts" and spec.expert_gating == gating
    f, _ = _open(path)
    roles = ("ffn_gate", "ffn_up", "ffn_down")
    dense = sum(f.tensor(spec.layer_tensor(r, i)).nbytes for r in roles for i in range(dense_lead))
    assert fp.moe_resident_bytes >= dense and (dense > 0) == (dense_lead > 0)
    got_tokens, got_logits = _greedy(t, prompt=prompt)
    assert got_tokens == want_tokens
    for g, w in zip(got_logits, want_logits):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert store.stats.bytes_read > 0
    store.close()


def test_a_router_beside_an_mlp_is_predicted_from_the_stream_it_norms():
    """Gemma 4's experts read the residual stream, and each router norms it with its own
    gain: the prefetch of the next layer's experts applies that norm before the router,
    so on the stream the next layer will read it names exactly that layer's picks."""
    from edgerun.ops.norm import rmsnorm

    path = Path(__file__).resolve().parents[1] / "data" / "families" / "gemma4-moe" / "q8_0.gguf"
    spec, _, _, store, t = _streamed(path, prefetch=True)
    ahead = t.layers[0].ffn
    nxt = ahead.next_routers[0]
    moe = t.layers[nxt.layer].ffn.moe
    np.testing.assert_array_equal(nxt.gain, moe.beside.router_gain)
    rng = np.random.default_rng(5)
    for _ in range(8):
        h = (rng.standard_normal((1, spec.d_model)) * 4 + 2).astype(np.float32)
        ahead._predict(h)
        hint = dict(ahead.source.hint)
        sel, _ = moe.routing(rmsnorm(h, moe.beside.router_gain, spec.norm_eps), decode=True)
        assert sorted(hint[nxt.layer]) == sorted(sel.ravel())
    store.close()
