"""The placement planner: budget parsing, the minimum, and a plan that fits."""

import math

import numpy as np
import pytest

from edgerun.errors import BudgetError, EdgerunError
from edgerun.offload.plan import Footprint, minimum_budget, parse_budget, plan, resident_plan

MB = 1_000_000
FLOOR = 150 * MB

# Qwen2.5-Coder-1.5B Q4_K_M's shape (PERF_NOTES), a record = Q4_K up row + Q8_0 down col.
QWEN15 = Footprint(
    n_layers=28,
    d_model=1536,
    d_ff=8960,
    attention_bytes=89 * MB,
    head_bytes=191 * MB,
    embedding_bytes=131 * MB,
    norm_bytes=1 * MB,
    gate_row_bytes=864,
    record_bytes=864 + 1632,
    dense_ffn_bytes=700 * MB,
    kv_bytes_per_token=28 * 2 * 256 * 4,
)


@pytest.mark.parametrize(
    "text, want",
    [("800M", 800 << 20), ("1.5G", int(1.5 * (1 << 30))), ("560MB", 560 << 20), ("4096", 4096)],
)
def test_parse_budget_sizes(text, want):
    assert parse_budget(text) == want


def test_parse_budget_percent_of_given_total():
    assert parse_budget("60%", total_bytes=1000) == 600


@pytest.mark.parametrize("bad", ["", "lots", "-5M", "0", "150%", "0%"])
def test_parse_budget_rejects_nonsense(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad)


def test_budget_below_minimum_names_the_minimum():
    floor = FLOOR
    need = minimum_budget(QWEN15, floor, 512)
    with pytest.raises(BudgetError) as e:
        plan(QWEN15, need - 1, floor, 512)
    assert f"{math.ceil(need / 2**20):,} MiB" in str(e.value) and isinstance(e.value, EdgerunError)
    assert plan(QWEN15, need, floor, 512).used_bytes <= need


@pytest.mark.parametrize("budget_mb", [560, 640, 800, 1200])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_plan_stays_inside_the_budget(budget_mb, mode):
    p = plan(QWEN15, budget_mb * MB, FLOOR, 512, mode=mode)
    assert p.used_bytes <= budget_mb * MB
    assert 0 <= p.cache_neurons <= QWEN15.d_ff
    assert p.read_bytes_per_token >= 0


def test_more_budget_reads_less():
    reads = [plan(QWEN15, b * MB, FLOOR, 512).read_bytes_per_token for b in (560, 800, 1200)]
    assert reads[0] > reads[1] > reads[2]


def test_gate_moves_to_flash_when_it_crowds_out_the_cache():
    small = plan(QWEN15, 560 * MB, FLOOR, 512)
    big = plan(QWEN15, 800 * MB, FLOOR, 512)
    assert not small.gate_resident and small.predictor_bytes > 0
    assert big.gate_resident and big.predictor_bytes == 0


def test_dense_mode_reads_more_than_a_sparse_few_neurons():
    d = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense")
    s = plan(QWEN15, 800 * MB, FLOOR, 512, mode="sparse", active_fraction=0.05)
    assert d.read_bytes_per_token > 3 * s.read_bytes_per_token
    # at 30% active the misses lie so close that merged reads cover whole layers
    s30 = plan(QWEN15, 800 * MB, FLOOR, 512, mode="sparse", active_fraction=0.3)
    assert s30.read_bytes_per_token > 0.9 * d.read_bytes_per_token


def test_rows_on_loan_are_not_read_and_the_prediction_counts_them():
    d = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense")
    lent = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense", lent_bytes=50 * MB)
    assert lent.lent_bytes == 50 * MB
    assert lent.read_bytes_per_token == pytest.approx(d.read_bytes_per_token - 50 * MB)
    assert lent.predicted_tok_s > d.predicted_tok_s
    assert lent.cache_bytes == d.cache_bytes  # the plan's own split is unchanged
    assert "rows lent (KV loan)" in lent.describe()
    # a loan larger than what is streamed reads nothing, and sparse mode lends nothing
    huge = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense", lent_bytes=1 << 40)
    assert huge.read_bytes_per_token == 0 and huge.lent_bytes == math.ceil(d.read_bytes_per_token)
    s = plan(QWEN15, 800 * MB, FLOOR, 512, mode="sparse", lent_bytes=50 * MB)
    assert s.lent_bytes == 0


