import numpy as np
import pytest

from edgerun.errors import EdgerunError, ModelFormatError, ModelNotFoundError
from edgerun.formats.gguf import StringArray, read_gguf


def test_matches_gguf_package(smollm2_path):
    import gguf

    ours = read_gguf(smollm2_path)
    ref = gguf.GGUFReader(smollm2_path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        if isinstance(value, np.ndarray | StringArray):  # arrays stay in the mapped file
            value = value.tolist()
        assert value == pytest.approx(field.contents()) or value == field.contents(), key
    assert len(ours.infos) == len(ref.tensors)
    for t in ref.tensors[:40]:
        q = ours.tensor(t.name)
        assert q.qtype == int(t.tensor_type)
        assert np.array_equal(q.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_metadata_arrays_stay_in_the_file(smollm2_path):
    meta = read_gguf(smollm2_path).metadata
    types = meta["tokenizer.ggml.token_type"]
    assert isinstance(types, np.ndarray) and types.dtype == np.int32
    assert not types.flags.owndata and not types.flags.writeable
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == len(types) == 49152
    as_list = list(tokens)
    assert tokens == as_list and as_list == tokens and tokens.tolist() == as_list
    assert tokens[0] == as_list[0] and tokens[-1] == as_list[-1] and tokens[-3:] == as_list[-3:]
    assert [tokens[i] for i in range(100, 120)] == as_list[100:120]
    assert tokens != as_list[:-1]
    with pytest.raises(IndexError):
        tokens[len(tokens)]
    merges = meta["tokenizer.ggml.merges"]
    assert isinstance(merges, StringArray) and all(" " in m for m in merges)


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
    # the header's tensor table is checked against the file size at open
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf(p)


def test_load_errors_are_edgerun_errors(tmp_path):
    import edgerun

    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(EdgerunError):
        edgerun.load(p)
