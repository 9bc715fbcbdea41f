"""The gated DeltaNet kernels (ops/gated_delta.py) against their float64 numpy references,
and the forms that must agree bit for bit: a prompt's recurrence and conv state equal the
same tokens fed in pieces, and one token gives the same bits in any call."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.ops import gated_delta as gd

HK, HV, DK, DV = 2, 4, 16, 32  # 4 value heads over 2 key heads, as Qwen3.5 groups them


def _inputs(rng, n):
    q = rng.standard_normal((n, HK, DK)).astype(np.float32)
    k = rng.standard_normal((n, HK, DK)).astype(np.float32)
    v = rng.standard_normal((n, HV, DV)).astype(np.float32)
    a = rng.standard_normal((n, HV)).astype(np.float32)
    b = rng.standard_normal((n, HV)).astype(np.float32)
    a_neg = -np.exp(rng.standard_normal(HV)).astype(np.float32)
    dt_bias = rng.standard_normal(HV).astype(np.float32)
    g, beta = gd.decay_beta(a, b, a_neg, dt_bias)
    return q, k, v, g, beta


def test_decay_beta_matches_reference():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((9, HV)) * 12).astype(np.float32)  # past softplus' linear cut
    b = rng.standard_normal((9, HV)).astype(np.float32)
    a_neg = -np.exp(rng.standard_normal(HV)).astype(np.float32)
    dt = rng.standard_normal(HV).astype(np.float32)
    g, beta = gd.decay_beta(a, b, a_neg, dt)
    g_ref, beta_ref = gd.decay_beta_reference(a, b, a_neg, dt)
    np.testing.assert_allclose(g, g_ref, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(beta, beta_ref, rtol=2e-6, atol=1e-7)
    assert (g <= 0).all()


def test_gated_delta_matches_reference_and_carries_state():
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _inputs(rng, 23)
    s0 = (rng.standard_normal((HV, DK, DV)) * 0.1).astype(np.float32)
    s = s0.copy()
    out = gd.gated_delta(q, k, v, g, beta, s, 1e-6)
    out_ref, s_ref = gd.gated_delta_reference(q, k, v, g, beta, s0, 1e-6)
    np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(s, s_ref, rtol=1e-4, atol=2e-5)
    # the state matters: from zeros the output differs
    z = np.zeros_like(s0)
    assert np.abs(gd.gated_delta(q, k, v, g, beta, z, 1e-6) - out).max() > 1e-3


def test_gated_delta_value_heads_tile_key_heads():
    """Value head h reads key head h % HK (the converter's tiled order)."""
    rng = np.random.default_rng(2)
    q, k, v, g, beta = _inputs(rng, 5)
    out = gd.gated_delta(q, k, v, g, beta, np.zeros((HV, DK, DV), np.float32), 1e-6)
    idx = np.arange(HV) % HK
    for h in range(HV):
        one = gd.gated_delta(
            *(np.ascontiguousarray(a) for a in (q[:, idx[h] : idx[h] + 1],
              k[:, idx[h] : idx[h] + 1], v[:, h : h + 1], g[:, h : h + 1],
              beta[:, h : h + 1])),
            np.zeros((1, DK, DV), np.float32),
            1e-6,
        )  # fmt: skip
        np.testing.assert_allclose(one[:, 0], out[:, h], rtol=1e-5, atol=1e-7)
    # and another head's keys give another output
    other = gd.gated_delta(q[:, ::-1].copy(), k[:, ::-1].copy(), v, g, beta,
                           np.zeros((HV, DK, DV), np.float32), 1e-6)  # fmt: skip
    assert np.abs(other - out).max() > 1e-3


def _steps(q, k, v, g, beta, state):
    return np.concatenate([
        gd.gated_delta(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                       beta[t : t + 1], state, 1e-6)
        for t in range(q.shape[0])
    ])  # fmt: skip


def test_prompt_equals_tokens_one_at_a_time():
    """The prompt's parallel kernel and the steps' serial one agree within rounding; steps
    agree bit for bit however they are replayed (one serial kernel)."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta = _inputs(rng, 17)
    s_prompt = np.zeros((HV, DK, DV), np.float32)
    out = gd.gated_delta(q, k, v, g, beta, s_prompt, 1e-6)
    s_tok = np.zeros_like(s_prompt)
    steps = _steps(q, k, v, g, beta, s_tok)
    np.testing.assert_allclose(steps, out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s_tok, s_prompt, rtol=1e-5, atol=1e-6)
    s_again = np.zeros_like(s_prompt)
    np.testing.assert_array_equal(_steps(q, k, v, g, beta, s_again), steps)
    np.testing.assert_array_equal(s_again, s_tok)


@pytest.mark.parametrize("pieces", [(9,), (1, 1, 7), (2, 5, 2)])
def test_conv1d_silu_matches_reference_in_pieces(pieces):
    rng = np.random.default_rng(4)
    c, taps = 48, 4
    x = rng.standard_normal((sum(pieces), c)).astype(np.float32)
    w = rng.standard_normal((c, taps)).astype(np.float32)
    state0 = rng.standard_normal((taps - 1, c)).astype(np.float32)
    ref, ref_state = gd.conv1d_silu_reference(x, w, state0)
    state = state0.copy()
    wt = np.ascontiguousarray(w.T)
    outs, at = [], 0
    for n in pieces:
        outs.append(gd.conv1d_silu(x[at : at + n], wt, state))
        at += n
    np.testing.assert_allclose(np.concatenate(outs), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, ref_state)
    whole = gd.conv1d_silu(x, wt, state0.copy())
    np.testing.assert_array_equal(np.concatenate(outs), whole)


def test_gated_rmsnorm_matches_reference():
    rng = np.random.default_rng(5)
    o = rng.standard_normal((3, HV, DV)).astype(np.float32)
    z = rng.standard_normal((3, HV, DV)).astype(np.float32)
    w = rng.standard_normal(DV).astype(np.float32)
    got = gd.gated_rmsnorm(o, z, w, 1e-6)
    np.testing.assert_allclose(got, gd.gated_rmsnorm_reference(o, z, w, 1e-6), rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_sizes_off_the_lane_groups_are_refused():
    x = np.zeros((2, 24), np.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        gd.conv1d_silu(x, np.zeros((4, 24), np.float32), np.zeros((3, 24), np.float32))
