"""The built-in text: Python's own pydoc topic help (`pydoc_data.topics`, shipped with
every CPython), topics in sorted order.

Evaluation (edgerun.tools.perplexity) reads from the start; calibration (the imatrix in
edgerun.tools.convert, offload's sparsity thresholds) uses the last quarter, so the two
never overlap while an evaluation stays below ~75% of the corpus (~100k tokens). Plain
text: it knows no model, so any layer may use it.
"""

from __future__ import annotations

__all__ = ["CALIBRATION_FRACTION", "calibration_code", "calibration_text", "evaluation_text"]

CALIBRATION_FRACTION = 0.25


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def evaluation_text() -> str:
    """The built-in evaluation text (pydoc_data.topics, sorted by topic)."""
    return _corpus()


def calibration_text() -> str:
    """The last quarter of the corpus: calibration data disjoint from the evaluation head."""
    text = _corpus()
    return text[int(len(text) * (1 - CALIBRATION_FRACTION)) :]


def calibration_code() -> str:
    """Python source for calibrating on code: the standard library's argparse module
    (ships with every CPython; no evaluation here reads it)."""
    import argparse
    from pathlib import Path

    return Path(argparse.__file__).read_text(encoding="utf-8")
