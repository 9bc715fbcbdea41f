"""Dense streaming of FFN rows in the file's format (offload/rowstream.py)."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.offload.io import DirectReader
from edgerun.offload.rowstream import (
    ROW_MULTIPLE,
    RowStream,
    SplitMatrix,
    StreamStats,
    read_rows,
    split_rows,
)
from edgerun.ops import qmatvec
from edgerun.quant.quantize import quantize_tensor


@pytest.fixture
def data_file(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "data.bin"
    data.tofile(path)
    return path, data


def test_pieces_come_back_in_their_cycle_at_unaligned_offsets(data_file):
    path, data = data_file
    ranges = [(7, 100_003), (200_000, 65_536), (1_000_001, 999_999), (3 * 2**20 - 5, 5)]
    with DirectReader(path, threads=2) as reader:
        stream = RowStream(reader, slots=2)
        for off, n in ranges:
            stream.add(off, n)
        for _ in range(3):  # three tokens: the reader wraps around the cycle
            for k, (off, n) in enumerate(ranges):
                got = stream.take(k)
                assert np.array_equal(got, data[off : off + n])
                stream.release()
        with pytest.raises(InvalidArgumentError, match="fixed"):
            stream.add(0, 10)
        stream.close()


def test_an_out_of_order_take_restarts_the_read_ahead(data_file):
    path, data = data_file
    ranges = [(i * 300_001, 250_000) for i in range(8)]
    with DirectReader(path, threads=2) as reader:
        stream = RowStream(reader, slots=3)
        for off, n in ranges:
            stream.add(off, n)
        for k in (0, 1, 5, 6, 2, 7, 0, 3):  # a forward cut short, a layer skipped
            off, n = ranges[k]
            assert np.array_equal(stream.take(k), data[off : off + n])
            with pytest.raises(InvalidArgumentError, match="release"):
                stream.take(k)
            stream.release()
        threads = stream._threads
        assert len(threads) == 2  # slots - 1
        stream.close()
        assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_several_readers_hand_over_every_piece_in_order(data_file, readers):
    """Reads finish out of order with several readers; takes still get each piece's own
    bytes, a cycle shorter than the read-ahead never reads a piece twice at once, and
    out-of-order takes restart cleanly."""
    path, data = data_file
    ranges = [(i * 37_001 + 3, 20_000 + 1_000 * i) for i in range(40)]
    with DirectReader(path, threads=2) as reader:
        stream = RowStream(reader, slots=4, readers=readers)
        for off, n in ranges:
            stream.add(off, n)
        order = list(range(40)) * 3 + [5, 6, 39, 0, 1, 17, 18]
        for k in order:
            off, n = ranges[k]
            assert np.array_equal(stream.take(k), data[off : off + n])
            stream.release()
        assert len(stream._threads) == readers
        stream.close()
        assert not stream._inflight and not stream._ready
        short = RowStream(reader, slots=4, readers=readers)  # one piece, three readers
        short.add(*ranges[3])
        for _ in range(20):
            assert np.array_equal(short.take(0), data[ranges[3][0] : sum(ranges[3])])
            assert len(short._ready) + len(short._inflight) <= 1
            short.release()
        short.close()
    with pytest.raises(InvalidArgumentError, match="readers"):
        RowStream(reader, slots=2, readers=2)


def test_close_stops_the_reader_and_a_later_take_restarts_it(data_file):
    """Model.close() closes the stream of an idle model: no thread, no ring, and the
    model still works when used again."""
    path, data = data_file
    ranges = [(0, 70_000), (500_000, 123_457)]
    with DirectReader(path, threads=1) as reader:
        stream = RowStream(reader, slots=2)
        for off, n in ranges:
            stream.add(off, n)
        stream.take(0)
        with pytest.raises(InvalidArgumentError, match="release"):
            stream.close()  # a piece still in use keeps its buffer
        stream.release()
        (first,) = stream._threads
        stream.close()
        assert not first.is_alive() and not stream._threads and not stream._bufs
        for k in (1, 0, 1):
            off, n = ranges[k]
            assert np.array_equal(stream.take(k), data[off : off + n])
            stream.release()
        (second,) = stream._threads
        assert second.is_alive() and second is not first
        stream.close()
        assert not second.is_alive() and second not in threading.enumerate()


def test_split_rows_hold_a_multiple_of_the_tile_and_cover_the_rest():
    t = quantize_tensor("w", np.ones((1000, 256), np.float32), "Q4_K")
    held, pieces = split_rows(t, 200, piece_bytes=64 * 144 * 2)
    assert held == 192 and held % ROW_MULTIPLE == 0  # never more than asked
    assert pieces[0][0] == held and pieces[-1][1] == 1000
    assert all(b == c for (_, b), (c, _) in zip(pieces, pieces[1:]))
    assert all((r1 - r0) % ROW_MULTIPLE == 0 for r0, r1 in pieces[:-1])
    assert split_rows(t, 5000)[0] == 1000 and split_rows(t, 1000)[1] == []


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_split_matrix_computes_exactly_what_the_whole_one_does(tmp_path, qtype):
    rng = np.random.default_rng(1)
    rows, cols = 700, 512
    t = quantize_tensor("w", rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    offset = 12_345  # tensors in a GGUF sit at any 32-byte-or-less alignment
    path = tmp_path / "m.bin"
    with open(path, "wb") as f:
        f.write(b"\x00" * offset + t.data.tobytes() + b"\x00" * 100)
    rb = t.data.shape[1]
    with DirectReader(path, threads=2) as reader:
        stream = RowStream(reader)
        held, pieces = split_rows(t, 130, piece_bytes=3 * ROW_MULTIPLE * rb)
        spec = [(stream.add(offset + r0 * rb, (r1 - r0) * rb), r0, r1) for r0, r1 in pieces]
        m = SplitMatrix("w", t, read_rows(reader, offset, t, held), spec)
        stats = StreamStats()
        for n in (1, 5):  # decode (matvec) and prefill (matmul)
            x = rng.standard_normal((n, cols)).astype(np.float32)
            for _ in range(2):
                assert np.array_equal(m.project(stream, x, stats), qmatvec.project(t, x))
        assert reader.bytes_read >= 4 * (rows - held) * rb
        # hold more of its rows once streaming ran (DenseStreamStore.hold_more): the
        # stream is rebuilt over the rows left, and the results stay the whole matrix's
        stream.close()
        stream.clear()
        n, ranges = m.hold(reader, offset, 300)
        assert m.held_rows == 256 and n == (256 - held) * rb and ranges[0][0] == 256
        m.pieces = [(stream.add(offset + r0 * rb, (r1 - r0) * rb), r0, r1) for r0, r1 in ranges]
        x = rng.standard_normal((3, cols)).astype(np.float32)
        assert np.array_equal(m.project(stream, x, stats), qmatvec.project(t, x))
        n, ranges = m.hold(reader, offset, rows)  # all of it: nothing left to stream
        assert m.held_rows == rows and ranges == [] and n == (rows - 256) * rb
        m.pieces = []
        assert np.array_equal(m.project(stream, x, stats), qmatvec.project(t, x))
        stream.close()


def _cached_bytes(path) -> int:
    """Bytes of `path` in the page cache (mincore over a fresh read-only mapping)."""
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
    if rc != 0:
        pytest.skip("mincore is not available")
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_an_untied_head_streams_with_the_ffn_and_computes_the_same_logits(tmp_path):
    """Dense streaming with nothing held: every FFN row and every row of an untied output
    head come from the stream (the head's pieces after the last layer's), and the logits,
    one sequence or batched, are the resident model's bit for bit; hold_more() then moves
    them all into RAM with the same numbers."""
    from hostile import FF, untied_streamed

    u = untied_streamed(tmp_path, hold_later=True)
    p, fp, store, streamed, logits = u.plan, u.footprint, u.store, u.streamed, u.logits
    assert p.head_streamed and p.read_bytes_per_token > fp.head_bytes
    assert streamed.head is not None and u.resident.head is None
    assert [m.template.name for m, _ in store._splits][-1] == "output.weight"
    want = logits(u.resident)
    store.reset_offload_stats()
    got = logits(streamed)
    assert store.direct.bytes_read >= fp.head_bytes  # the head was read, not held
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    assert store.hold_more(1 << 30) > 0 and store.held_neurons == FF
    assert all(m.held_rows == m.rows and not m.pieces for m, _ in store._splits)
    for g, w in zip(logits(streamed), want):
        assert np.array_equal(g, w)
    store.close()


def test_own_page_cache_is_dropped(tmp_path):
    from edgerun.offload.io import drop_own_page_cache

    path = tmp_path / "kernels" / "k.bin"
    path.parent.mkdir()
    path.write_bytes(np.ones(8 << 20, np.uint8).tobytes())
    os.fsync(os.open(path, os.O_RDONLY))  # clean pages: only those can be dropped
    path.read_bytes()
    if _cached_bytes(path) < 4 << 20:
        pytest.skip("this filesystem does not keep the file in the page cache")
    assert drop_own_page_cache([tmp_path]) >= 1
    assert _cached_bytes(path) < 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise, mincore")
def test_imported_module_files_are_dropped_too(tmp_path, monkeypatch):
    """Python reads module files (it does not map them): their page cache is dropped by
    module, not by /proc/self/maps."""
    from edgerun.offload.io import drop_own_page_cache

    src = tmp_path / "edgerun_probe_module.py"
    src.write_text("X = 1\n# " + "x" * (4 << 20) + "\n")
    os.fsync(os.open(src, os.O_RDONLY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    import edgerun_probe_module  # noqa: F401

    try:
        src.read_bytes()
        if _cached_bytes(src) < 2 << 20:
            pytest.skip("this filesystem does not keep the file in the page cache")
        drop_own_page_cache()
        assert _cached_bytes(src) < 1 << 20
    finally:
        sys.modules.pop("edgerun_probe_module", None)


_HEAP_PROBE = """
import sys
import numpy as np
import psutil

