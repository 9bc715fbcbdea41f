"""The offloaded output head: held rows exact, a low-rank sketch picking the flash rows a
token reads (edgerun/offload/head.py), its kernel, its file and the plan's share."""

from __future__ import annotations

import numpy as np
import pytest
from hostile import untied_streamed

from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.model.kvcache import KVCache
from edgerun.offload import head as hd
from edgerun.ops.lowrank import int8_row_scores


def test_int8_row_scores_match_numpy():
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (1000, 64)).astype(np.int8)
    scales = rng.random(1000).astype(np.float32)
    y = rng.standard_normal((3, 64)).astype(np.float32)
    want = (codes.astype(np.float64) @ y.T.astype(np.float64)).T * scales
    np.testing.assert_allclose(int8_row_scores(codes, scales, y), want, rtol=1e-5, atol=1e-3)
    with pytest.raises(InvalidArgumentError, match="scales"):
        int8_row_scores(codes, scales[:10], y)


def test_basis_spans_the_hidden_states_subspace():
    rng = np.random.default_rng(1)
    span = np.linalg.qr(rng.standard_normal((48, 5)))[0]  # 5 directions in 48 dims
    hidden = rng.standard_normal((40, 5)) @ span.T
    u = hd.fit_basis(hidden, rank=5)
    assert u.shape == (48, 5)
    np.testing.assert_allclose(u @ (u.T @ hidden.T), hidden.T, atol=1e-4)  # nothing lost
    assert hd.fit_basis(hidden[:3], rank=5)[:, 3:].any() == False  # noqa: E712 (3 states)


def _sketched(tmp_path, candidates: int, rank: int = 4):
    u = untied_streamed(tmp_path)
    m, offset = u.store.head_split()
    cache = KVCache(u.spec, 16, "f32")
    hidden = u.resident.final_hidden([1, 2, 3, 4, 5, 6, 7], cache)
    assert cache.length == 7 and hidden.shape == (7, u.spec.d_model)
    sketch = hd.fit_sketch(m.template, u.store.direct, offset, hidden, m.held_rows, rank)
    return u, sketch, u.store.sketch_head(sketch, candidates)


def _hidden(u, tokens):
    return u.resident.final_hidden(tokens, KVCache(u.spec, 16, "f32"))


def test_with_every_flash_row_a_candidate_the_logits_are_the_resident_ones(tmp_path):
    u, _, head = _sketched(tmp_path, candidates=10_000)
    assert not any(m.pieces for m, _ in u.store._splits if m.name == "output.weight")
    u.streamed.head = head
    want = u.logits(u.resident)
    got = u.logits(u.streamed)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    c = [KVCache(u.spec, 16, "f32") for _ in range(2)]
    for t, cache in zip(([3, 4], [5]), c):
        assert np.array_equal(
            u.streamed.forward(t, cache), u.resident.forward(t, KVCache(u.spec, 16, "f32"))
        )
    u.store.close()


def test_only_the_sketch_best_flash_rows_are_read_and_exact(tmp_path):
    u, sketch, head = _sketched(tmp_path, candidates=3)
    x = _hidden(u, [2, 3, 4])
    exact = head(x)  # all rows, read in pieces
    assert np.array_equal(exact, u.resident.forward([2, 3, 4], KVCache(u.spec, 16, "f32"), True))
    u.store.direct.reset_stats()
    got = head.next_logits(x)
    held = head.matrix.held_rows
    assert held < u.spec.vocab_size
    scores = sketch.scores(x, held)
    for v in range(3):
        best = set(np.argsort(-scores[v], kind="stable")[:3] + held)
        finite = set(np.flatnonzero(np.isfinite(got[v, held:])) + held)
        assert best <= finite  # each sequence's candidates are exact ...
        assert len(finite) <= 3 * 3  # ... and only the union of them was read
        cols = sorted(finite)
        assert np.array_equal(got[v, cols], exact[v, cols])
        assert np.array_equal(got[v, :held], exact[v, :held])
    assert head.rows_read == len(set().union(*[np.flatnonzero(np.isfinite(r[held:])) for r in got]))
    assert u.store.direct.reads > 0
    u.store.close()


def test_sketch_file_round_trip_and_a_mismatch_is_named(tmp_path):
    u, sketch, _ = _sketched(tmp_path, candidates=3)
    m, _ = u.store.head_split()
    path = hd.sketch_path(tmp_path, tmp_path / "untied.gguf", "k", sketch.first, 4)
    assert hd.load_sketch(path, m.template, sketch.first, 4) is None  # none yet
    hd.save_sketch(path, sketch, m.template)
    back = hd.load_sketch(path, m.template, sketch.first, 4)
    for a in ("basis", "codes", "scales"):
        assert np.array_equal(getattr(back, a), getattr(sketch, a))
    with pytest.raises(ModelFormatError, match="field 'rank': expected 8, found 4"):
        hd.load_sketch(path, m.template, sketch.first, 8)
    path.write_bytes(b"not a sketch")
    with pytest.raises(ModelFormatError, match="unreadable head sketch"):
        hd.load_sketch(path, m.template, sketch.first, 4)
    u.store.close()


def test_the_plan_reads_only_candidates_of_a_sketched_head():
    """A sketched head holds a fixed count of its first rows (resident, with the sketch of
    the others) and the FFN's share takes the rest of the budget: a token reads the FFN
    rows not held and its candidates, never the head's other rows."""
    from edgerun.offload.plan import Footprint, minimum_budget, plan

    fp = Footprint(
        n_layers=4,
        d_model=256,
        d_ff=1024,
        attention_bytes=1 << 20,
        head_bytes=32000 * 256,
        embedding_bytes=32000 * 256,
        norm_bytes=8192,
        gate_row_bytes=256,
        record_bytes=512,
        dense_ffn_bytes=4 * 3 * 1024 * 256,
        kv_bytes_per_token=4 * 2 * 256 * 2,
        head_rows=32000,
    )
    budget = minimum_budget(fp, 0, 64, "dense") + (2 << 20)
    full = plan(fp, budget, 0, 64, mode="dense")
    sk = plan(fp, budget, 0, 64, mode="dense", head_candidates=64, head_rank=16, head_held=4000)
    assert full.head_streamed and sk.head_streamed and 0 < sk.cache_neurons < fp.d_ff
    assert sk.fixed_head and not full.fixed_head and sk.head_held_rows == 4000
    assert sk.head_sketch_bytes == hd.sketch_bytes(32000 - 4000, fp.d_model, 16)
    assert sk.resident_bytes == full.resident_bytes + 4000 * 256 + sk.head_sketch_bytes
    assert sk.used_bytes <= budget
    ffn_not_held = (fp.d_ff - sk.cache_neurons) * fp.n_layers * fp.dense_neuron_bytes
    assert sk.read_bytes_per_token == ffn_not_held + 64 * 4096
    assert sk.cache_bytes == sk.cache_neurons * fp.n_layers * fp.dense_neuron_bytes
    assert sk.read_bytes_per_token < full.read_bytes_per_token
    assert "first 4,000 rows held" in sk.describe() and "sketch picks 64" in sk.describe()
    # a budget that cannot hold the count holds what fits, the FFN none
    tight = plan(
        fp,
        minimum_budget(fp, 0, 64, "dense") + (1 << 20),
        0,
        64,
        mode="dense",
        head_candidates=64,
        head_rank=16,
        head_held=32000,
    )
    assert 0 < tight.head_held_rows < 32000 and tight.cache_neurons == 0
    assert tight.used_bytes <= minimum_budget(fp, 0, 64, "dense") + (1 << 20)
