"""`edgerun bench` and benchmarks/memory.py on the real default model: report shape and sanity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_bench_json_report(capsys, smollm2_path):
    rc = main(
        ["bench", "-m", str(smollm2_path), "-p", "16", "-n", "8", "-t", "1,2", "-r", "2"]
        + ["--no-bandwidth", "--json"]
    )
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"] == smollm2_path.name
    assert rep["size_bytes"] == smollm2_path.stat().st_size
    assert 130e6 < rep["params"] < 140e6  # SmolLM2-135M
    assert rep["quant"].startswith("Q4_1")
    assert [(r["threads"], r["test"]) for r in rep["rows"]] == [
        (1, "pp16"),
        (1, "tg8"),
        (2, "pp16"),
        (2, "tg8"),
    ]
    for r in rep["rows"]:
        assert len(r["samples"]) == 2 and all(s > 0 for s in r["samples"])
        assert min(r["samples"]) <= r["median"] <= max(r["samples"])
    # Memory: the largest KV cache the bench fills is 16 positions; the weights are mapped.
    assert rep["kv_bytes"] == 2 * 30 * 3 * 16 * 64 * 4
    assert rep["runtime_rss_bytes"] < rep["peak_rss_bytes"]
    assert rep["peak_rss_bytes"] - rep["runtime_rss_bytes"] < 2.5 * rep["size_bytes"]
    assert rep["weight_bytes_per_token"] < rep["size_bytes"]


def test_bench_times_decode_on_the_threads_generate_decodes_with(smollm2):
    """Without a thread list, a model whose decode steps leave a streamed model's reader a
    core is timed the same way: prompts on all its threads, decode on one fewer."""
    from edgerun.tools import bench

    if smollm2.threads < 2:
        pytest.skip("needs 2 threads to leave one")
    saved = smollm2.engine.governor.decode_reserve
    smollm2.engine.governor.decode_reserve = 1
    try:
        rep = bench.run(smollm2, 8, 4, repeats=1, bandwidth=False, progress=False, predict=False)
    finally:
        smollm2.engine.governor.decode_reserve = saved
    t = smollm2.threads
    assert [(r["threads"], r["test"]) for r in rep["rows"]] == [(t, "pp8"), (t - 1, "tg4")]


def test_bench_table_has_memory_line(capsys, smollm2_path):
    assert (
        main(
            ["bench", "-m", str(smollm2_path), "-p", "8", "-n", "4", "-r", "1"] + ["--no-bandwidth"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| pp8 |" in out and "| tg4 |" in out
    assert "peak RSS" in out and "runtime before load" in out


def test_memory_benchmark_measures_edgerun_in_a_fresh_process(smollm2_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "-m", str(smollm2_path)]
        + ["-c", "256", "-p", "16", "-n", "8", "-r", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout[out.stdout.index("[") :])
    row = next(r for r in rows if r["engine"] == "edgerun")
    assert row["n_ctx"] == 256
    assert row["kv_bytes"] == 2 * 30 * 3 * 256 * 64 * 4
    assert row["file_bytes"] == smollm2_path.stat().st_size
    assert row["floor_bytes"] < row["peak_rss_bytes"]
    # The weights are memory-mapped: the model's share above the runtime is near file + KV.
    assert row["ratio_above_floor"] < 2.0


def test_stream_sum_is_the_array_sum():
    import numpy as np

    from edgerun.device.bandwidth import _stream_sum

    a = np.random.default_rng(0).random((8, 1000 * 16 + 7), dtype=np.float32)
    assert _stream_sum(a) == pytest.approx(float(a.sum(dtype=np.float64)), rel=1e-5)


def test_a_reference_engine_that_cannot_decode_is_reported_not_fatal(tmp_path, monkeypatch):
    # on sys.path for this test only: benchmarks/kernels.py would shadow the `kernels`
    # package that transformers (>= 5.25) imports in later tests
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from llamacpp_ref import describe_exit, llama_cpp_unusable

    assert describe_exit(-11) == "signal SIGSEGV" and describe_exit(1) == "exit 1"
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    why = llama_cpp_unusable(str(bad))
    assert why is not None and "llama-cpp-python" in why and "pip install" in why
