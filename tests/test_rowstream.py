"""Dense streaming of FFN rows in the file's format (offload/rowstream.py)."""

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
        stream.close()
        assert not [t for t in threading.enumerate() if t.name == "edgerun-rowstream"]


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
        stream.close()
