"""The Mamba-2 kernel (ops/mamba2.py) against its float64 numpy reference, and the forms that
must agree bit for bit: a prompt's rows fed in pieces (as decode steps) leave the same
outputs and states as one pass."""

from __future__ import annotations

import numpy as np

from edgerun.ops.mamba2 import mamba2_reference, mamba2_rows

# 2 heads per group of B and C; a state of 24: one 16-lane group and a tail
HEADS, P, GROUPS, N, TAPS = 6, 8, 3, 24, 4
INNER = HEADS * P
CHANNELS = INNER + 2 * GROUPS * N
EPS = 1e-5


def _weights(rng):
    return dict(
        conv_w=rng.normal(0, 0.5, (CHANNELS, TAPS)).astype(np.float32),
        conv_b=rng.normal(0, 0.1, CHANNELS).astype(np.float32),
        dt_bias=rng.normal(0, 1, HEADS).astype(np.float32),
        a=-np.exp(rng.normal(0, 1, HEADS)).astype(np.float32),
        d=rng.normal(1, 0.3, HEADS).astype(np.float32),
        norm_w=rng.uniform(0.6, 1.4, INNER).astype(np.float32),
    )


def _proj(rng, n):
    p = rng.normal(0, 1, (n, INNER + CHANNELS + HEADS)).astype(np.float32)
    p[:, -HEADS:] *= 12  # dt past softplus' linear cut at 20 too
    return p


def _run(w, proj, conv_state, ssm):
    y = np.empty((proj.shape[0], INNER), np.float32)
    conv_t = np.ascontiguousarray(w["conv_w"].T)
    mamba2_rows(proj, conv_t, w["conv_b"], w["dt_bias"], w["a"], w["d"], w["norm_w"], GROUPS,
                np.float32(EPS), conv_state, ssm, y)  # fmt: skip
    return y


def test_kernel_matches_reference_and_carries_both_states():
    rng = np.random.default_rng(0)
    w = _weights(rng)
    proj = _proj(rng, 11)
    conv0 = rng.normal(0, 1, (TAPS - 1, CHANNELS)).astype(np.float32)
    ssm0 = rng.normal(0, 0.5, (HEADS, P, N)).astype(np.float32)
    conv, ssm = conv0.copy(), ssm0.copy()
    y = _run(w, proj, conv, ssm)
    y_ref, conv_ref, ssm_ref = mamba2_reference(
        proj, w["conv_w"], w["conv_b"], w["dt_bias"], w["a"], w["d"], w["norm_w"], GROUPS, EPS,
        conv0, ssm0,
    )  # fmt: skip
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(conv, conv_ref)  # the last TAPS - 1 inputs, exactly
    np.testing.assert_allclose(ssm, ssm_ref, rtol=1e-4, atol=2e-5)
    # both states matter: from zeros the outputs differ
    for zero_conv in (True, False):
        c = np.zeros_like(conv0) if zero_conv else conv0.copy()
        s = ssm0.copy() if zero_conv else np.zeros_like(ssm0)
        assert np.abs(_run(w, proj, c, s) - y).max() > 1e-3


def test_a_prompt_in_pieces_equals_one_pass_bit_for_bit():
    """Rows fed one at a time (the serial scan), in pieces shorter than the conv window
    and in one pass (the heads on the threads) give the same bits."""
    rng = np.random.default_rng(1)
    w = _weights(rng)
    proj = _proj(rng, 9)  # longer than the conv window
    conv, ssm = np.zeros((TAPS - 1, CHANNELS), np.float32), np.zeros((HEADS, P, N), np.float32)
    whole = _run(w, proj, conv, ssm)
    conv2, ssm2 = np.zeros_like(conv), np.zeros_like(ssm)
    cuts = ((0, 1), (1, 3), (3, 4), (4, 8), (8, 9))
    parts = [_run(w, proj[a:b], conv2, ssm2) for a, b in cuts]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(conv2, conv)
    np.testing.assert_array_equal(ssm2, ssm)


def test_heads_read_their_group_of_b_and_c():
    """Heads 2g and 2g + 1 read group g: changing group 1's B moves heads 2 and 3 only
    (before the gated norm mixes a group's channels: compare the state)."""
    rng = np.random.default_rng(2)
    w = _weights(rng)
    proj = _proj(rng, 1)
    ssm = np.zeros((HEADS, P, N), np.float32)
    _run(w, proj, np.zeros((TAPS - 1, CHANNELS), np.float32), ssm)
    other = proj.copy()
    other[0, INNER + INNER + 1 * N : INNER + INNER + 2 * N] += 1.0  # group 1's B
    ssm2 = np.zeros_like(ssm)
    _run(w, other, np.zeros((TAPS - 1, CHANNELS), np.float32), ssm2)
    moved = np.abs(ssm2 - ssm).reshape(HEADS, -1).max(-1) > 0
    assert moved.tolist() == [False, False, True, True, False, False]
