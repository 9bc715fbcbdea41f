import hashlib
import json
import os
import struct

import numpy as np
import pytest

from edgerun import registry
from edgerun.errors import EdgerunError, InvalidArgumentError, ModelFormatError
from edgerun.formats.gguf import read_gguf
from edgerun.offload import bundle as bundle_mod
from edgerun.offload.bundle import (
    ALIGN,
    HEADER,
    Bundle,
    StaleBundleError,
    bundle_path,
    ensure_bundle,
    write_bundle,
)
from edgerun.quant.formats import QuantType
from edgerun.quant.reference import dequantize

LAYERS = [0, 3]  # two layers keep the write under a second
D_FF = 1536


@pytest.fixture(scope="module")
def sha():
    return registry.find("smollm2-135m").sha256


@pytest.fixture(scope="module")
def order():
    return {3: np.random.default_rng(3).permutation(D_FF)}


@pytest.fixture(scope="module")
def written(smollm2_path, sha, order, tmp_path_factory):
    cache = tmp_path_factory.mktemp("bundles")
    path = ensure_bundle(smollm2_path, sha, cache, order=order, layers=LAYERS, progress=False)
    return path, cache


@pytest.fixture(scope="module")
def gguf(smollm2_path):
    return read_gguf(smollm2_path)


def _src(gguf, role, i):
    return gguf.tensor(f"blk.{i}.ffn_{role}.weight")


IDS = np.array([5, 4, 1535, 0, 700, 701, 702, 5, 1200, 64, 63])  # unsorted, a duplicate


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "fallback"])
@pytest.mark.parametrize("layer", LAYERS)
def test_rows_read_back_byte_for_byte(written, gguf, layer, direct):
    with Bundle(written[0], threads=3, direct=direct) as b:
        gate, up = _src(gguf, "gate", layer), _src(gguf, "up", layer)
        assert gate.qtype == up.qtype == QuantType.Q4_1
        assert np.array_equal(b.gate_rows(layer), gate.data)
        assert np.array_equal(b.read_gate_rows(layer, IDS), gate.data[IDS])
        rec = b.read_records(layer, IDS)
        ups, downs = b.split(layer, rec)
        assert np.array_equal(ups, up.data[IDS])
        every = np.random.default_rng(layer).permutation(D_FF)
        rec_all = b.read_records(
            layer, every, out=np.empty((D_FF, b.layer(layer).record_bytes), np.uint8)
        )
        assert np.array_equal(b.split(layer, rec_all)[0], up.data[every])
        assert b.read_records(layer, np.array([], np.int64)).shape == (0, rec.shape[1])


@pytest.mark.parametrize("layer", LAYERS)
def test_down_columns_within_q8_0_error(written, gguf, layer):
    with Bundle(written[0]) as b:
        ly = b.layer(layer)
        assert ly.down_format == QuantType.Q8_0 and ly.down_row_bytes == 576 // 32 * 34
        down = _src(gguf, "down", layer)
        cols = dequantize(down.qtype, down.data).T[IDS]  # [n, d_model]
        got = dequantize(
            ly.down_format, np.ascontiguousarray(b.split(layer, b.read_records(layer, IDS))[1])
        )
        # Q8_0 rounds to half a step of amax/127 per 32 values; the f16 scale adds 127 ulps
        step = np.abs(cols.reshape(len(IDS), -1, 32)).max(axis=2, keepdims=True) / 127
        err = np.abs(got - cols).reshape(len(IDS), -1, 32)
        assert (err <= step * (0.5 + 127 * 2.0**-11) + 1e-9).all()
        rel = np.linalg.norm(got - cols, axis=1) / np.linalg.norm(cols, axis=1)
        assert rel.max() < 0.01


def test_index_layout_and_order(written, sha, order):
    path = written[0]
    assert path.parent.name == "offload" and sha[:16] in path.name
    with Bundle(path, sha256=sha) as b:
        assert b.layers == LAYERS and b.source_sha256 == sha
        idx = b.index
        assert idx["spec"]["d_ff"] == D_FF and idx["spec"]["n_layers"] == 30
        assert idx["file_size"] == path.stat().st_size and path.stat().st_size % ALIGN == 0
        for i in LAYERS:
            ly = b.layer(i)
            assert ly.gate_offset % ALIGN == 0 and ly.records_offset % ALIGN == 0
            assert ly.record_bytes == ly.up_row_bytes + ly.down_row_bytes == 360 + 612
        assert b.layer(0).order is None
        ly3 = b.layer(3)
        assert np.array_equal(ly3.order, order[3])
        assert np.array_equal(ly3.position[ly3.order], np.arange(D_FF))
        with pytest.raises(InvalidArgumentError, match="layer 1 is not in"):
            b.layer(1)
        with pytest.raises(InvalidArgumentError, match="0..1535"):
            b.read_records(0, np.array([D_FF]))
        with pytest.raises(InvalidArgumentError, match="shape"):
            b.read_records(0, IDS, out=np.empty((2, 2), np.uint8))


