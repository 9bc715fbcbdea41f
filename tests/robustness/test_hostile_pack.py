"""Hostile packs (edgerun.json + safetensors), one named kind each: every one is rejected
with an EdgerunError naming the file and the field, in < 1 s and < 100 MB. The safetensors
checks are the library's own: header <= 100 MB, offsets contiguous and inside the file, no
trailing bytes, no duplicate keys."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile import GGUFBuilder, assert_rejected

from edgerun.errors import ModelFormatError
from edgerun.formats.pack import META_FILE, PackVersionError, read_pack

ST = "model.safetensors"


def open_pack(path: Path) -> Any:
    """What loading a pack does up to the forward pass (as edgerun.api.Model does)."""
    from edgerun.model.transformer import Transformer
    from edgerun.model.weights import ResidentStore

    pack = read_pack(path)
    pack.tokenizer()
    return Transformer(pack.spec, ResidentStore(pack, str(path)), str(path))


@pytest.fixture(scope="module")
def good_pack(tmp_path_factory) -> Path:
    from edgerun.tools.convert import convert

    d = tmp_path_factory.mktemp("pack")
    src = GGUFBuilder().write(d / "tiny.gguf")
    out = Path(convert(str(src), d / "good", "keep", progress=False))
    open_pack(out)  # imports and first-use costs are not the rejections' time
    return out


def _split(path: Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return raw[8 : 8 + n], raw[8 + n :]


def st(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    """An edit of the safetensors header (as a dict; returning bytes writes those raw)."""

    def edit(d: Path) -> None:
        head, data = _split(d / ST)
        h = json.loads(head)
        out = fn(h)
        raw = out if isinstance(out, bytes) else json.dumps(h).encode()
        (d / ST).write_bytes(struct.pack("<Q", len(raw)) + raw + data)

    return edit


def meta(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    """An edit of edgerun.json (as a dict; returning str/bytes writes that raw)."""

    def edit(d: Path) -> None:
        m = json.loads((d / META_FILE).read_text())
        out = fn(m)
        raw = out if isinstance(out, str | bytes) else json.dumps(m)
        (d / META_FILE).write_bytes(raw.encode() if isinstance(raw, str) else raw)

    return edit


def raw_st(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / ST).write_bytes(fn((d / ST).read_bytes()))

    return edit


def _spec(**kw) -> Callable[[Path], None]:
    return meta(lambda m: m["spec"].update(kw))


def _tok(**kw) -> Callable[[Path], None]:
    return meta(lambda m: m["tokenizer"]["metadata"].update(kw))


def _tensor(name: str, **kw) -> Callable[[Path], None]:
    return meta(lambda m: m["tensors"][name].update(kw))


def _nan_norm(d: Path) -> None:
    head, data = _split(d / ST)
    b = json.loads(head)["blk.0.attn_norm.weight"]["data_offsets"][0]
    data = bytearray(data)
    data[b + 8 : b + 12] = np.float32(np.inf).tobytes()
    (d / ST).write_bytes(struct.pack("<Q", len(head)) + head + bytes(data))


def _hole(h: dict) -> None:
    ent = h["output_norm.weight"]
    ent["data_offsets"] = [ent["data_offsets"][0] + 4, ent["data_offsets"][1] + 4]


def _overlap(h: dict) -> None:
    b0 = h["output_norm.weight"]["data_offsets"]
    h["blk.0.attn_norm.weight"]["data_offsets"] = list(b0)


def _deep(m: dict) -> str:
    return '{"format": ' + "[" * 100_000 + "]" * 100_000 + "}"


def _huge_meta(d: Path) -> None:
    with open(d / META_FILE, "r+b") as f:
        f.truncate(300 << 20)  # sparse: no disk, no memory


def _dup_meta_key(m: dict) -> str:
    text = json.dumps(m)
    return text[:-1] + ', "version": 1}'


def _dup_st_key(h: dict) -> bytes:
    text = json.dumps(h)
    ent = json.dumps(h["output_norm.weight"])
    return (text[:-1] + f', "output_norm.weight": {ent}}}').encode()


# kind -> (edit, needles, error type); the file named is the one holding the field
CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...], type, str]] = {
    # edgerun.json
    "meta_not_json": (
        meta(lambda m: "{not json"),
        ("corrupt metadata",),
        ModelFormatError,
        META_FILE,
    ),
    "meta_not_utf8": (
        meta(lambda m: b"\xff\xfe{}"),
        ("corrupt metadata",),
        ModelFormatError,
        META_FILE,
    ),
    "meta_duplicate_key": (meta(_dup_meta_key), ("'version' twice",), ModelFormatError, META_FILE),
    "meta_nested_100k_deep": (meta(_deep), ("nested too deeply",), ModelFormatError, META_FILE),
    "meta_300MB": (_huge_meta, ("metadata size", "at most"), ModelFormatError, META_FILE),
    "meta_not_object": (
        meta(lambda m: "[1, 2]"),
        ("not a JSON object",),
        ModelFormatError,
        META_FILE,
    ),
    "version_99": (
        meta(lambda m: m.update(version=99)),
        ("'version' is 99",),
        PackVersionError,
        META_FILE,
    ),
    "spec_wrong_type": (_spec(n_layers="x"), ("spec.n_layers",), ModelFormatError, META_FILE),
    "spec_float_for_int": (_spec(d_model=32.5), ("spec.d_model",), ModelFormatError, META_FILE),
    "spec_n_layers_2^40": (
        _spec(n_layers=1 << 40),
        ("'n_layers'", "1..4096"),
        ModelFormatError,
        META_FILE,
    ),
    "spec_zero_heads": (_spec(n_heads=0), ("'n_heads'",), ModelFormatError, META_FILE),
    "spec_norm_eps_nan": (
        meta(
            lambda m: json.dumps(m).replace('"norm_eps": 9.999999747378752e-06', '"norm_eps": NaN')
        ),
        ("'norm_eps'", "finite"),
        ModelFormatError,
        META_FILE,
    ),
    "spec_windows_infinity": (
        meta(
            lambda m: json.dumps({**m, "spec": {**m["spec"], "layer_windows": [1]}}).replace(
                '"layer_windows": [1]', '"layer_windows": [Infinity]'
            )
        ),
        ("spec.layer_windows",),
        ModelFormatError,
        META_FILE,
    ),
    "spec_windows_wrong_length": (
        _spec(layer_windows=[0, 0, 0]),
        ("'layer_windows'", "1 entries"),
        ModelFormatError,
        META_FILE,
    ),
    "spec_tensor_name_format_attack": (
        meta(lambda m: m["spec"]["layer_tensors"].update(attn_norm="{i.__class__.__mro__}")),
        ("layer_tensors.attn_norm", "{i}"),
        ModelFormatError,
        META_FILE,
    ),
    "spec_tensor_name_padding_bomb": (
        meta(lambda m: m["spec"]["layer_tensors"].update(ffn_up="{i:>999999999}")),
        ("layer_tensors.ffn_up",),
        ModelFormatError,
        META_FILE,
    ),
    "spec_unknown_rope_style": (
        _spec(rope_style="evil"),
        ("'rope_style'",),
        ModelFormatError,
        META_FILE,
    ),
    "spec_unknown_field": (_spec(bogus=1), ("spec.bogus",), ModelFormatError, META_FILE),
    "tensors_missing": (
        meta(lambda m: m.pop("tensors")),
        ("'tensors'",),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_entry_not_object": (
        meta(lambda m: m["tensors"].update({"output_norm.weight": 5})),
        ("tensors.output_norm.weight",),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_shape_bools": (
        _tensor("output_norm.weight", shape=[True, 32]),
        ("tensors.output_norm.weight.shape",),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_shape_negative": (
        _tensor("output_norm.weight", shape=[1, -32]),
        ("tensors.output_norm.weight.shape",),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_shape_2^62": (
        _tensor("output_norm.weight", shape=[1 << 62, 1 << 62]),
        ("tensors.output_norm.weight.shape",),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_file_path_traversal": (
        _tensor("output_norm.weight", file="../../etc/passwd"),
        ("tensors.output_norm.weight.file", "plain file name"),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_unknown_qtype": (
        _tensor("output_norm.weight", qtype="Q9_X"),
        ("tensors.output_norm.weight.qtype",),
        ModelFormatError,
        META_FILE,
    ),
    "tensor_qtype_disagrees_with_file": (
        _tensor("output_norm.weight", qtype="Q8_0"),
        ("output_norm.weight", "says Q8_0"),
        ModelFormatError,
        ST,
    ),
    "tensor_missing_from_file": (
        meta(
            lambda m: m["tensors"].update(
                {"blk.0.extra": {"qtype": "F32", "shape": [1, 32], "file": ST}}
            )
        ),
        ("blk.0.extra", "missing"),
        ModelFormatError,
        ST,
    ),
    "tokenizer_kind_unknown": (
        meta(lambda m: m["tokenizer"].update(kind="pickle")),
        ("tokenizer.kind",),
        ModelFormatError,
        META_FILE,
    ),
    "tokenizer_bos_beyond_vocab": (
        _tok(**{"tokenizer.ggml.bos_token_id": 99}),
        ("tokenizer.ggml.bos_token_id", "outside the vocabulary"),
        ModelFormatError,
        META_FILE,
    ),
    "tokenizer_tokens_not_strings": (
        _tok(**{"tokenizer.ggml.tokens": [1, 2, 3]}),
        ("tokenizer.ggml.tokens", "array of strings"),
        ModelFormatError,
        META_FILE,
    ),
    "tokenizer_token_types_ragged": (
        _tok(**{"tokenizer.ggml.token_type": [[1], 1, 1, 1, 1, 1, 1, 1]}),
        ("tokenizer.ggml.token_type", "array of integers"),
        ModelFormatError,
        META_FILE,
    ),
    "tokenizer_merge_unknown_token": (
        _tok(**{"tokenizer.ggml.merges": ["q r"]}),
        ("tokenizer.ggml.merges", "not in the vocabulary"),
        ModelFormatError,
        META_FILE,
    ),
    "tokenizer_absurd_token": (
        _tok(**{"tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab", "c", "d", "x" * 10_000]}),
        ("tokenizer.ggml.tokens", "at most 4096"),
        ModelFormatError,
        META_FILE,
    ),
    "tokenizer_add_bos_string": (
        _tok(**{"tokenizer.ggml.add_bos_token": "yes"}),
        ("tokenizer.ggml.add_bos_token", "a bool"),
        ModelFormatError,
        META_FILE,
    ),
    # safetensors
    "st_header_length_over_100MB": (
        raw_st(lambda r: struct.pack("<Q", (100 << 20) + 1) + r[8:]),
        ("header length", "at most"),
        ModelFormatError,
        ST,
    ),
    "st_header_length_2^64-1": (
        raw_st(lambda r: struct.pack("<Q", (1 << 64) - 1) + r[8:]),
        ("header length",),
        ModelFormatError,
        ST,
    ),
    "st_header_longer_than_file": (
        raw_st(lambda r: struct.pack("<Q", len(r)) + r[8:]),
        ("header length",),
        ModelFormatError,
        ST,
    ),
    "st_header_not_json": (
        st(lambda h: b"{not json}"),
        ("corrupt safetensors header",),
        ModelFormatError,
        ST,
    ),
    "st_header_not_brace": (st(lambda h: b" []"), ("expected '{'",), ModelFormatError, ST),
    "st_duplicate_key": (st(_dup_st_key), ("'output_norm.weight' twice",), ModelFormatError, ST),
    "st_unknown_dtype": (
        st(lambda h: h["output_norm.weight"].update(dtype="F128")),
        ("'output_norm.weight'", "'dtype'", "F128"),
        ModelFormatError,
        ST,
    ),
    "st_negative_shape": (
        st(lambda h: h["output_norm.weight"].update(shape=[-32])),
        ("'output_norm.weight'", "'shape'"),
        ModelFormatError,
        ST,
    ),
    "st_offsets_reversed": (
        st(lambda h: h["output_norm.weight"].update(data_offsets=[128, 0])),
        ("'output_norm.weight'", "'data_offsets'"),
        ModelFormatError,
        ST,
    ),
    "st_offsets_not_dtype_x_shape": (
        st(lambda h: h["output_norm.weight"].update(shape=[33])),
        ("'output_norm.weight'", "expected 132"),
        ModelFormatError,
        ST,
    ),
    "st_offsets_hole": (st(_hole), ("expected 0", "contiguous"), ModelFormatError, ST),
    "st_offsets_overlap": (st(_overlap), ("contiguous",), ModelFormatError, ST),
    "st_trailing_bytes": (
        raw_st(lambda r: r + b"\0" * 64),
        ("trailing bytes",),
        ModelFormatError,
        ST,
    ),
    "st_truncated": (raw_st(lambda r: r[:-100]), ("truncated",), ModelFormatError, ST),
    "st_offsets_leave_file": (
        st(lambda h: h["token_embd.weight"].update(data_offsets=[0, 1 << 40])),
        ("'token_embd.weight'",),
        ModelFormatError,
        ST,
    ),
    "st_metadata_not_strings": (
        st(lambda h: h["__metadata__"].update(format=5)),
        ("__metadata__",),
        ModelFormatError,
        ST,
    ),
    "st_too_small": (raw_st(lambda r: r[:5]), ("too small",), ModelFormatError, ST),
    # weights
    "inf_in_norm": (_nan_norm, ("blk.0.attn_norm.weight", "finite"), ModelFormatError, ""),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_hostile_pack_is_rejected(kind, good_pack, tmp_path):
    edit, needles, error, fname = CASES[kind]
    d = tmp_path / kind
    shutil.copytree(good_pack, d)
    edit(d)
    where = str(d / fname) if fname else str(d)
    assert_rejected(lambda: open_pack(d), where, *needles, kind=error)


def test_the_good_pack_loads(good_pack):
    t = open_pack(good_pack)
    assert t.spec.d_model == 32


def test_truncated_safetensors_at_many_sizes(good_pack, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(good_pack, d)
    raw = (good_pack / ST).read_bytes()
    for n in [*range(0, 1200, 7), *range(1200, len(raw), 211)]:
        (d / ST).write_bytes(raw[:n])
        assert_rejected(lambda: open_pack(d), str(d / ST), kind=ModelFormatError)


def test_sparse_huge_safetensors_is_rejected_cheaply(good_pack, tmp_path):
    """A header claiming a 2**62-byte tensor in a sparse 1 TB file: refused by arithmetic,
    nothing read or mapped beyond the header."""
    d = tmp_path / "big"
    shutil.copytree(good_pack, d)
    st(lambda h: h["token_embd.weight"].update(shape=[1 << 31, 1 << 31]))(d)
    with open(d / ST, "r+b") as f:
        f.truncate(1 << 40)
    if os.stat(d / ST).st_size != 1 << 40:
        pytest.skip("file system without sparse files")
    assert_rejected(lambda: open_pack(d), str(d / ST), "token_embd.weight", kind=ModelFormatError)
