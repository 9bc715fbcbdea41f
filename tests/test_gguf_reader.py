import numpy as np
import pytest

from edgerun.errors import EdgerunError, ModelFormatError, ModelNotFoundError
from edgerun.formats.gguf import read_gguf


def test_matches_gguf_package(smollm2_path):
    import gguf

    ours = read_gguf(smollm2_path)
    ref = gguf.GGUFReader(smollm2_path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == pytest.approx(field.contents()) or (
            ours.metadata[key] == field.contents()
        ), key
    assert len(ours.infos) == len(ref.tensors)
    for t in ref.tensors[:40]:
        q = ours.tensor(t.name)
        assert q.qtype == int(t.tensor_type)
        assert np.array_equal(q.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_tensor_views_do_not_copy(smollm2_path):
    f = read_gguf(smollm2_path)
    t = f.tensor("token_embd.weight")
    assert not t.data.flags.owndata
    assert t.shape == (49152, 576)


def test_missing_file():
    with pytest.raises(ModelNotFoundError, match="not found"):
        read_gguf("/nonexistent/model.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_gguf(p)


def test_truncated_header(tmp_path, smollm2_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(smollm2_path.read_bytes()[:5000])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf(p)


def test_truncated_data(tmp_path, smollm2_path):
    p = tmp_path / "t.gguf"
    data = smollm2_path.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    f = read_gguf(p)
    with pytest.raises(ModelFormatError, match="truncated"):
        for name in f.tensor_names():
            f.tensor(name)


def test_load_errors_are_edgerun_errors(tmp_path):
    import edgerun

    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(EdgerunError):
        edgerun.load(p)