def test_ensure_reuses_rewrites_stale_and_cleans_up(smollm2_path, sha, tmp_path, monkeypatch):
    kw = dict(cache_dir=tmp_path, layers=[1], progress=False)
    p1 = ensure_bundle(smollm2_path, sha, **kw)
    stamp = p1.stat().st_mtime_ns
    assert ensure_bundle(smollm2_path, sha, **kw) == p1 and p1.stat().st_mtime_ns == stamp
    # a file at the expected place whose index names another source: rewritten, atomically
    other = "f" * 64
    stale = bundle_path(smollm2_path, other, tmp_path)
    stale.write_bytes(p1.read_bytes())
    with pytest.raises(StaleBundleError, match="source.sha256.*expected f+, found"):
        Bundle(stale, sha256=other)
    p2 = ensure_bundle(smollm2_path, other, **kw)
    assert p2 == stale
    with Bundle(p2, sha256=other) as b:
        assert b.source_sha256 == other
    assert not p1.exists()  # the bundle of the other version of the source is gone
    # another order or another layer set is stale as well
    perm = {1: np.arange(D_FF)[::-1].copy()}
    p3 = ensure_bundle(smollm2_path, other, order=perm, **kw)
    with Bundle(p3) as b:
        assert np.array_equal(b.layer(1).order, perm[1])
    # a write that fails leaves the old file and no temp file
    before = p3.read_bytes()
    monkeypatch.setattr(bundle_mod, "down_columns", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ensure_bundle(smollm2_path, other, **{**kw, "layers": [2]})
    assert p3.read_bytes() == before
    assert sorted(x.name for x in p3.parent.iterdir()) == [p3.name]


def test_source_hash_is_computed_once(smollm2_path, sha, tmp_path, monkeypatch):
    calls = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    assert bundle_mod.source_sha256(smollm2_path, tmp_path) == sha
    assert bundle_mod.source_sha256(smollm2_path, tmp_path) == sha
    assert len(calls) == 1


def _corrupt(src, dst, at, data):
    buf = bytearray(src.read_bytes())
    buf[at : at + len(data)] = data
    dst.write_bytes(bytes(buf))
    return dst


def test_bad_files_say_file_field_expected_found(written, tmp_path):
    good = written[0]
    raw = good.read_bytes()
    _, _, _, ioff, ilen, _ = HEADER.unpack_from(raw)
    cases = {
        "magic": _corrupt(good, tmp_path / "magic.bundle", 0, b"GGUFxxxx"),
        "version": _corrupt(good, tmp_path / "version.bundle", 8, struct.pack("<I", 99)),
        "index sha256": _corrupt(good, tmp_path / "index.bundle", ioff + 5, b"#"),
        "file size": tmp_path / "short.bundle",
        "file_size": tmp_path / "padded.bundle",
    }
    cases["file size"].write_bytes(raw[:100])
    cases["file_size"].write_bytes(raw + bytes(ALIGN))
    for field, path in cases.items():
        with pytest.raises(ModelFormatError) as e:
            Bundle(path)
        msg = str(e.value)
        assert str(path) in msg and f"field '{field}'" in msg and "expected" in msg, msg
        assert "found" in msg and "delete" in msg
    # a consistent index that lies about the layout (rewritten with a valid hash)
    index = json.loads(raw[ioff : ioff + ilen])
    index["layers"][0]["records"]["record_bytes"] += 1
    blob = json.dumps(index, separators=(",", ":")).encode()
    assert len(blob) == ilen
    head = HEADER.pack(*HEADER.unpack_from(raw)[:5], hashlib.sha256(blob).digest())
    bad = tmp_path / "layout.bundle"
    bad.write_bytes(head + raw[len(head) : ioff] + blob + raw[ioff + ilen :])
    with pytest.raises(ModelFormatError, match=r"layers\[0\]\.records\.record_bytes.*972.*973"):
        Bundle(bad)
    assert issubclass(StaleBundleError, EdgerunError)


def test_write_argument_errors(smollm2_path, sha, tmp_path):
    out = tmp_path / "x.bundle"
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        write_bundle(smollm2_path, out, sha, layers=[0], down_format="Q4_K", progress=False)
    with pytest.raises(InvalidArgumentError, match="permutation"):
        write_bundle(smollm2_path, out, sha, {0: np.zeros(D_FF, int)}, [0], progress=False)
    with pytest.raises(InvalidArgumentError, match="layers must lie"):
        write_bundle(smollm2_path, out, sha, layers=[30], progress=False)
    assert not out.exists() and os.listdir(tmp_path) == []
