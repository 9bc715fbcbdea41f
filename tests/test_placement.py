"""The placement planner: budget parsing, the minimum, and a plan that fits."""

import math

import pytest

from edgerun.errors import BudgetError, EdgerunError
from edgerun.sched.placement import Footprint, minimum_budget, parse_budget, plan, resident_plan

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


def test_dense_mode_reads_more_than_sparse():
    d = plan(QWEN15, 800 * MB, FLOOR, 512, mode="dense")
    s = plan(QWEN15, 800 * MB, FLOOR, 512, mode="sparse", active_fraction=0.3)
    assert d.read_bytes_per_token > s.read_bytes_per_token


def test_a_model_that_fits_stays_resident():
    file_bytes = 1117 * MB
    assert resident_plan(QWEN15, file_bytes, 800 * MB, FLOOR, 512) is None
    p = resident_plan(QWEN15, file_bytes, 2000 * MB, FLOOR, 512)
    assert p is not None and p.mode == "resident" and p.read_bytes_per_token == 0
    assert p.used_bytes <= 2000 * MB and "resident" in p.describe()
