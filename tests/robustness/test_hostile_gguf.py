"""Hostile GGUF files, one named kind each (after llama.cpp's tests/test-gguf.cpp): each is
rejected with an EdgerunError naming the file and the field, in < 1 s and < 100 MB."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hostile import (
    ARR,
    BOOL,
    F32,
    I32,
    STR,
    T_F32,
    T_Q4_0,
    U8,
    U32,
    U64,
    GGUFBuilder,
    Tensor,
    assert_rejected,
    f32,
    gstr,
    kv,
    open_model,
)

from edgerun.errors import EdgerunError, ModelFormatError, UnsupportedError
from edgerun.formats.gguf import read_gguf

BIG = 1 << 63


def _set(key: str, vtype: int, v) -> Callable[[GGUFBuilder], None]:
    def edit(b: GGUFBuilder) -> None:
        b.kvs[key] = (vtype, v)

    return edit


def _drop(key: str) -> Callable[[GGUFBuilder], None]:
    return lambda b: b.kvs.pop(key)


def _tensor(name: str, **changes) -> Callable[[GGUFBuilder], None]:
    def edit(b: GGUFBuilder) -> None:
        t = next(t for t in b.tensors if t.name == name)
        for k, v in changes.items():
            setattr(t, k, v)

    return edit


def _raw_info(name: str, nd: int, dims: list[int], tid: int = T_F32, off: int = 0):
    info = gstr(name) + struct.pack("<I", nd) + b"".join(struct.pack("<Q", d) for d in dims)
    return info + struct.pack("<IQ", tid, off)


def _with(**attrs) -> Callable[[GGUFBuilder], None]:
    def edit(b: GGUFBuilder) -> None:
        for k, v in attrs.items():
            setattr(b, k, v)

    return edit


def _first_tensor_info(name: str = "output_norm.weight", **kw) -> Callable[[GGUFBuilder], None]:
    def edit(b: GGUFBuilder) -> None:
        b.tensors[0].raw_info = _raw_info(name, **kw)

    return edit


def _duplicate_tensor(b: GGUFBuilder) -> None:
    t = b.tensors[0]
    b.tensors.append(Tensor(t.name, t.dims, t.data))


def _overlap(b: GGUFBuilder) -> None:
    b.tensors[1].offset = 0


def _misaligned(b: GGUFBuilder) -> None:
    b.tensors[1].offset = 128 + 4  # the first tensor is 128 bytes; 132 is not 32-aligned


def _past_end(b: GGUFBuilder) -> None:
    t = b.tensors[-1]
    t.dims = (t.dims[0], t.dims[1] * 1000)  # claims 1000x the data the file holds


def _vector(name: str, values: list[float]):
    return _tensor(name, data=struct.pack(f"<{len(values)}f", *values))


D = 32
NAN = float("nan")
INF = float("inf")

# kind -> (edit of the valid file, needles the message must hold, error type)
CASES: dict[str, tuple[Callable[[GGUFBuilder], None], tuple[str, ...], type]] = {
    # counts
    "tensor_count_2^63": (_with(n_tensors=BIG), ("tensor count", str(BIG)), ModelFormatError),
    "key_count_2^63": (_with(n_kv=BIG), ("metadata count", str(BIG)), ModelFormatError),
    "tensor_count_too_many": (_with(n_tensors=10_000), ("tensor count",), ModelFormatError),
    "key_count_too_many": (_with(n_kv=40), ("metadata",), ModelFormatError),
    # strings and arrays
    "key_length_2^63": (
        lambda b: b.extra_kv.append(struct.pack("<Q", BIG)),
        ("length of metadata key",),
        ModelFormatError,
    ),
    "string_beyond_file": (
        lambda b: b.extra_kv.append(gstr("x.s") + struct.pack("<IQ", STR, 1 << 29)),
        ("metadata 'x.s'", "truncated"),
        ModelFormatError,
    ),
    "string_over_1GiB": (
        lambda b: b.extra_kv.append(gstr("x.s") + struct.pack("<IQ", STR, (1 << 30) + 1)),
        ("metadata 'x.s'", "at most 1073741824 bytes"),
        ModelFormatError,
    ),
    "array_count_beyond_file": (
        lambda b: b.extra_kv.append(gstr("x.a") + struct.pack("<IIQ", ARR, U32, 1 << 61)),
        ("element count of metadata 'x.a'",),
        ModelFormatError,
    ),
    "array_count_2^63_times_8_wraps": (
        lambda b: b.extra_kv.append(gstr("x.a") + struct.pack("<IIQ", ARR, U64, 1 << 61)),
        ("element count of metadata 'x.a'", str(1 << 61)),
        ModelFormatError,
    ),
    "string_array_count_beyond_file": (
        lambda b: b.extra_kv.append(gstr("x.a") + struct.pack("<IIQ", ARR, STR, BIG)),
        ("element count of metadata 'x.a'",),
        ModelFormatError,
    ),
    "string_array_item_beyond_file": (
        lambda b: b.extra_kv.append(
            gstr("x.a") + struct.pack("<IIQ", ARR, STR, 2) + gstr("ok") + struct.pack("<Q", BIG)
        ),
        ("string #1 of metadata 'x.a'",),
        ModelFormatError,
    ),
    "string_arrays_over_2M_strings": (
        lambda b: b.extra_kv.append(gstr("x.a") + struct.pack("<IIQ", ARR, STR, (1 << 21) + 1)),
        ("element count of metadata 'x.a'", "in all metadata arrays"),
        ModelFormatError,
    ),
    "key_of_100KB": (
        lambda b: b.extra_kv.append(kv("k" * 100_000, U8, 1)),
        ("length of metadata key #", "at most 65536 bytes"),
        ModelFormatError,
    ),
    "chat_template_of_3MB": (
        _set("tokenizer.chat_template", STR, "x" * (3 << 20)),
        ("tokenizer.chat_template", "a string"),
        ModelFormatError,
    ),
    "nested_array": (
        lambda b: b.extra_kv.append(gstr("x.a") + struct.pack("<IIQ", ARR, ARR, 1)),
        ("element type of metadata 'x.a'", "nested array"),
        ModelFormatError,
    ),
    # type ids
    "unknown_value_type": (
        lambda b: b.extra_kv.append(gstr("x.v") + struct.pack("<I", 99)),
        ("value type of metadata 'x.v'", "99"),
        ModelFormatError,
    ),
    "unknown_array_element_type": (
        lambda b: b.extra_kv.append(gstr("x.a") + struct.pack("<IIQ", ARR, 77, 1)),
        ("element type of metadata 'x.a'", "77"),
        ModelFormatError,
    ),
    "unknown_tensor_type": (
        _tensor("output_norm.weight", type_id=200),
        ("type of tensor 'output_norm.weight'", "200"),
        ModelFormatError,
    ),
    # dims
    "n_dims_5": (
        _first_tensor_info(nd=5, dims=[32, 1, 1, 1, 1]),
        ("n_dims of tensor 'output_norm.weight'", "1..4", "5"),
        ModelFormatError,
    ),
    "n_dims_0": (
        _first_tensor_info(nd=0, dims=[]),
        ("n_dims of tensor 'output_norm.weight'",),
        ModelFormatError,
    ),
    "n_dims_2^32-1": (
        _first_tensor_info(nd=(1 << 32) - 1, dims=[32]),
        ("n_dims of tensor 'output_norm.weight'",),
        ModelFormatError,
    ),
    "zero_dim": (
        _first_tensor_info(nd=2, dims=[32, 0]),
        ("dimension 1 of tensor 'output_norm.weight'", "positive", "found 0"),
        ModelFormatError,
    ),
    "negative_dim": (
        _first_tensor_info(nd=1, dims=[(1 << 64) - 32]),
        ("dimension 0 of tensor 'output_norm.weight'", "found -32"),
        ModelFormatError,
    ),
    "element_count_wraps_64_bits": (
        _first_tensor_info(nd=3, dims=[1 << 32, 1 << 31, 4]),
        ("dims of tensor 'output_norm.weight'", "64 bits"),
        ModelFormatError,
    ),
    "row_not_a_block_multiple": (
        _first_tensor_info(nd=1, dims=[17], tid=T_Q4_0),
        ("dimension 0 of tensor 'output_norm.weight'", "block size 32"),
        ModelFormatError,
    ),
    # offsets and alignment
    "overlapping_offsets": (
        _overlap,
        ("offset of tensor 'blk.0.attn_norm.weight'", "expected 128", "found 0"),
        ModelFormatError,
    ),
    "misaligned_offset": (
        _misaligned,
        ("offset of tensor 'blk.0.attn_norm.weight'", "found 132"),
        ModelFormatError,
    ),
    "first_offset_not_zero": (
        _tensor("output_norm.weight", offset=32),
        ("offset of tensor 'output_norm.weight'", "expected 0"),
        ModelFormatError,
    ),
    "tensor_leaves_file": (_past_end, ("blk.0.ffn_down.weight", "ends at byte"), ModelFormatError),
    "offset_2^64-1": (
        _tensor("output_norm.weight", offset=(1 << 64) - 1),
        ("offset of tensor 'output_norm.weight'",),
        ModelFormatError,
    ),
    "alignment_0": (
        _set("general.alignment", U32, 0),
        ("general.alignment", "power of two", "found 0"),
        ModelFormatError,
    ),
    "alignment_not_power_of_two": (
        _set("general.alignment", U32, 48),
        ("general.alignment", "power of two", "found 48"),
        ModelFormatError,
    ),
    "alignment_wrong_type": (
        _set("general.alignment", STR, "32"),
        ("general.alignment", "u32"),
        ModelFormatError,
    ),
    # duplicates and empty names
    "duplicate_key": (
        lambda b: b.extra_kv.append(kv("general.name", STR, "again")),
        ("duplicate 'general.name'",),
        ModelFormatError,
    ),
    "duplicate_tensor_name": (
        _duplicate_tensor,
        ("duplicate 'output_norm.weight'",),
        ModelFormatError,
    ),
    "empty_key": (
        lambda b: b.extra_kv.append(kv("", U8, 1)),
        ("metadata key #", "non-empty"),
        ModelFormatError,
    ),
    "empty_tensor_name": (
        _first_tensor_info(name="", nd=1, dims=[32]),
        ("tensor name #0", "non-empty"),
        ModelFormatError,
    ),
    # magic and version
    "bad_magic": (_with(magic=b"GGML"), ("not a GGUF file",), ModelFormatError),
    "version_99": (_with(version=99), ("GGUF version 99",), UnsupportedError),
    # metadata of the wrong type for its key
    "f32_key_as_u8": (
        _set("llama.attention.layer_norm_rms_epsilon", U8, 1),
        ("llama.attention.layer_norm_rms_epsilon", "should be a float", "int 1"),
        ModelFormatError,
    ),
    "int_key_as_f32": (
        _set("llama.block_count", F32, 1.0),
        ("llama.block_count", "should be an integer", "float"),
        ModelFormatError,
    ),
    "int_key_as_string": (
        _set("llama.embedding_length", STR, "32"),
        ("llama.embedding_length", "should be an integer", "str"),
        ModelFormatError,
    ),
    "int_key_as_array": (
        _set("llama.feed_forward_length", ARR, (U32, [64])),
        ("llama.feed_forward_length", "should be an integer", "array"),
        ModelFormatError,
    ),
    "bool_key_as_string": (
        _set("tokenizer.ggml.add_bos_token", STR, "yes"),
        ("tokenizer.ggml.add_bos_token", "a bool"),
        ModelFormatError,
    ),
    "architecture_as_array": (
        _set("general.architecture", ARR, (STR, ["llama"])),
        ("general.architecture", "a string"),
        ModelFormatError,
    ),
    "chat_template_as_int": (
        _set("tokenizer.chat_template", U32, 7),
        ("tokenizer.chat_template", "a string"),
        ModelFormatError,
    ),
    "tokens_as_numbers": (
        _set("tokenizer.ggml.tokens", ARR, (I32, list(range(8)))),
        ("tokenizer.ggml.tokens", "array of strings"),
        ModelFormatError,
    ),
    "token_types_as_strings": (
        _set("tokenizer.ggml.token_type", ARR, (STR, ["1"] * 8)),
        ("tokenizer.ggml.token_type", "array of integers"),
        ModelFormatError,
    ),
    # hyperparameters out of range
    "head_count_0": (
        _set("llama.attention.head_count", U32, 0),
        ("llama.attention.head_count", "found 0"),
        ModelFormatError,
    ),
    "block_count_2^40": (
        _set("llama.block_count", U64, 1 << 40),
        ("llama.block_count", str(1 << 40)),
        ModelFormatError,
    ),
    "heads_not_multiple_of_kv_heads": (
        _set("llama.attention.head_count_kv", U32, 3),
        ("head_count_kv 3",),
        ModelFormatError,
    ),
    "rope_dim_over_head_dim": (
        _set("llama.rope.dimension_count", U32, 4096),
        ("llama.rope.dimension_count", "4096"),
        ModelFormatError,
    ),
    "norm_eps_nan": (
        _set("llama.attention.layer_norm_rms_epsilon", F32, NAN),
        ("llama.attention.layer_norm_rms_epsilon", "finite"),
        ModelFormatError,
    ),
    "rope_base_inf": (
        _set("llama.rope.freq_base", F32, INF),
        ("llama.rope.freq_base", "finite"),
        ModelFormatError,
    ),
    "missing_block_count": (
        _drop("llama.block_count"),
        ("llama.block_count", "missing"),
        ModelFormatError,
    ),
    # vocabularies
    "bos_id_beyond_vocab": (
        _set("tokenizer.ggml.bos_token_id", U32, 8),
        ("tokenizer.ggml.bos_token_id", "outside the vocabulary of 8"),
        ModelFormatError,
    ),
    "eos_id_negative": (
        _set("tokenizer.ggml.eos_token_id", I32, -5),
        ("tokenizer.ggml.eos_token_id", "outside the vocabulary"),
        ModelFormatError,
    ),
    "eos_id_as_float": (
        _set("tokenizer.ggml.eos_token_id", F32, 1.0),
        ("tokenizer.ggml.eos_token_id", "an integer"),
        ModelFormatError,
    ),
    "merge_names_unknown_token": (
        _set("tokenizer.ggml.merges", ARR, (STR, ["a b", "x y"])),
        ("tokenizer.ggml.merges", "entry #1", "not in the vocabulary"),
        ModelFormatError,
    ),
    "merge_without_space": (
        _set("tokenizer.ggml.merges", ARR, (STR, ["ab"])),
        ("tokenizer.ggml.merges", "entry #0"),
        ModelFormatError,
    ),
    "absurd_token_length": (
        _set("tokenizer.ggml.tokens", ARR, (STR, [*"ab", "x" * 5000, *"cdefg"])),
        ("tokenizer.ggml.tokens", "at most 4096 bytes", "5000"),
        ModelFormatError,
    ),
    "token_types_length_mismatch": (
        _set("tokenizer.ggml.token_type", ARR, (I32, [1, 1])),
        ("tokenizer.ggml.token_type", "2 entries"),
        ModelFormatError,
    ),
    "no_vocabulary": (
        _drop("tokenizer.ggml.tokens"),
        ("tokenizer.ggml.tokens",),
        ModelFormatError,
    ),
    "add_bos_as_u8": (
        _set("tokenizer.ggml.add_bos_token", U8, 1),
        ("tokenizer.ggml.add_bos_token", "a bool"),
        ModelFormatError,
    ),
    "unknown_tokenizer_model_type": (
        _set("tokenizer.ggml.model", BOOL, True),
        ("tokenizer.ggml.model", "a string"),
        ModelFormatError,
    ),
    # weights
    "nan_in_norm": (
        _vector("blk.0.attn_norm.weight", [1.0] * 5 + [NAN] + [1.0] * (D - 6)),
        ("blk.0.attn_norm.weight", "finite", "index 5"),
        ModelFormatError,
    ),
    "inf_in_output_norm": (
        _vector("output_norm.weight", [INF] + [1.0] * (D - 1)),
        ("output_norm.weight", "finite"),
        ModelFormatError,
    ),
    # shapes inconsistent with the spec
    "norm_too_short": (
        _tensor("blk.0.ffn_norm.weight", dims=(16,), data=f32((16,), 1.0)),
        ("blk.0.ffn_norm.weight", "32 values", "found 16"),
        ModelFormatError,
    ),
    "attn_q_wrong_shape": (
        _tensor("blk.0.attn_q.weight", dims=(32, 16), data=f32((16, 32))),
        ("blk.0.attn_q.weight", "shape"),
        ModelFormatError,
    ),
    "embedding_wrong_vocab": (
        _tensor("token_embd.weight", dims=(32, 4), data=f32((4, 32))),
        ("token_embd", "shape"),
        ModelFormatError,
    ),
    "output_wrong_shape": (
        lambda b: b.tensors.append(Tensor("output.weight", (32, 3), f32((3, 32)))),
        ("output.weight", "shape"),
        ModelFormatError,
    ),
    "missing_tensor": (
        lambda b: b.tensors.pop(),
        ("blk.0.ffn_down.weight", "missing"),
        ModelFormatError,
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _warm(tmp_path_factory):
    """Imports and first-use costs are paid here, not in the timed rejections."""
    open_model(GGUFBuilder().write(tmp_path_factory.mktemp("warm") / "ok.gguf"))


def test_the_valid_file_loads(tmp_path):
    """The builder's default file is a valid model: every rejection below is the edit's."""
    p = GGUFBuilder().write(tmp_path / "ok.gguf")
    t = open_model(p)
    assert t.spec.d_model == 32 and t.spec.vocab_size == 8
    import edgerun

    model = edgerun.load(p, n_ctx=64, threads=1)
    assert isinstance("".join(model.generate("ab", max_tokens=2)), str)


@pytest.mark.parametrize("kind", list(CASES))
def test_hostile_kind_is_rejected(kind, tmp_path):
    edit, needles, error = CASES[kind]
    b = GGUFBuilder()
    edit(b)
    p = b.write(tmp_path / f"{kind}.gguf")
    assert_rejected(lambda: open_model(p), str(p), *needles, kind=error)


def test_truncation_at_every_byte(tmp_path):
    """Every prefix of a valid file is rejected (the header at each byte, the data coarser)."""
    data = GGUFBuilder().to_bytes()
    header_end = len(GGUFBuilder().header())
    p = tmp_path / "cut.gguf"
    cuts = list(range(header_end + 1)) + list(range(header_end + 1, len(data), 97))
    for n in cuts:
        p.write_bytes(data[:n])
        err = assert_rejected(lambda: open_model(p), str(p), kind=ModelFormatError)
        assert any(w in str(err) for w in ("truncated", "too small", "file can", "file holds"))


def test_random_hostile_files_from_a_seed(tmp_path):
    """A seeded generator of random hostile variants (field values drawn from the
    interesting ones): each loads or is rejected cleanly, never anything else."""
    import random

    rng = random.Random(1234)
    interesting = [
        0,
        1,
        2,
        3,
        4,
        5,
        31,
        32,
        255,
        (1 << 31),
        (1 << 32) - 1,
        (1 << 63),
        (1 << 64) - 1,
    ]
    keys = list(GGUFBuilder().kvs)
    p = tmp_path / "r.gguf"
    for _ in range(60):
        b = GGUFBuilder()
        for _ in range(rng.randint(1, 3)):
            what = rng.randrange(4)
            if what == 0:
                b.kvs[rng.choice(keys)] = (U64, rng.choice(interesting))
            elif what == 1:
                t = rng.choice(b.tensors)
                t.dims = tuple(rng.choice(interesting) or 1 for _ in t.dims)
            elif what == 2:
                rng.choice(b.tensors).type_id = rng.choice(interesting) % (1 << 32)
            else:
                b.n_tensors = rng.choice(interesting)
        b.write(p)
        try:
            open_model(p)
        except EdgerunError:
            pass


def test_valid_real_model_still_loads(smollm2_path):
    f = read_gguf(smollm2_path)
    assert len(f.infos) == 272 and f.metadata["llama.block_count"] == 30


@pytest.mark.parametrize("kvtype", [U8, I32, U64])
def test_integer_fields_accept_any_integer_width(kvtype, tmp_path):
    """GGUF writers use different integer widths for the same key; all are accepted."""
    b = GGUFBuilder()
    b.kvs["llama.block_count"] = (kvtype, 1)
    assert open_model(b.write(tmp_path / "w.gguf")).spec.n_layers == 1


def test_long_string_values_stay_in_the_file(tmp_path):
    """A 30 MB string value (an embedded tokenizer.json) is neither copied nor decoded at
    open: the model loads within the memory bound and the text is there on request."""
    from hostile import bounded

    from edgerun.formats.gguf import MappedString

    b = GGUFBuilder()
    b.kvs["tokenizer.huggingface.json"] = (STR, "{" + "x" * (30 << 20) + "}")
    p = b.write(tmp_path / "long.gguf")
    err, dt, peak = bounded(lambda: open_model(p))
    assert err is None and peak < 20 << 20, (err, peak)
    value = read_gguf(p).metadata["tokenizer.huggingface.json"]
    assert isinstance(value, MappedString) and value.nbytes == (30 << 20) + 2
    assert str(value)[:3] == "{xx"
