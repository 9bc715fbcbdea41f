"""Direct I/O for offloaded weights: reads that go to storage, not the page cache.

A RAM budget counts the page cache our reads leave behind (DESIGN.md), so offloaded
bytes are read with O_DIRECT into aligned buffers; where a filesystem refuses O_DIRECT
the reader falls back to buffered reads followed by POSIX_FADV_DONTNEED on the range.
Small random reads only reach the device's throughput with many in flight (PERF_NOTES:
4 KiB reads run at 54 MB/s on 1 thread, 184 MB/s on 8), so a call's ranges are spread
over a small thread pool of positional reads; os.preadv releases the GIL, so the reads
also overlap with nogil kernels on the calling thread.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError

ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the block size
CHUNK = 1 << 20  # a longer range is split so one big read also spreads over the threads
IO_THREADS = 4  # reader threads by default; each stages up to CHUNK of a direct read


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array of nbytes whose data address is a multiple of align."""
    if align <= 0 or align & (align - 1):
        raise InvalidArgumentError(f"alignment must be a power of two, got {align}")
    if nbytes < 0:
        raise InvalidArgumentError(f"cannot allocate {nbytes} bytes")
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]  # the view keeps `raw` alive


def coalesce(sorted_ids: np.ndarray, max_gap: int) -> list[tuple[int, int]]:
    """Runs [start, stop) covering sorted ids, merging runs separated by <= max_gap ids.

    Reading a few unneeded neighbours is cheaper than another small random read, so
    callers pick max_gap from the record size (e.g. 32 KiB of records). Duplicates are
    allowed; unsorted input is an error.
    """
    if max_gap < 0:
        raise InvalidArgumentError(f"max_gap must be >= 0, got {max_gap}")
    ids = np.asarray(sorted_ids).reshape(-1).astype(np.int64, copy=False)
    if ids.size == 0:
        return []
    step = np.diff(ids)
    if step.size and step.min() < 0:
        raise InvalidArgumentError("coalesce needs ids sorted in ascending order")
    brk = np.flatnonzero(step > max_gap + 1)
    starts = np.concatenate((ids[:1], ids[brk + 1]))
    stops = np.concatenate((ids[brk] + 1, ids[-1:] + 1))
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def _byte_view(out: np.ndarray) -> np.ndarray:
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("read buffers must be writeable C-contiguous numpy arrays")
    return out.reshape(-1).view(np.uint8)