def test_sparse_reads_model_the_readers_merging():
    from edgerun.offload.plan import _sparse_read

    rec = 2496
    total, size = _sparse_read(10, 8960, rec)  # far apart: one aligned read each
    assert total == pytest.approx(10 * (rec + 4096), rel=0.05) and size < 8192
    total, size = _sparse_read(0.5 * 8960, 8960, rec)  # dense: the whole span, big reads
    assert total == pytest.approx(8960 * rec, rel=0.01) and size > 1 << 20
    assert _sparse_read(0, 8960, rec)[0] == 0


def test_a_model_that_fits_stays_resident():
    file_bytes = 1117 * MB
    assert resident_plan(QWEN15, file_bytes, 800 * MB, FLOOR, 512) is None
    p = resident_plan(QWEN15, file_bytes, 2000 * MB, FLOOR, 512)
    assert p is not None and p.mode == "resident" and p.read_bytes_per_token == 0
    assert p.used_bytes <= 2000 * MB and "resident" in p.describe()


# ---------------------------------------------------------------- devices, GPU, hot set
from dataclasses import replace  # noqa: E402

from edgerun.offload.plan import DeviceFigures  # noqa: E402

QWEN15_ATT = replace(QWEN15, attn_weights=2 * 1536 * 1536 + 2 * 256 * 1536)
# a device that streams f16 weights 20x faster than the CPU streams its blocks
FAST_GPU = DeviceFigures(
    flash_read_bytes_s=600e6,
    ram_stream_bytes_s=10e9,
    gpu_matvec_bytes_s=400e9,
    gpu_call_s=30e-6,
)


def test_flash_rate_interpolates_between_measured_chunk_sizes():
    d = DeviceFigures(flash_by_chunk=((4096, 100e6), (131072, 600e6), (1 << 20, 1200e6)))
    assert d.flash_rate(1024) == 100e6 and d.flash_rate(8 << 20) == 1200e6
    assert d.flash_rate(131072) == 600e6
    mid = d.flash_rate(int(math.sqrt(131072 * (1 << 20))))  # halfway on log2(size)
    assert mid == pytest.approx(900e6, rel=1e-6)
    assert DeviceFigures(flash_read_bytes_s=5e8).flash_rate(4096) == 5e8


def test_cpu_rate_per_format_falls_back_to_the_mean():
    d = DeviceFigures(ram_stream_bytes_s=3e9, cpu_by_format=(("Q4_K", 1e9), ("Q8_0", 8e9)))
    assert d.cpu_rate("Q4_K") == 1e9 and d.cpu_rate("Q6_K") == 3e9
    assert d.cpu_seconds((("Q4_K", 1e9), ("Q8_0", 8e9))) == pytest.approx(2.0)


