"""Sparse FFN kernels against their numpy references."""

import numpy as np
import pytest

from edgerun.ops import qmatvec
from edgerun.ops import sparse_ffn as sf
from edgerun.ops.activations import glu
from edgerun.quant.formats import QuantTensor, QuantType, row_bytes
from edgerun.quant.quantize import quantize
from edgerun.quant.reference import dequantize, random_blocks

RNG = np.random.default_rng(7)


def _x_seen(qtype: QuantType, x: np.ndarray) -> np.ndarray:
    """x as the current kernel path's decode kernel for qtype takes it, where that is
    single-level int8 (Q4_K off the vnni path); else x (two levels are within the
    tests' tolerance of it)."""
    levels = qmatvec.activation_levels(qtype, 1)
    if levels == 2:
        return x
    return qmatvec.quantize_x_reference(x, qmatvec.activation_block(qtype, 1), levels)


@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0, QuantType.Q4_1])
@pytest.mark.parametrize("path", qmatvec.available_paths())
def test_matvec_rows_matches_reference_and_gathered_matvec(qtype, path):
    cols, nrows = 512, 97
    data = random_blocks(qtype, nrows, cols, RNG)
    x = RNG.standard_normal(cols).astype(np.float32)
    idx = RNG.choice(nrows, 40, replace=False).astype(np.int32)
    old = qmatvec.kernel_path()
    try:
        qmatvec.set_kernel_path(path)
        got = sf.matvec_rows(qtype, cols, data, idx, x)
        dense = qmatvec.matvec(QuantTensor("w", qtype, (nrows, cols), data), x)
        xr = _x_seen(qtype, x)
    finally:
        qmatvec.set_kernel_path(old)
    ref = sf.matvec_rows_reference(qtype, cols, data, idx, xr)
    scale = np.abs(ref).max()
    assert np.allclose(got, ref, atol=2e-4 * scale, rtol=1e-4)
    assert np.allclose(got, dense[idx], atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("path", qmatvec.available_paths())
def test_matvec_rows_reads_the_up_part_of_records(path):
    cols, nrows = 256, 50
    up = random_blocks(QuantType.Q4_K, nrows, cols, RNG)
    down = random_blocks(QuantType.Q8_0, nrows, 96, RNG)
    rec = np.ascontiguousarray(np.concatenate([up, down], axis=1))
    x = RNG.standard_normal(cols).astype(np.float32)
    idx = np.array([3, 49, 0, 17, 17], np.int32)
    old = qmatvec.kernel_path()
    try:
        qmatvec.set_kernel_path(path)
        got = sf.matvec_rows(QuantType.Q4_K, cols, rec, idx, x)
        # the down part as Q8_0 rows of 96 at an offset
        got_d = sf.matvec_rows(QuantType.Q8_0, 96, rec, idx, x[:96], offset=up.shape[1])
        xr = _x_seen(QuantType.Q4_K, x)
    finally:
        qmatvec.set_kernel_path(old)
    ref = sf.matvec_rows_reference(QuantType.Q4_K, cols, up, idx, xr)
    ref_d = sf.matvec_rows_reference(QuantType.Q8_0, 96, down, idx, x[:96])
    assert np.allclose(got, ref, atol=2e-4 * np.abs(ref).max())
    assert np.allclose(got_d, ref_d, atol=2e-4 * np.abs(ref_d).max())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 5, 300])
def test_accumulate_q8_0_rows_matches_reference(n, threads):
    import numba

    d, nrows = 576, 400
    rows = random_blocks(QuantType.Q8_0, nrows, d, RNG)
    idx = RNG.choice(nrows, n, replace=False).astype(np.int32)
    coeff = RNG.standard_normal(n).astype(np.float32)
    if n > 2:
        coeff[1] = 0.0
    out0 = RNG.standard_normal(d).astype(np.float32)
    old = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        out = sf.accumulate_q8_0_rows(rows, coeff, out0.copy(), idx)
    finally:
        numba.set_num_threads(old)
    ref = out0 + sf.accumulate_q8_0_rows_reference(rows, coeff, d, idx)
    assert np.allclose(out, ref, atol=1e-4 * max(1.0, np.abs(ref).max()))


def test_accumulate_from_record_offset_and_many_tokens():
    d, up_bytes, nrows = 320, 144, 60
    down = random_blocks(QuantType.Q8_0, nrows, d, RNG)
    rec = np.ascontiguousarray(
        np.concatenate([RNG.integers(0, 255, (nrows, up_bytes), dtype=np.uint8), down], 1)
    )
    idx = np.array([59, 2, 30, 7], np.int32)
    coeff = RNG.standard_normal((3, 4)).astype(np.float32)
    out = np.zeros((3, d), np.float32)
    sf.accumulate_q8_0_rows_many(rec, coeff, out, idx, offset=up_bytes)
    for t in range(3):
        ref = sf.accumulate_q8_0_rows_reference(down, coeff[t], d, idx)
        assert np.allclose(out[t], ref, atol=1e-4 * np.abs(ref).max())
        one = sf.accumulate_q8_0_rows(rec, coeff[t], np.zeros(d, np.float32), idx, up_bytes)
        assert np.allclose(one, out[t], atol=1e-5 * np.abs(ref).max())


def test_bad_arguments_raise():
    from edgerun.errors import InvalidArgumentError

    rows = random_blocks(QuantType.Q8_0, 4, 64, RNG)
    with pytest.raises(InvalidArgumentError):
        sf.accumulate_q8_0_rows(rows, np.ones(2, np.float32), np.zeros(64, np.float32), [0, 9])
    with pytest.raises(InvalidArgumentError):
        sf.accumulate_q8_0_rows(rows, np.ones(1, np.float32), np.zeros(96, np.float32), [0])
    with pytest.raises(InvalidArgumentError):
        sf.matvec_rows(QuantType.Q8_0, 64, rows[:, :34], [0], np.zeros(64, np.float32))


def test_sparse_ffn_through_the_kernels_equals_the_float_reference():
    """gate/up rows of a subset + glu + Q8_0 down rows == down[:, S] @ h_S."""
    d, dff = 256, 128
    gate = random_blocks(QuantType.Q4_K, dff, d, RNG)
    up = random_blocks(QuantType.Q4_K, dff, d, RNG)
    down_f = RNG.standard_normal((d, dff)).astype(np.float32) * 0.05
    down_t = quantize(np.ascontiguousarray(down_f.T), QuantType.Q8_0)  # [dff, d/32*34]
    x = RNG.standard_normal(d).astype(np.float32)
    idx = np.sort(RNG.choice(dff, 50, replace=False)).astype(np.int32)
    g = sf.matvec_rows(QuantType.Q4_K, d, gate, idx, x)
    u = sf.matvec_rows(QuantType.Q4_K, d, up, idx, x)
    h = glu(g[None], u[None], "silu")[0]
    y = sf.accumulate_q8_0_rows(down_t, h, np.zeros(d, np.float32), idx)
    gf = dequantize(QuantType.Q4_K, gate).reshape(dff, d)
    uf = dequantize(QuantType.Q4_K, up).reshape(dff, d)
    df = dequantize(QuantType.Q8_0, down_t).reshape(dff, d).T
    ref = sf.sparse_ffn_reference(gf, uf, df, _x_seen(QuantType.Q4_K, x), idx, "silu")
    assert np.allclose(y, ref, atol=1e-3 * np.abs(ref).max())
    assert row_bytes(QuantType.Q8_0, d) == down_t.shape[1]