@contextmanager
def scratch_file(directory: Path, nbytes: int, tag: str = "scratch") -> Iterator[Path]:
    """A file of `nbytes` random bytes in `directory`, on storage (fsynced) and out of the
    page cache, for read measurements; deleted afterwards."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".{tag}-{os.getpid()}.bin"
    block = np.random.default_rng(0).integers(0, 255, 1 << 22, dtype=np.uint8).tobytes()
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        yield path
    finally:
        path.unlink(missing_ok=True)


def interpolate_rate(points, size: int) -> float:
    """Bytes/s at `size`-byte reads from (size, bytes/s) pairs or a {size: bytes/s} map,
    interpolated on log2(size), clamped at the ends."""
    items = points.items() if hasattr(points, "items") else points
    pts = sorted((int(k), float(v)) for k, v in items)
    if not pts:
        raise InvalidArgumentError("read rates need at least one (size, bytes/s) point")
    if size <= pts[0][0]:
        return pts[0][1]
    for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
        if size <= s1:
            f = (math.log2(size) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return r0 + f * (r1 - r0)
    return pts[-1][1]


class DirectReader:
    """Parallel positional reads of one file, bypassing the page cache.

    read_into() fills caller buffers from many (offset, length) ranges. With O_DIRECT,
    ranges whose offset, length and destination are all aligned are read straight into
    the destination; others read the aligned superset into a per-thread staging buffer
    and copy. Counters (bytes_read, bytes_delivered, read_seconds, reads) feed the
    per-token I/O breakdown; reset them with reset_stats().
    """

    def __init__(
        self, path: str | os.PathLike, threads: int = IO_THREADS, direct: bool | None = None
    ) -> None:
        """direct: None tries O_DIRECT and falls back; True requires it; False never uses it."""
        if threads < 1:
            raise InvalidArgumentError(f"I/O threads must be >= 1, got {threads}")
        self.path = Path(path)
        self.threads = threads
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ModelNotFoundError(f"{self.path}: file not found") from None
        self.size = os.fstat(fd).st_size
        self.direct = False
        if direct is not False:
            dfd = self._open_direct()
            if dfd is not None:
                os.close(fd)
                fd, self.direct = dfd, True
            elif direct:
                os.close(fd)
                raise InvalidArgumentError(
                    f"{self.path}: the filesystem does not support O_DIRECT reads; "
                    "use direct=None to fall back to buffered reads"
                )
        self._fd: int | None = fd
        # an offload/throttle.StorageThrottle makes reads take as long as on a slower
        # device (device profiles); None reads at this machine's speed
        self.throttle = None
        self._local = threading.local()
        self._lock = threading.Lock()
        # the calling thread does one share of every read, the pool the others
        self._pool: ThreadPoolExecutor | None = None
        if threads > 1:
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="edgerun-io")
        self.reset_stats()

    def _open_direct(self) -> int | None:
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            dfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:
            return None
        try:  # some filesystems accept the flag at open and refuse the read
            os.preadv(dfd, [aligned_empty(ALIGN)], 0)
        except OSError:
            os.close(dfd)
            return None
        return dfd

    # -- stats ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.bytes_read = 0  # from storage, alignment padding included
        self.bytes_delivered = 0  # into caller buffers
        self.read_seconds = 0.0  # wall time inside read_into
        self.reads = 0  # positional read syscalls

    def stats(self) -> dict[str, float]:
        return {
            "bytes_read": self.bytes_read,
            "bytes_delivered": self.bytes_delivered,
            "read_seconds": self.read_seconds,
            "reads": self.reads,
        }

    # -- reads ---------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> np.ndarray:
        """One range into a new aligned uint8 array."""
        out = aligned_empty(length)
        self.read_into([(offset, length)], out)
        return out

    def read_into(
        self,
        ranges: Sequence[tuple[int, int]],
        out: np.ndarray,
        out_offsets: Sequence[int] | None = None,
    ) -> int:
        """Read file ranges (offset, length) into out at out_offsets (byte offsets into
        out's memory; default: packed back to back). Returns the bytes delivered."""
        fd = self._fd
        if fd is None:
            raise InvalidArgumentError(f"{self.path}: reader is closed")
        dst = _byte_view(out)
        t0 = time.perf_counter()
        tasks: list[tuple[int, int, int]] = []
        pos = 0
        if out_offsets is not None and len(out_offsets) != len(ranges):
            raise InvalidArgumentError(
                f"{len(ranges)} ranges but {len(out_offsets)} output offsets"
            )
        for k, (off, length) in enumerate(ranges):
            off, length = int(off), int(length)
            at = pos if out_offsets is None else int(out_offsets[k])
            if off < 0 or length < 0 or at < 0:
                raise InvalidArgumentError(f"bad read range ({off}, {length}) -> {at}")
            if off + length > self.size:
                raise ModelFormatError(
                    f"{self.path}: read of bytes [{off}, {off + length}) runs past the end "
                    f"of the file ({self.size} bytes); the file is truncated, delete it"
                )
            if at + length > dst.size:
                raise InvalidArgumentError(
                    f"read of {length} bytes at output offset {at} overflows a "
                    f"{dst.size}-byte buffer"
                )
            for c in range(0, length, CHUNK):
                tasks.append((off + c, min(CHUNK, length - c), at + c))
            pos = at + length
        groups = [tasks[i :: self.threads] for i in range(min(self.threads, len(tasks)))]
        if self._pool is not None and len(groups) > 1:
            futures = [self._pool.submit(self._run, fd, g, dst) for g in groups[1:]]
            results = [self._run(fd, groups[0], dst)] + [f.result() for f in futures]
        else:
            results = [self._run(fd, tasks, dst)]
        delivered = sum(t[1] for t in tasks)
        with self._lock:
            self.bytes_read += sum(r[0] for r in results)
            self.reads += sum(r[1] for r in results)
            self.bytes_delivered += delivered
            self.read_seconds += time.perf_counter() - t0
        return delivered

    def _run(self, fd: int, tasks: list[tuple[int, int, int]], dst: np.ndarray) -> tuple[int, int]:
        nbytes = calls = 0
        read = self._direct_one if self.direct else self._buffered_one
        throttle = self.throttle
        for off, length, at in tasks:
            deadline = throttle.admit(off, length) if throttle is not None else 0.0
            b, c = read(fd, off, length, dst, at)
            if throttle is not None:
                throttle.wait_until(deadline)  # as long as the emulated device takes
            nbytes += b
            calls += c
        return nbytes, calls

    def _fill(self, fd: int, buf: np.ndarray, off: int, need: int) -> tuple[int, int]:
        """preadv until `need` bytes landed in buf (short reads happen at EOF and on signals)."""
        got = calls = 0
        mv = memoryview(buf)
        while got < need:
            n = os.preadv(fd, [mv[got:]], off + got)
            calls += 1
            if n <= 0:
                break
            got += n
        if got < need:
            raise ModelFormatError(
                f"{self.path}: short read at byte {off + got} ({got} of {need} bytes); "
                "the file changed or is truncated"
            )
        return got, calls

    def _staging(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = aligned_empty(max(nbytes, CHUNK + 2 * ALIGN))
            self._local.buf = buf
        return buf

    def _direct_one(
        self, fd: int, off: int, length: int, dst: np.ndarray, at: int
    ) -> tuple[int, int]:
        if length == 0:
            return 0, 0
        target = dst[at : at + length]
        if not (off | length | target.ctypes.data) % ALIGN:
            return self._fill(fd, target, off, length)
        a0 = off - off % ALIGN
        a1 = min(-(-(off + length) // ALIGN) * ALIGN, -(-self.size // ALIGN) * ALIGN)
        stage = self._staging(a1 - a0)[: a1 - a0]
        # the block past EOF reads short; _fill insists only on the bytes we need
        got, calls = self._fill(fd, stage, a0, off + length - a0)
        target[:] = stage[off - a0 : off - a0 + length]
        return got, calls

    def _buffered_one(
        self, fd: int, off: int, length: int, dst: np.ndarray, at: int
    ) -> tuple[int, int]:
        if length == 0:
            return 0, 0
        got, calls = self._fill(fd, dst[at : at + length], off, length)
        # drop whole pages only: widen to page bounds so the edges do not linger
        a0 = off - off % ALIGN
        os.posix_fadvise(fd, a0, off + length - a0, os.POSIX_FADV_DONTNEED)
        return got, calls

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def drop_own_page_cache(directories: Sequence[str | os.PathLike] = ()) -> int:
    """Drop the clean page-cache pages no mapping uses of the files this process has
    mapped (its libraries, the model file) and of the files under `directories` (the
    kernel cache); returns the files advised. Linux; elsewhere a no-op returning 0.

    Why: a memory cgroup counts that page cache against the budget. Left behind by
    imports and by the readahead of library faults (~100-170 MiB), it kept a cgroup of
    the budget at its limit, and there direct I/O ran 2.4x slower (measured: 2 MiB
    O_DIRECT reads 0.97 GB/s at the limit, 2.35 GB/s below it; Qwen2.5-Coder-1.5B at
    800 MiB decoded 1.0 tok/s instead of 2.4). Mapped pages stay: POSIX_FADV_DONTNEED
    leaves them alone."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    mappings = _file_mappings()
    if mappings is None:
        return 0
    files = {path for _, _, path in mappings} | _module_files()
    return drop_page_cache([*files, *directories])


def _file_mappings() -> list[tuple[int, int, str]] | None:
    """(start, end, path) of this process's file-backed mappings (/proc/self/maps);
    None where there is no such file."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            out.append((lo, hi, parts[5].rstrip("\n")))
    return out


def _module_files() -> set[str]:
    """The source and bytecode files of the imported modules: Python reads them, it does
    not map them, and their page cache stays charged (`edgerun bench` under a budget:
    ~50 MiB left after the mapped files' was dropped)."""
    out: set[str] = set()
    for mod in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            path = getattr(mod, attr, None)
            if isinstance(path, str) and path.startswith("/"):
                out.add(path)
    return out


# Libraries mapped at least this large fault in without readahead under a budget.
LARGE_LIBRARY_BYTES = 64 << 20


def random_access_large_libraries(min_bytes: int = LARGE_LIBRARY_BYTES) -> int:
    """madvise(MADV_RANDOM) on this process's mappings of shared libraries of at least
    min_bytes; returns the libraries advised. Linux; elsewhere a no-op returning 0.

    Why: loading the kernels from Numba's cache runs LLVM, and each fault on the 178 MB
    libllvmlite.so read a readahead window around it. Under `--ram-budget 800M` the
    1.5B's warm-up and first prompt took 137 MiB of page cache, 121 of it llvmlite's
    (fincore), which a cgroup charges: 887 MiB at the peak, and in a cgroup of the
    budget + 5% (840 MiB) decode at the limit ran 1.4 tok/s instead of 3.7. With random
    access only the pages LLVM touches are read."""
    if not hasattr(mmap, "MADV_RANDOM"):
        return 0
    return len(_advise_large_libraries(mmap.MADV_RANDOM, min_bytes))


_MADV_PAGEOUT = 21  # Linux 5.4 (mmap.MADV_PAGEOUT from Python 3.12 on some builds)


def can_page_out() -> bool:
    """Whether this kernel takes MADV_PAGEOUT (Linux 5.4 or newer)."""
    if not sys.platform.startswith("linux"):
        return False
    import platform

    try:
        major, minor = (int(v) for v in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 4)


def page_out_large_libraries(min_bytes: int = LARGE_LIBRARY_BYTES) -> int:
    """madvise(MADV_PAGEOUT) on this process's mappings of shared libraries of at least
    min_bytes (LLVM's): the kernel reclaims their pages now. Returns the bytes of RSS it
    gave back (0 where Linux is older than 5.4 or this is not Linux).

    Why: once the kernels are loaded nothing calls into LLVM, yet the 1.5B's warm-up
    left 67 MiB of libllvmlite.so resident, which a cgroup charges as page cache.
    Paged out, decode and long prompts faulted 0 of it back (Zen 3, 800M: RSS 708 ->
    642 MiB), so a budgeted load holds that much more of the FFN after its warm-up
    (DenseStreamStore.hold_more). A later compile faults back only what it touches.
    Reclaiming never discards data: dirty private pages (relocations) stay.

    Paging out unmaps the pages but can leave them in the page cache, which the cgroup
    still charges: 70 MiB of libllvmlite.so stayed cached after a 1.5B warm-up, a long
    prompt's peak 927 MB against an 839 MB budget. So the files' now unmapped pages are
    dropped too (POSIX_FADV_DONTNEED; pages another process maps stay)."""
    from edgerun.runtime.sysinfo import current_rss_bytes

    before = current_rss_bytes()
    paths = _advise_large_libraries(_MADV_PAGEOUT, min_bytes)
    if not paths:
        return 0
    drop_page_cache(paths)
    return max(0, before - current_rss_bytes())


def _advise_large_libraries(advice: int, min_bytes: int) -> set[str]:
    """madvise(advice) on the mappings of shared libraries of at least min_bytes; the
    files whose mappings took it."""
    if not sys.platform.startswith("linux"):
        return set()
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return set()
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    size: dict[str, int] = {}
    took: set[str] = set()
    for lo, hi, path in _file_mappings() or ():
        if ".so" not in path:
            continue
        if path not in size:
            try:
                size[path] = os.stat(path).st_size
            except OSError:
                size[path] = 0
        if size[path] >= min_bytes and madvise(lo, hi - lo, advice) == 0:
            took.add(path)
    return took


# Allocations at least this large are mapped and unmapped under a budget (glibc).
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_large_frees_to_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc serve allocations of `threshold` bytes or more with their own mappings,
    so that freeing them returns the memory; returns whether it took. Elsewhere False.

    Why: glibc raises its mmap threshold each time a mapped block is freed (up to 32
    MiB), after which a prompt chunk's temporaries come from the heap and stay there.
    Qwen2.5-1.5B at --ram-budget 800M, a 1990-token prompt: RSS 614 -> 711 MiB and held
    after the answer (malloc_trim gave 54 MiB back), past the budget the plan kept."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1


def drop_page_cache(paths: Iterable[str | os.PathLike]) -> int:
    """Advise the kernel to drop the clean, unmapped page-cache pages of `paths` (files,
    or every file under a directory); returns the files advised. Linux; elsewhere 0."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    files: set[str] = set()
    for p in map(Path, paths):
        if p.is_dir():
            files.update(str(f) for f in p.rglob("*") if f.is_file())
        else:
            files.add(str(p))
    n = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # deleted, or not ours to open
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n
