import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.offload import io
from edgerun.offload.io import ALIGN, DirectReader, aligned_empty, coalesce

SIZE = 5 * ALIGN + 1234  # not a multiple of the block size: the tail block reads short


def _supports_direct(d) -> bool:
    p = os.path.join(d, ".odirect-probe")
    with open(p, "wb") as f:
        f.write(b"\0" * ALIGN)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    else:
        try:
            os.preadv(fd, [aligned_empty(ALIGN)], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    finally:
        os.unlink(p)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A random file in a directory that takes O_DIRECT (/tmp does on ext4; tmpfs may not)."""
    d = tmp_path_factory.mktemp("odirect")
    if not _supports_direct(d):
        from edgerun.registry import cache_dir

        d = cache_dir() / "test-odirect"
        d.mkdir(parents=True, exist_ok=True)
        if not _supports_direct(d):
            pytest.skip("no directory here supports O_DIRECT")
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = d / "data.bin"
    data.tofile(path)
    return path, data


@pytest.fixture(scope="module", params=[None, False], ids=["direct", "fallback"])
def reader(request, data_file):
    with DirectReader(data_file[0], threads=3, direct=request.param) as r:
        assert r.direct == (request.param is None)
        yield r


ranges_st = st.lists(
    st.integers(0, SIZE).flatmap(lambda o: st.tuples(st.just(o), st.integers(0, SIZE - o))),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(ranges=ranges_st)
def test_random_ranges_match_plain_reads(reader, data_file, ranges):
    _, data = data_file
    out = np.full(sum(n for _, n in ranges), 7, np.uint8)
    assert reader.read_into(ranges, out) == out.size
    expect = np.concatenate([data[o : o + n] for o, n in ranges])
    assert np.array_equal(out, expect)


def test_scatter_to_offsets_and_tail(reader, data_file):
    _, data = data_file
    out = np.zeros((4, 1000), np.uint8)
    ranges = [(SIZE - 1000, 1000), (1, 1000), (ALIGN, 1000), (3 * ALIGN - 7, 1000)]
    reader.read_into(ranges, out, out_offsets=[3000, 0, 2000, 1000])
    for row, (o, n) in zip([3, 0, 2, 1], ranges, strict=True):
        assert np.array_equal(out[row], data[o : o + n])
    whole = reader.read(0, SIZE)
    assert whole.ctypes.data % ALIGN == 0 and np.array_equal(whole, data)


def test_big_range_is_split_over_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "CHUNK", 2 * ALIGN)
    data = np.random.default_rng(1).integers(0, 256, 40 * ALIGN, dtype=np.uint8)
    data.tofile(tmp_path / "big.bin")
    with DirectReader(tmp_path / "big.bin", threads=4) as r:
        out = aligned_empty(30 * ALIGN)
        r.read_into([(ALIGN, 30 * ALIGN)], out)
        assert np.array_equal(out, data[ALIGN : 31 * ALIGN])
        assert r.reads == 15
        if r.direct:  # aligned range into an aligned buffer: no staging, no padding
            assert r.bytes_read == r.bytes_delivered == 30 * ALIGN


def test_stats_count_padding(data_file):
    with DirectReader(data_file[0], threads=1) as r:
        if not r.direct:
            pytest.skip("O_DIRECT not available")
        r.read_into([(10, 100)], np.empty(100, np.uint8))
        assert r.bytes_delivered == 100 and r.bytes_read == ALIGN and r.reads == 1
        assert r.read_seconds > 0
        r.reset_stats()
        assert r.stats() == {"bytes_read": 0, "bytes_delivered": 0, "read_seconds": 0.0, "reads": 0}


def test_fallback_when_filesystem_refuses(data_file, monkeypatch):
    path, data = data_file
    monkeypatch.setattr(DirectReader, "_open_direct", lambda self: None)
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os,
        "posix_fadvise",
        lambda fd, o, n, adv: (advised.append((o, n, adv)), real(fd, o, n, adv)),
    )
    with DirectReader(path) as r:
        assert not r.direct
        out = np.empty(500, np.uint8)
        r.read_into([(ALIGN + 5, 500)], out)
        assert np.array_equal(out, data[ALIGN + 5 : ALIGN + 505])
    assert advised == [(ALIGN, 505, os.POSIX_FADV_DONTNEED)]
    with pytest.raises(InvalidArgumentError, match="O_DIRECT"):
        DirectReader(path, direct=True)


@pytest.mark.parametrize("direct", [None, False])
def test_errors(data_file, direct):
    reader = DirectReader(data_file[0], direct=direct)
    with pytest.raises(ModelFormatError, match="past the end"):
        reader.read_into([(SIZE - 10, 11)], np.empty(11, np.uint8))
    with pytest.raises(InvalidArgumentError, match="overflows"):
        reader.read_into([(0, 11)], np.empty(10, np.uint8))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        reader.read_into([(0, 10)], np.empty((10, 2), np.uint8)[:, 0])
    with pytest.raises(InvalidArgumentError, match="output offsets"):
        reader.read_into([(0, 10)], np.empty(10, np.uint8), out_offsets=[0, 1])
    reader.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        reader.read(0, 1)
    with pytest.raises(InvalidArgumentError, match="threads"):
        DirectReader(reader.path, threads=0)


@given(st.integers(0, 10_000), st.sampled_from([64, 512, 4096]))
def test_aligned_empty(n, align):
    a = aligned_empty(n, align)
    assert a.size == n and a.dtype == np.uint8
    assert n == 0 or a.ctypes.data % align == 0  # numpy gives empty views any address


@given(st.lists(st.integers(0, 300), max_size=60), st.integers(0, 12))
def test_coalesce_properties(ids, max_gap):
    ids = np.sort(np.array(ids, dtype=np.int64))
    runs = coalesce(ids, max_gap)
    if ids.size == 0:
        assert runs == []
        return
    wanted = set(ids.tolist())
    covered = set()
    for k, (a, b) in enumerate(runs):
        assert a < b and a in wanted and b - 1 in wanted  # runs start and end on ids
        if k:
            assert a - runs[k - 1][1] > max_gap  # runs that stay apart are far apart
        inside = sorted(i for i in wanted if a <= i < b)
        assert all(j - i - 1 <= max_gap for i, j in zip(inside, inside[1:]))
        covered |= set(range(a, b))
    assert wanted <= covered
    assert len(runs) == 1 + int(np.sum(np.diff(ids) > max_gap + 1))


def test_coalesce_examples_and_errors():
    assert coalesce(np.array([1, 2, 3, 7, 8, 20]), 3) == [(1, 9), (20, 21)]
    assert coalesce(np.array([1, 2, 3, 7, 8, 20]), 0) == [(1, 4), (7, 9), (20, 21)]
    assert coalesce(np.array([5, 5, 6]), 0) == [(5, 7)]
    with pytest.raises(InvalidArgumentError, match="sorted"):
        coalesce(np.array([3, 1]), 0)
    with pytest.raises(InvalidArgumentError, match="max_gap"):
        coalesce(np.array([1]), -1)