if sys.argv[1] == "on":
    from edgerun.offload.io import return_large_frees_to_os

    assert return_large_frees_to_os()
rss = lambda: psutil.Process().memory_info().rss
a = np.ones(16 << 20, np.uint8)  # freed: glibc raises its mmap threshold past 16 MiB
del a
before = rss()
b = np.ones(8 << 20, np.uint8)  # so this comes from the heap, unless the threshold is fixed
del b
print(rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_large_frees_go_back_to_the_os():
    """Without return_large_frees_to_os a freed 8 MiB temporary stays in the heap (glibc's
    dynamic mmap threshold); with it the memory goes back."""
    import subprocess

    def held(mode: str) -> int:
        r = subprocess.run(
            [sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout.strip())

    if held("off") < 4 << 20:
        pytest.skip("this C library returns freed blocks anyway (not glibc's dynamic threshold)")
    assert held("on") < 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, /proc/self/smaps")
def test_large_libraries_fault_in_without_readahead():
    """random_access_large_libraries marks the big libraries' mappings MADV_RANDOM (the
    kernel shows it as VmFlags "rr"); smaller ones keep their readahead."""
    import llvmlite.binding  # noqa: F401  (libllvmlite.so, ~180 MB, is mapped)

    from edgerun.offload.io import random_access_large_libraries

    assert random_access_large_libraries() >= 1
    flags: dict[str, set[str]] = {}
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 6 and ":" not in head[0]:
                current = head[5] if head[5].startswith("/") else None
            elif head[0] == "VmFlags:" and current is not None:
                flags.setdefault(current, set()).update(head[1:])
    big = [p for p in flags if "libllvmlite" in p]
    assert big and all("rr" in flags[p] for p in big)
    assert any("rr" not in v for p, v in flags.items() if ".so" in p and "llvmlite" not in p)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore")
def test_a_budgeted_model_leaves_its_file_out_of_the_page_cache(smollm2_path, tmp_path):
    """Dense streaming reads with direct I/O, and the resident tensors are read the same
    way; nothing faults the mapping (whose readahead would pull in megabytes around
    each fault). Checked in a fresh process on the file's page-cache residency."""
    import shutil

    # a copy no other process maps (this one maps the original): its cache is ours alone
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, copy)
    with open(copy, "rb") as f:
        os.fsync(f.fileno())
    smollm2_path = copy
    code = f"""
import os, edgerun
from edgerun.api import minimum_ram_budget
fd = os.open({str(smollm2_path)!r}, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
need = minimum_ram_budget({str(smollm2_path)!r}, n_ctx=256)
m = edgerun.load({str(smollm2_path)!r}, n_ctx=256, threads=2, ram_budget=int(need * 1.1))
print(type(m.store).__name__, "".join(m.generate("Paris is", max_tokens=8, temperature=0)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("DenseStreamStore")
    size = os.path.getsize(smollm2_path)
    # the header (metadata, vocabulary) and the embedding rows used; not the weights
    assert _cached_bytes(smollm2_path) < min(24 << 20, size // 3)


def test_batched_decode_streams_the_rows_once_for_all_sequences(tmp_path):
    """Transformer.forward_batch over a dense-streamed model: each sequence's row equals
    its one-token forward (the resident model's), and a step of 3 sequences takes each
    streamed piece once, not once per sequence (pieces taken, not bytes read: the reader
    runs ahead into the next token's pieces at its own pace)."""
    from hostile import untied_streamed

    from edgerun.model.kvcache import KVCache

    u = untied_streamed(tmp_path)
    store, streamed, resident = u.store, u.streamed, u.resident
    prompts = [[1, 2, 3], [4, 5], [6, 7, 0, 1]]
    nxt = [2, 5, 3]

    def caches(model):
        cs = [KVCache(u.spec, 16, "f32") for _ in prompts]
        for c, ids in zip(cs, prompts):
            model.forward(ids, c)
        return cs

    want = [resident.forward([t], c) for t, c in zip(nxt, caches(resident))]
    batch, one = caches(streamed), caches(streamed)[0]
    stream = store.row_stream
    taken: list[int] = []
    take = stream.take

    def counting_take(k: int):
        taken.append(k)
        return take(k)

    stream.take = counting_take
    rows = streamed.forward_batch(nxt, batch)
    batched = sorted(taken)
    taken.clear()
    streamed.forward([nxt[0]], one)
    stream.take = take
    for g, w in zip(rows, want):
        assert np.array_equal(g, w)
    assert batched and batched == sorted(taken)  # every piece once, as one token takes them
    store.close()
