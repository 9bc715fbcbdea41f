"""`edgerun bench --suite`: a small matrix end to end, resume, report and plots."""

import json

import pytest

from edgerun.tools.bench_suite import Cell, default_cells, run_suite, write_report

pytestmark = pytest.mark.slow


def test_default_matrix_covers_formats_threads_and_modes():
    cells = default_cells(models=["smollm2-135m"], threads=[1, 2])
    fmts = {c.fmt for c in cells}
    assert fmts == {"own", "q8_0", "q4_k_m", "q3_g64_m", "q2_g64_m"}
    modes = {c.mode for c in cells if c.fmt == "own"}
    assert modes == {"resident", "budget75", "budget50"}
    assert {c.threads for c in cells} == {1, 2}
    assert len({c.key for c in cells}) == len(cells)


def test_a_small_suite_runs_resumes_and_reports(tmp_path):
    cells = [
        Cell("smollm2-135m", "own", 1, "resident", n_prompt=8, n_gen=4, repeats=1),
        Cell("smollm2-135m", "own", 1, "budget50", n_prompt=8, n_gen=4, repeats=1),
    ]
    rows = run_suite(cells, tmp_path)
    assert [r.get("error") for r in rows] == [None, None]
    res, off = rows
    assert res["tg_tok_s"] > 0 and res["pp_tok_s"] > 0 and res["ttft_s"] > 0
    assert off["plan"] == "dense" and off["budget_bytes"] > 0
    assert 4.0 < res["bits_per_weight"] < 8.0  # Q4_1 with a Q8_0 embedding
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # a second run finds both cells done and runs nothing
    again = run_suite(cells, tmp_path)
    assert [r["tg_tok_s"] for r in again] == [r["tg_tok_s"] for r in rows]
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 2
    report = (tmp_path / "report.md").read_text()
    assert "| smollm2-135m | own" in report and "edgerun sysinfo" in report
    for name in ("threads", "bits", "budget", "roofline"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert f"({name}.png)" in report
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["system"]["cpu"]["usable_cores"] >= 1 and len(data["rows"]) == 2


def test_a_cut_line_and_a_failed_cell_run_again(tmp_path):
    good = {"key": "k1", "model": "m", "fmt": "own", "threads": 1, "mode": "resident"}
    (tmp_path / "rows.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps({**good, "key": "k2", "error": "boom"}) + '\n{"key'
    )
    from edgerun.tools.bench_suite import _done

    assert set(_done(tmp_path / "rows.jsonl")) == {"k1"}


def test_the_report_labels_an_emulated_device(tmp_path):
    row = {
        "key": "x",
        "model": "smollm2-135m",
        "fmt": "own",
        "threads": 1,
        "mode": "resident",
        "quant": "Q4_1",
        "bits_per_weight": 5.9,
        "pp_tok_s": 10.0,
        "tg_tok_s": 5.0,
        "ttft_s": 1.0,
        "peak_rss_bytes": 300 << 20,
        "weight_bytes_per_token": 90e6,
        "device_profile": "rpi4: Raspberry Pi 4",
    }
    text = write_report([row], tmp_path).read_text()
    assert "Emulated device" in text and "not a measurement" in text


def test_real_device_rows_sit_beside_the_emulation(tmp_path):
    from edgerun.errors import EdgerunError
    from edgerun.tools.bench_suite import load_real_rows

    base = {"model": "smollm2-135m", "fmt": "own", "threads": 2, "mode": "resident"}
    emulated = {
        **base,
        "key": "e",
        "quant": "Q4_1",
        "bits_per_weight": 5.9,
        "pp_tok_s": 100.0,
        "tg_tok_s": 80.0,
        "ttft_s": 0.5,
        "peak_rss_bytes": 300 << 20,
        "weight_bytes_per_token": 90e6,
        "device_profile": "rpi5: Raspberry Pi 5",
        "compute_scale": 0.29,
        "pp_modelled_tok_s": 29.0,
        "tg_modelled_tok_s": 23.2,
    }
    real_dir = tmp_path / "devices" / "rpi5"
    real_dir.mkdir(parents=True)
    (real_dir / "rows.jsonl").write_text(json.dumps({**base, "tg_tok_s": 20.0}) + "\n")
    real = load_real_rows(real_dir)
    text = write_report([emulated], tmp_path, real).read_text()
    assert "Real device beside the emulation" in text
    assert "| smollm2-135m | own | 2 | resident | 20.0 | 80.0 | 23.2 | 0.86 |" in text
    assert "Modelled" in text and "x0.29" in text
    (real_dir / "rows.jsonl").write_text('{"model": "m"}\n')
    with pytest.raises(EdgerunError, match="lacks one of the fields"):
        load_real_rows(real_dir)
    with pytest.raises(EdgerunError, match="no suite.json"):
        load_real_rows(tmp_path / "nowhere")
