"""sysinfo.memory_headroom_bytes: the machine's available memory, capped by a memory
cgroup's limit less what its processes hold outside the page cache (v1 and v2)."""

from __future__ import annotations

from pathlib import Path

from edgerun.runtime import sysinfo


def _tree(tmp_path: Path, v2: bool, limit: str, usage: int, cache: int) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    if v2:
        d = root / "app.slice"
        proc = "0::/app.slice\n"
        names = ("memory.max", "memory.current", f"anon 1\nfile {cache}\n")
    else:
        d = root / "memory" / "box"
        proc = "12:pids:/\n9:memory:/box\n1:name=systemd:/\n"
        names = (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            f"cache 7\ntotal_cache {cache}\n",
        )
    d.mkdir(parents=True)
    (d / names[0]).write_text(limit + "\n")
    (d / names[1]).write_text(f"{usage}\n")
    (d / "memory.stat").write_text(names[2])
    pc = tmp_path / "cgroup"
    pc.write_text(proc)
    return root, pc


def test_cgroup_v1_limit_less_unreclaimable_usage(tmp_path):
    root, pc = _tree(tmp_path, False, str(800 << 20), 500 << 20, 300 << 20)
    assert sysinfo._cgroup_memory(root, pc) == (800 << 20, 200 << 20)
    assert sysinfo.memory_headroom_bytes(root, pc) == 600 << 20


def test_cgroup_v2_limit_less_unreclaimable_usage(tmp_path):
    root, pc = _tree(tmp_path, True, str(1 << 30), 700 << 20, 100 << 20)
    assert sysinfo._cgroup_memory(root, pc) == (1 << 30, 600 << 20)
    assert sysinfo.memory_headroom_bytes(root, pc) == (1 << 30) - (600 << 20)


def test_no_limit_is_the_machines_available_memory(tmp_path):
    import psutil

    for v2, limit in ((True, "max"), (False, str(1 << 62))):
        sub = tmp_path / ("v2" if v2 else "v1")
        root, pc = _tree(sub, v2, limit, 1 << 20, 0)
        assert sysinfo._cgroup_memory(root, pc) is None
        avail = psutil.virtual_memory().available
        assert abs(sysinfo.memory_headroom_bytes(root, pc) - avail) < 256 << 20
    missing = tmp_path / "nowhere"
    assert sysinfo._cgroup_memory(missing, missing) is None


def test_an_ancestors_tighter_limit_counts(tmp_path):
    """A container's group without a limit of its own, inside a slice that has one (v2),
    and a v1 group whose parent is tighter than itself."""
    root = tmp_path / "cg"
    parent, child = root / "user.slice", root / "user.slice" / "app"
    child.mkdir(parents=True)
    (parent / "memory.max").write_text(f"{1 << 30}\n")
    (parent / "memory.current").write_text(f"{900 << 20}\n")
    (parent / "memory.stat").write_text("file 100\n")
    (child / "memory.max").write_text("max\n")
    (child / "memory.current").write_text(f"{10 << 20}\n")
    pc = tmp_path / "cgroup"
    pc.write_text("0::/user.slice/app\n")
    assert sysinfo._cgroup_memory(root, pc) == (1 << 30, (900 << 20) - 100)
    v1 = tmp_path / "v1"
    for rel, limit, usage in (("a", 500 << 20, 400 << 20), ("a/b", 800 << 20, 100 << 20)):
        d = v1 / "memory" / rel
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    pc.write_text("4:memory:/a/b\n")
    assert sysinfo._cgroup_memory(v1, pc) == (500 << 20, 400 << 20)  # 100 MiB left, not 700
