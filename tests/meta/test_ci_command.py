"""CI (.ci/run) runs exactly the README's test command, so what a contributor runs is what
CI times against the suite's ~20 minute budget."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest_lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if "python -m pytest" in ln]


def test_ci_runs_the_readme_test_command() -> None:
    ci = _pytest_lines(ROOT / ".ci" / "run")
    assert len(ci) == 1, ci
    assert ci[0] in _pytest_lines(ROOT / "README.md"), ci[0]
    assert " -n " in ci[0]  # pytest-xdist workers: the Numba compiles use both cores
