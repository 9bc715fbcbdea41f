"""The edgerun pack: writer/reader round trip, zero-copy views, safetensors compatibility,
clear errors for corrupt packs, and `convert --quant keep` on a real GGUF."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors import safe_open

from edgerun.arch.spec import ModelSpec
from edgerun.errors import EdgerunError, ModelFormatError, UnsupportedError
from edgerun.formats.pack import (
    META_FILE,
    PackError,
    PackFile,
    PackVersionError,
    PackWriter,
    read_pack,
    spec_from_json,
    spec_to_json,
)
from edgerun.quant.formats import QuantType
from edgerun.quant.quantize import quantize

SPEC = ModelSpec(
    arch="llama",
    name="tiny",
    n_layers=1,
    d_model=64,
    d_ff=128,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=32,
    context_length=128,
    norm_eps=1e-5,
    rope_base=10000.0,
    rope_dim=16,
    layer_windows=(0,),
)
TOK = {
    "kind": "gguf",
    "metadata": {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [1, 1, 1],
    },
}


def _tensors(rng):
    return {
        "blk.0.attn_norm.weight": (QuantType.F32, rng.standard_normal((1, 64))),
        "blk.0.attn_q.weight": (QuantType.Q8_0, rng.standard_normal((64, 64))),
        "blk.0.ffn_down.weight": (QuantType.Q4_K, rng.standard_normal((64, 256))),
        "blk.0.ffn_up.weight": (QuantType.F16, rng.standard_normal((128, 64))),
        "blk.0.attn_k.weight": (QuantType.Q4_1, rng.standard_normal((32, 64))),
    }


def _write(path, shard_bytes=1 << 30):
    rng = np.random.default_rng(0)
    ts = _tensors(rng)
    raws = {n: quantize(x.astype(np.float32), q) for n, (q, x) in ts.items()}
    w = PackWriter(path, [(n, q, x.shape) for n, (q, x) in ts.items()], shard_bytes=shard_bytes)
    for n in reversed(list(ts)):  # any order
        w.write(n, raws[n])
    w.close({"spec": spec_to_json(SPEC), "tokenizer": TOK, "source": {"path": "test"}})
    return ts, raws


def test_round_trip_zero_copy_and_safetensors_compat(tmp_path):
    ts, raws = _write(tmp_path / "p")
    pack = read_pack(tmp_path / "p")
    assert pack.spec == SPEC
    assert sorted(pack.tensor_names()) == sorted(ts)
    st = tmp_path / "p" / "model.safetensors"
    with safe_open(str(st), framework="numpy") as f:
        keys = set(f.keys())
        assert set(ts) <= keys and all(k.startswith("__pad__") for k in keys - set(ts))
        for name, (q, x) in ts.items():
            t = pack.tensor(name)
            assert t.qtype == q and t.shape == x.shape
            np.testing.assert_array_equal(t.data, raws[name].reshape(t.data.shape))
            # safetensors reads the same bytes (floats as their own dtype)
            ref = f.get_tensor(name)
            np.testing.assert_array_equal(t.data.reshape(-1), ref.view(np.uint8).reshape(-1))
            # zero copy: a read-only view over the file's mmap, 64-byte aligned
            assert not t.data.flags.owndata and not t.data.flags.writeable
            assert t.data.ctypes.data % 64 == 0 or t.data.__array_interface__["data"][0] % 64 == 0
        # safetensors' own reader copies (why the pack reader maps the file itself)
        assert f.get_tensor("blk.0.attn_q.weight").flags.writeable
    assert pack.tensor("blk.0.attn_norm.weight").data.view(np.float32).shape == (1, 64)


def test_sharded(tmp_path):
    ts, raws = _write(tmp_path / "p", shard_bytes=8000)
    files = sorted(p.name for p in (tmp_path / "p").glob("*.safetensors"))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    pack = read_pack(tmp_path / "p")
    for name in ts:
        np.testing.assert_array_equal(pack.tensor(name).data.reshape(-1), raws[name].reshape(-1))


def _edit_meta(path, fn):
    p = path / META_FILE
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def test_errors_name_file_and_field(tmp_path):
    _write(tmp_path / "good")

    def variant(name, fn):
        d = tmp_path / name
        shutil.copytree(tmp_path / "good", d)
        fn(d)
        return d

    d = variant("ver", lambda d: _edit_meta(d, lambda m: m.update(version=99)))
    with pytest.raises(PackVersionError, match="'version' is 99") as e:
        read_pack(d)
    assert isinstance(e.value, UnsupportedError) and META_FILE in str(e.value)

    d = variant("fmt", lambda d: _edit_meta(d, lambda m: m.update(format="other")))
    with pytest.raises(PackError, match="'format'"):
        read_pack(d)

    d = variant("json", lambda d: (d / META_FILE).write_text("{not json"))
    with pytest.raises(PackError, match="corrupt metadata") as e:
        read_pack(d)
    assert str(d / META_FILE) in str(e.value)

    d = variant("spec", lambda d: _edit_meta(d, lambda m: m["spec"].pop("d_model")))
    with pytest.raises(PackError, match="'spec.d_model' is missing"):
        read_pack(d)

    d = variant("specval", lambda d: _edit_meta(d, lambda m: m["spec"].update(n_layers="x")))
    with pytest.raises(PackError, match="'spec.n_layers'"):
        read_pack(d)

    def add_tensor(m):
        m["tensors"]["blk.0.extra.weight"] = {
            "qtype": "Q8_0",
            "shape": [4, 32],
            "file": "model.safetensors",
        }

    d = variant("missing", lambda d: _edit_meta(d, add_tensor))
    with pytest.raises(PackError, match="'blk.0.extra.weight'.*missing") as e:
        read_pack(d)
    assert "model.safetensors" in str(e.value)

    d = variant(
        "qtype",
        lambda d: _edit_meta(d, lambda m: m["tensors"]["blk.0.attn_q.weight"].update(qtype="Q9_X")),
    )
    with pytest.raises(PackError, match="tensors.blk.0.attn_q.weight.qtype"):
        read_pack(d)

    d = variant(
        "shape",
        lambda d: _edit_meta(
            d, lambda m: m["tensors"]["blk.0.attn_q.weight"].update(shape=[64, 32])
        ),
    )
    with pytest.raises(PackError, match="blk.0.attn_q.weight"):
        read_pack(d).tensor("blk.0.attn_q.weight")

    def truncate(d):
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-100])

    d = variant("trunc", truncate)
    with pytest.raises(PackError, match="truncated"):  # checked at open
        read_pack(d)

    d = variant("nofile", lambda d: (d / "model.safetensors").unlink())
    with pytest.raises(PackError, match="missing"):
        read_pack(d)

    d = variant("tok", lambda d: _edit_meta(d, lambda m: m.update(tokenizer={"kind": "x"})))
    with pytest.raises(PackError, match="'tokenizer.kind'"):
        read_pack(d).tokenizer()

    with pytest.raises(PackError, match="not an edgerun pack"):
        PackFile(tmp_path)
    with pytest.raises(ModelFormatError, match="missing from the pack"):
        read_pack(tmp_path / "good").tensor("nope")
    assert issubclass(PackError, EdgerunError)


def test_spec_json_round_trip():
    assert spec_from_json(spec_to_json(SPEC), "x") == SPEC
    with pytest.raises(PackError, match="spec.bogus"):
        spec_from_json({**spec_to_json(SPEC), "bogus": 1}, "x")


def test_convert_keep_matches_gguf(tmp_path, smollm2_path):
    """--quant keep copies blocks unchanged: the same logits and greedy tokens as the GGUF."""
    import edgerun
    from edgerun.formats.gguf import read_gguf
    from edgerun.tools.convert import convert

    out = convert(str(smollm2_path), tmp_path / "keep", "keep", progress=False)
    pack = read_pack(out)
    g = read_gguf(smollm2_path)
    assert sorted(pack.tensor_names()) == sorted(g.tensor_names())
    for n in g.tensor_names():
        a, b = g.tensor(n), pack.tensor(n)
        assert a.qtype == b.qtype and a.shape == b.shape
        assert np.array_equal(a.data, b.data)
    meta = pack.metadata
    assert meta["quantization"]["recipe"] == "keep"
    assert len(meta["source"]["sha256"]) == 64
    src = edgerun.load(smollm2_path, n_ctx=64, threads=2)
    dst = edgerun.load(out, n_ctx=64, threads=2)
    prompt = "The capital of France is"
    assert dst.tokenize(prompt) == src.tokenize(prompt)
    assert dst.chat_template == src.chat_template
    a = list(src.generate(prompt, max_tokens=8, temperature=0, repeat_penalty=1.0))
    b = list(dst.generate(prompt, max_tokens=8, temperature=0, repeat_penalty=1.0))
    assert a == b
