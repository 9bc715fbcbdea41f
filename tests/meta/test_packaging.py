"""The wheel ships every module: build it, install it alone, import each module from it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _source_modules() -> set[str]:
    mods = set()
    for p in (ROOT / "edgerun").rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods.add(".".join(parts))
    return mods


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
    )
    (whl,) = out.glob("edgerun-*.whl")
    return whl


def test_wheel_holds_every_module_and_the_manifests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [
        m
        for m in _source_modules()
        if m.replace(".", "/") + ".py" not in names
        and m.replace(".", "/") + "/__init__.py" not in names
    ]
    assert not missing, f"modules left out of the wheel: {sorted(missing)}"
    manifests = {p.name for p in (ROOT / "edgerun" / "models").glob("*.toml")}
    assert manifests and all(f"edgerun/models/{m}" in names for m in manifests)
    # the chat app lives inside the package, its styles beside it; no top-level `tui`
    assert "edgerun/tui/app.tcss" in names
    assert not any(n.startswith("tui/") for n in names)


def test_every_module_imports_from_the_unpacked_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    mods = sorted(m for m in _source_modules() if not m.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        f"mods = {mods!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    mod = importlib.import_module(m)\n"
        f"    if not mod.__file__.startswith({str(site)!r}): bad.append((m, mod.__file__))\n"
        "from edgerun import registry\n"
        "assert registry.manifests(), 'no manifests'\n"
        "from edgerun.tui.app import CSS_PATH, ChatApp\n"
        "assert ChatApp.CSS_PATH == CSS_PATH and CSS_PATH.is_file(), CSS_PATH\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    # Run away from the checkout so the source tree cannot shadow the wheel.
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
