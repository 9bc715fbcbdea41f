"""Device profiles: emulate a smaller device (a Raspberry Pi, a laptop) on a bigger one.

One TOML file each in edgerun/devices/ (or any path), with its assumptions and sources.
A profile caps the threads and the RAM budget, and rate-limits the offload reader to the
device's storage (offload/throttle.py: sequential and random MB/s by read size). Compute
is not scaled unless the profile gives a factor (`compute.scale`: the device's decode speed
over this machine kind's, from published figures); bench then adds modelled figures,
labelled as a model, beside the measured ones. What the
emulation cannot change: the CPU's kernels (an x86 host runs its own path, not NEON) and
reads through the page cache (a resident model's first load).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from edgerun.errors import EdgerunError, ModelFormatError

__all__ = ["DeviceProfile", "device_profiles", "load_device_profile"]

KERNEL_PATHS = ("portable", "avx2", "vnni", "int8")


def _dir() -> Path:
    return Path(__file__).resolve().parent.parent / "devices"


def device_profiles() -> list[str]:
    """The names of the profiles that ship with edgerun."""
    return sorted(p.stem for p in _dir().glob("*.toml"))


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    title: str
    threads: int
    ram_bytes: int
    ram_budget_bytes: int
    storage_name: str
    sequential: dict[int, float]  # read size -> bytes/s
    random: dict[int, float]
    compute_scale: float | None  # device decode speed / this machine's, where one is known
    compute_note: str
    simd: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    path: str = ""
    extra: dict = field(default_factory=dict)
    kernels: str | None = None  # the kernel path the device's CPU takes (None: this host's)

    def throttle(self):
        """A StorageThrottle with this device's storage timing."""
        from edgerun.offload.throttle import StorageThrottle

        return StorageThrottle(self.sequential, self.random)

    def describe(self) -> str:
        mb = 1e6
        seq = ", ".join(
            f"{_size_text(k)} {v / mb:,.0f}" for k, v in sorted(self.sequential.items())
        )
        rnd = ", ".join(f"{_size_text(k)} {v / mb:,.0f}" for k, v in sorted(self.random.items()))
        scale = (
            f"modelled x{self.compute_scale:g} ({self.compute_note})"
            if self.compute_scale
            else f"not scaled: {self.compute_note}"
        )
        return (
            f"{self.name}: {self.title}; {self.threads} threads, RAM budget "
            f"{self.ram_budget_bytes / 2**30:.1f} of {self.ram_bytes / 2**30:.0f} GiB; "
            f"storage {self.storage_name}: sequential MB/s {seq}; random MB/s {rnd}; "
            f"compute {scale}" + (f"; kernels {self.kernels}" if self.kernels else "")
        )


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _size(text: str, path: Path, fld: str) -> int:
    m = re.fullmatch(r"(?i)\s*(\d+)\s*([km]?)i?b?\s*", str(text))
    if not m:
        raise ModelFormatError(
            f"{path}: field '{fld}': expected a size like 4K or 1M, found {text!r}"
        )
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20}[m.group(2).lower()]


def load_device_profile(name_or_path: str | Path) -> DeviceProfile:
    """A shipped profile by name (`device_profiles()`) or a TOML file; every field is
    checked and a bad one named."""
    from edgerun.offload.plan import parse_budget

    p = Path(name_or_path)
    if not p.suffix:
        p = _dir() / f"{name_or_path}.toml"
        if not p.exists():
            raise EdgerunError(
                f"unknown device profile {name_or_path!r}; known: {', '.join(device_profiles())}"
                " (or give a .toml file)"
            )
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise EdgerunError(f"{p}: cannot read the device profile: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{p}: invalid device profile: {e}") from None

    def need(d: dict, key: str, kind, where: str = ""):
        fld = f"{where}{key}"
        if key not in d:
            raise ModelFormatError(f"{p}: device profile lacks field '{fld}'")
        v = d[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ModelFormatError(
                f"{p}: field '{fld}': expected {getattr(kind, '__name__', kind)}, found "
                f"{type(v).__name__} {v!r}"
            )
        return v

    st = need(data, "storage", dict)
    rates = {}
    for kind in ("sequential", "random"):
        table = need(st, f"{kind}_mb_s", dict, "storage.")
        out = {}
        for k, v in table.items():
            fld = f"storage.{kind}_mb_s.{k}"
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ModelFormatError(f"{p}: field '{fld}': expected MB/s > 0, found {v!r}")
            out[_size(k, p, fld)] = float(v) * 1e6
        if not out:
            raise ModelFormatError(f"{p}: field 'storage.{kind}_mb_s' is empty")
        rates[kind] = out
    threads = need(data, "threads", int)
    if threads < 1:
        raise ModelFormatError(f"{p}: field 'threads': expected >= 1, found {threads}")
    try:
        ram = parse_budget(need(data, "ram", str))
        budget = parse_budget(need(data, "ram_budget", str))
    except EdgerunError as e:
        raise ModelFormatError(f"{p}: {e}") from None
    if budget > ram:
        raise ModelFormatError(f"{p}: field 'ram_budget' ({budget}) exceeds 'ram' ({ram})")
    comp = data.get("compute", {})
    scale = comp.get("scale")
    if scale is not None and (not isinstance(scale, (int, float)) or scale <= 0):
        raise ModelFormatError(
            f"{p}: field 'compute.scale': expected a factor > 0, found {scale!r}"
        )
    kernels = comp.get("kernels")
    if kernels is not None and kernels not in KERNEL_PATHS:
        raise ModelFormatError(
            f"{p}: field 'compute.kernels': expected one of {', '.join(KERNEL_PATHS)}, "
            f"found {kernels!r}"
        )
    src = data.get("sources", {})
    return DeviceProfile(
        name=need(data, "name", str),
        title=need(data, "title", str),
        threads=threads,
        ram_bytes=ram,
        ram_budget_bytes=budget,
        storage_name=str(st.get("name", "")),
        sequential=rates["sequential"],
        random=rates["random"],
        compute_scale=float(scale) if scale is not None else None,
        compute_note=str(comp.get("note", "")),
        simd=tuple(data.get("simd", ())),
        sources=tuple(src.get("published", ())),
        assumptions=tuple(src.get("assumptions", ())),
        path=str(p),
        kernels=kernels,
    )
