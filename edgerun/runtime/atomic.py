"""Atomic file writes: a reader sees the old file or the new one, never a torn one.

Temp file in the same directory, fsync, rename over the target, fsync the directory (so
the rename itself survives a power cut). A writer killed at any point leaves the previous
version intact and at most a stray `.tmp` file, which no reader takes as valid.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def check_free_space(directory: str | os.PathLike, needed: int, what: str) -> None:
    """Refuse before writing when `directory` cannot hold `needed` more bytes (a full disk
    found halfway through costs the time spent and leaves a partial file behind)."""
    from edgerun.errors import DiskSpaceError

    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return  # unknown: let the write find out
    if free < needed:
        raise DiskSpaceError(
            f"not enough space for {what} in {directory}: needs {needed / 2**20:.0f} MiB, "
            f"{free / 2**20:.0f} MiB free; free some space or choose another location"
        )


def disk_full_error(e: OSError, path: str | os.PathLike, what: str) -> Exception:
    """A clear DiskSpaceError for ENOSPC / EDQUOT, else the OSError itself."""
    from edgerun.errors import DiskSpaceError

    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return DiskSpaceError(f"the disk is full writing {what} ({path}); free some space")
    return e


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call write(temp_path) to produce the content, then put it at `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_full_error(e, path, path.name) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    return write_atomic(path, lambda p: p.write_bytes(data))
