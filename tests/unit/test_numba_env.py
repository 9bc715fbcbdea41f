"""The kernel cache directory follows the ops sources (Numba's own key does not)."""

from __future__ import annotations

import os
import time

import pytest

from edgerun.runtime import numba_env


def test_kernel_cache_dir_is_named_by_the_ops_sources_and_prunes_stale_ones(tmp_path):
    stale, recent = tmp_path / "0123456789ab", tmp_path / "ba9876543210"
    stale.mkdir()
    recent.mkdir()
    week_ago = time.time() - (numba_env.KERNEL_CACHE_KEEP_DAYS + 1) * 86400
    os.utime(stale, (week_ago, week_ago))
    path = numba_env.kernel_cache_dir(str(tmp_path))
    assert os.path.isdir(path)
    assert path == numba_env.kernel_cache_dir(str(tmp_path))  # same sources, same place
    assert not stale.exists() and recent.exists()
    # the name is a digest of the ops files' sizes and mtimes: touching one moves it
    ops = os.path.join(os.path.dirname(os.path.dirname(numba_env.__file__)), "ops", "rope.py")
    st = os.stat(ops)
    try:
        os.utime(ops, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        assert numba_env.kernel_cache_dir(str(tmp_path)) != path
    finally:
        os.utime(ops, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize(
    "machine, asked, name",
    [
        ("x86_64", "int8", "numba-int8"),  # generic kernels beside the x86 ones: apart
        ("x86_64", "auto", "numba"),
        ("aarch64", "int8", "numba"),  # ARM's only int8 kernels: the parent's directory
        ("aarch64", "auto", "numba"),
    ],
)
def test_cache_dir_name_keeps_generic_int8_apart_only_on_x86(monkeypatch, machine, asked, name):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setenv("EDGERUN_KERNELS", asked)
    assert numba_env.cache_dir_name() == name
