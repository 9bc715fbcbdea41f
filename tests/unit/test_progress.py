"""edgerun.runtime.progress: whole lines into logs and pipes, a rich bar on a terminal."""

from __future__ import annotations

import io

import pytest

from edgerun.runtime import progress
from edgerun.runtime.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_output_is_whole_lines_and_bounded() -> None:
    out = io.StringIO()
    with progress_bar("assembling model.gguf", total=500_000_000, unit="B", stream=out) as adv:
        for _ in range(500):  # 500 chunks of 1 MB: a \r bar would redraw 500 times
            adv(1_000_000)
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert 2 <= len(lines) <= progress.LINE_STEPS + 2  # start, one per 10%, end
    assert lines[0] == "assembling model.gguf: 0/500 MB (0%)"
    assert lines[-1].startswith("assembling model.gguf: 500/500 MB (100%), done in ")


def test_absolute_updates_and_a_new_description_per_step() -> None:
    out = io.StringIO()
    with progress_bar("converting", total=272, unit="tensors", stream=out) as adv:
        for i in range(272):
            adv.update(i + 1, description=f"converting blk.{i}")
    lines = out.getvalue().splitlines()
    assert len(lines) <= progress.LINE_STEPS + 2
    assert lines[0] == "converting: 0/272 tensors (0%)"
    assert lines[-1].startswith("converting blk.271: 272/272 tensors (100%), done in ")


def test_unknown_total_prints_by_time_not_by_step(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    with progress_bar("perplexity", stream=out) as adv:
        for _ in range(1000):
            now[0] += 0.1  # 100 s in all: a line per LINE_INTERVAL_S
            adv(1)
    lines = out.getvalue().splitlines()
    assert len(lines) <= 100 / progress.LINE_INTERVAL_S + 2
    assert lines[-1] == "perplexity: 1000, done in 100.0 s"


def test_failure_says_where_it_stopped() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), progress_bar("x", total=10, stream=out) as adv:
        adv(3)
        raise RuntimeError("boom")
    assert out.getvalue().splitlines()[-1] == "x: 3/10 (30%), stopped"


def test_disabled_prints_nothing() -> None:
    out = io.StringIO()
    with progress_bar("x", total=10, stream=out, enabled=False) as adv:
        adv(10)
    assert out.getvalue() == ""


def test_terminal_gets_a_rich_bar() -> None:
    out = _Terminal()
    with progress_bar("converting", total=5, unit="tensors", stream=out) as adv:
        for i in range(5):
            adv(1, description=f"converting t{i}")
    with progress_bar("bytes", total=3_000_000, unit="B", stream=out) as adv:
        adv.update(3_000_000)
    with progress_bar("open-ended", stream=out) as adv:
        adv(7)
    text = out.getvalue()
    assert "converting t4" in text and "5/5" in text and "open-ended" in text