def test_gpu_budget_takes_whole_ffns_first_and_fits_the_device():
    ffn_dev = 3 * QWEN15.d_ff * QWEN15.d_model * 2
    p = plan(QWEN15_ATT, 800 * MB, FLOOR, 512, mode="dense", device=FAST_GPU, gpu_budget=2 << 30)
    assert p.gpu_bytes <= 2 << 30
    assert len(p.gpu_ffn_layers) == min(28, (2 << 30) // ffn_dev)  # 26 of 28 layers
    assert p.gpu_ffn_layers == tuple(range(len(p.gpu_ffn_layers)))
    # the RAM the GPU layers' FFNs no longer need goes to the other layers' neurons
    base = plan(QWEN15_ATT, 800 * MB, FLOOR, 512, mode="dense", device=FAST_GPU)
    assert p.cache_neurons > base.cache_neurons
    assert p.read_bytes_per_token < base.read_bytes_per_token / 5
    assert p.predicted_tok_s > 3 * base.predicted_tok_s
    table = p.describe()
    assert "GPU" in table and "layers 0-25" in table and "layers 26-27" in table


def test_all_layers_fit_the_device_then_attention_follows():
    p = plan(QWEN15_ATT, 800 * MB, FLOOR, 512, mode="sparse", device=FAST_GPU, gpu_budget=8 << 30)
    assert len(p.gpu_ffn_layers) == 28 and len(p.gpu_attention_layers) == 28
    assert p.read_bytes_per_token == 0 and p.cache_bytes == 0


def test_a_slow_device_gets_nothing_unless_forced():
    slow = replace(FAST_GPU, gpu_matvec_bytes_s=1e9)  # slower than the CPU kernels
    p = resident_plan(QWEN15_ATT, 1117 * MB, 4000 * MB, FLOOR, 512, slow, gpu_budget=1 << 30)
    assert p.gpu_ffn_layers == () and p.gpu_bytes == 0
    f = resident_plan(
        QWEN15_ATT, 1117 * MB, 4000 * MB, FLOOR, 512, slow, gpu_budget=1 << 30, gpu_force=True
    )
    assert f.gpu_ffn_layers and f.gpu_bytes <= 1 << 30
    # no device figures (no GPU measured): nothing moves
    n = resident_plan(QWEN15_ATT, 1117 * MB, 4000 * MB, FLOOR, 512, gpu_budget=1 << 30)
    assert n.gpu_bytes == 0


def test_pinning_a_skewed_profile_predicts_fewer_reads():
    rng = np.random.default_rng(0)
    # a power law: a few neurons are active on most tokens
    skewed = [np.sort(rng.pareto(1.2, QWEN15.d_ff))[::-1] for _ in range(QWEN15.n_layers)]
    flat = [np.ones(QWEN15.d_ff) for _ in range(QWEN15.n_layers)]
    kw = dict(mode="sparse", active_fraction=0.5)
    window = plan(QWEN15, 900 * MB, FLOOR, 512, **kw)
    hot = plan(QWEN15, 900 * MB, FLOOR, 512, frequencies=skewed, hot_share=1.0, **kw)
    even = plan(QWEN15, 900 * MB, FLOOR, 512, frequencies=flat, hot_share=1.0, **kw)
    assert hot.pinned_neurons == hot.cache_neurons > 0
    assert hot.read_bytes_per_token < 0.8 * window.read_bytes_per_token
    assert even.read_bytes_per_token == pytest.approx(window.read_bytes_per_token, rel=0.02)
    assert "RAM pinned" in hot.describe()


def test_calibration_is_cached_and_refreshed(tmp_path, monkeypatch):
    from edgerun.device import calibration

    calls = []

    def fake_flash(directory, threads=4, nbytes=0):
        calls.append("flash")
        return {4096: 1e8, 131072: 6e8, 1 << 20: 1e9}

    monkeypatch.setattr(calibration, "measure_flash", fake_flash)
    monkeypatch.setattr(calibration, "measure_cpu", lambda t: ({"Q4_K": 2e9}, 1e-4))
    kw = dict(directory=tmp_path, cache=tmp_path / "c", isolate=False)
    a = calibration.calibrate(2, **kw)
    b = calibration.calibrate(2, **kw)
    assert a == b and calls == ["flash"]
    assert a.flash_rate(131072) == 6e8 and a.cpu_rate("Q4_K") == 2e9
    calibration.calibrate(2, refresh=True, **kw)
    assert calls == ["flash", "flash"]
    for f in (tmp_path / "c").iterdir():  # a broken cache file is measured again
        f.write_text("{not json")
    calibration.calibrate(2, **kw)
    assert calls == ["flash", "flash", "flash"]


def test_measured_flash_and_cpu_figures_are_plausible(tmp_path):
    from edgerun.device.calibration import measure_cpu, measure_flash

    flash = measure_flash(tmp_path, nbytes=8 << 20)
    assert set(flash) == {4096, 32768, 131072, 1 << 20} and min(flash.values()) > 1e6
    assert flash[1 << 20] > flash[4096]  # bigger reads are faster on any storage
    rates, layer_s = measure_cpu(1, repeats=1, formats=("Q8_0",))
    assert 1e8 < rates["Q8_0"] < 1e12 and 0 < layer_s < 0.05
    assert not list(tmp_path.glob(".calibrate-*"))  # the scratch file is gone


def test_calibration_runs_in_a_child_and_leaves_this_process_alone(tmp_path):
    from edgerun.device.calibration import cached, calibrate
    from edgerun.runtime.sysinfo import peak_rss_bytes

    fresh = tmp_path / "offload"  # not made yet, as on a fresh machine
    assert cached(1, directory=fresh, cache=tmp_path / "c") is None  # imports what it needs
    before = peak_rss_bytes()
    figs = calibrate(1, directory=fresh, cache=tmp_path / "c")
    assert peak_rss_bytes() - before < 32 << 20  # the 130 MB of buffers were the child's
    assert figs.cpu_rate("Q4_K") > 0 and figs.flash_rate(4096) > 0
    assert cached(1, directory=fresh, cache=tmp_path / "c") == figs


def test_measured_offload_figures_drive_the_ffn_time():
    from edgerun.offload.plan import OffloadFigures

    off = OffloadFigures(
        sparse_read_s=((0.02, 10e-6), (0.9, 2e-6)),
        stream_read_s=2e-6,
        neuron_compute_s=1e-6,
        gate_compute_s=0.5e-6,
    )
    assert off.read_s(0.01) == 10e-6 and off.read_s(1.0) == 2e-6
    assert off.read_s(0.46) == pytest.approx(6e-6)
    s = plan(QWEN15, 800 * MB, FLOOR, 512, mode="sparse", active_fraction=0.5, offload=off)
    assert s.time_split["flash"] > 0 and s.predicted_tok_s > 0
    slow = OffloadFigures(((0.02, 20e-6), (0.9, 4e-6)), 4e-6, 1e-6, 0.5e-6)
    kw = dict(mode="sparse", active_fraction=0.5)
    assert plan(QWEN15, 800 * MB, FLOOR, 512, offload=slow, **kw).predicted_tok_s < (
        s.predicted_tok_s
    )


def test_dense_streaming_reads_show_only_beyond_the_compute():
    """The row stream reads ahead across layers and tokens, so a token takes the longer
    of its reads and its compute (the bundle's timings do not apply to it)."""
    from edgerun.offload.rowstream import PIECE_BYTES

    for dev in (DeviceFigures(flash_read_bytes_s=0.3e9), DeviceFigures(flash_read_bytes_s=30e9)):
        d = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense", device=dev)
        reads = d.read_bytes_per_token / dev.flash_rate(PIECE_BYTES)
        rest = d.time_split["cpu"] + d.time_split["layers"]
        assert d.time_split["flash"] == pytest.approx(max(0.0, reads - rest))
        assert 1 / d.predicted_tok_s == pytest.approx(max(reads, rest))


def test_offload_path_is_timed_on_a_real_bundle(tmp_path, smollm2_path):
    from edgerun.device.calibration import measure_offload
    from edgerun.offload.bundle import ensure_bundle
    from edgerun.offload.plan import DENSITIES

    bundle = ensure_bundle(smollm2_path, progress=False)
    off = measure_offload(bundle, threads=1)
    assert [q for q, _ in off.sparse_read_s] == list(DENSITIES)
    assert all(0 < s < 0.01 for _, s in off.sparse_read_s)
    # scattered misses cost more per record than dense runs of them
    assert off.read_s(0.02) > off.read_s(0.9)
    assert 0 < off.neuron_compute_s < 1e-3 and 0 < off.gate_compute_s < 1e-3


def test_the_row_stream_rate_is_measured_and_used_for_dense_plans(tmp_path):
    from dataclasses import replace

    from edgerun.device.calibration import measure_stream
    from edgerun.offload.plan import DeviceFigures

    rate = measure_stream(tmp_path, nbytes=16 << 20, cycles=2)
    assert 1e6 < rate < 1e12 and not list(tmp_path.iterdir())  # scratch file removed
    dev = DeviceFigures(flash_by_chunk=((1 << 20, 2e9),))
    assert dev.stream_rate() == 2e9  # unmeasured: the rate of its piece size
    slow = replace(dev, flash_stream_bytes_s=5e8)
    assert slow.stream_rate() == 5e8
    fast_plan = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense", device=dev)
    slow_plan = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense", device=slow)
    reads = slow_plan.read_bytes_per_token / 5e8  # storage-bound at this rate
    assert 1 / slow_plan.predicted_tok_s == pytest.approx(reads)
    assert slow_plan.predicted_tok_s < fast_plan.predicted_tok_s
