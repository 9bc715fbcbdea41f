"""A model split by gguf-split (``name-00001-of-00003.gguf``, ...) loads as one model.

SmolLM2-135M is split here into three shards with gguf-py's writer (``split_max_tensors``:
the same layout llama.cpp's gguf-split writes: ``split.no`` / ``split.count`` /
``split.tensors.count`` in every shard, all other metadata in the first, each shard's tensor
offsets its own). Loading any shard gives logits equal to the unsplit file's bit for bit; a
missing, renamed or inconsistent shard is a clear error naming the file; offloading (which
streams from one file by offset) refuses a split model with a clear error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from edgerun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError
from edgerun.formats.gguf import read_gguf

gguf = pytest.importorskip("gguf")

SHARDS = 3


def split_gguf(src: Path, out: Path, shards: int) -> list[Path]:
    """Write ``src`` as ``shards`` files ``<out stem>-0000i-of-0000n.gguf`` (gguf-py's writer
    with split_max_tensors, as convert_hf_to_gguf.py --split-max-tensors does)."""
    r = gguf.GGUFReader(src)
    per = -(-len(r.tensors) // shards)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents(), split_max_tensors=per)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [out.with_name(f"{out.stem}-{i:05d}-of-{shards:05d}.gguf") for i in range(1, shards + 1)]


@pytest.fixture(scope="module")
def shards(smollm2_path, tmp_path_factory) -> list[Path]:
    paths = split_gguf(Path(smollm2_path), tmp_path_factory.mktemp("split") / "smol.gguf", SHARDS)
    assert all(p.exists() for p in paths)
    return paths


def test_split_reads_as_the_whole_file(smollm2_path, shards):
    """Every shard's path opens the whole model: same metadata (less split.*), same
    tensors byte for byte, each viewed from the shard holding it."""
    whole = read_gguf(smollm2_path)
    for given in shards:
        split = read_gguf(given)
        assert split.path == shards[0] and split.paths == shards
        assert [s.path for s in split.shards] == shards
        assert sorted(split.infos) == sorted(whole.infos)
        assert {i.shard for i in split.infos.values()} == set(range(SHARDS))
        meta = {k: v for k, v in split.metadata.items() if not k.startswith("split.")}
        assert meta.keys() == whole.metadata.keys()
        assert split.metadata["split.count"] == SHARDS
        for name in whole.infos:
            a, b = whole.tensor(name), split.tensor(name)
            assert a.qtype == b.qtype and a.shape == b.shape
            assert np.array_equal(a.data, b.data), name
    assert split.file_size == sum(p.stat().st_size for p in shards)


def test_split_model_logits_equal_the_unsplit_files(resident, shards, text_ids):
    import edgerun

    model = edgerun.load(shards[1], n_ctx=256, threads=2, interleave=False)
    try:
        assert np.array_equal(model.logits(text_ids), resident.logits(text_ids))
        # decoding token by token too (the registry's sampling settings follow the file
        # name, so both get the same ones here)
        prompt = model.tokenize("The capital of France is")
        greedy = dict(max_tokens=8, temperature=0.0, repeat_penalty=1.0)
        want = list(resident.generate(prompt, **greedy))
        assert list(model.generate(prompt, **greedy)) == want
    finally:
        model.close()


def test_missing_shard_is_named(shards, tmp_path):
    for p in (shards[0], shards[2]):
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(ModelNotFoundError) as e:
        read_gguf(tmp_path / shards[0].name)
    msg = str(e.value)
    assert str(tmp_path / shards[1].name) in msg and "shard 2 of 3" in msg


def test_renamed_shard_is_refused(shards, tmp_path):
    odd = tmp_path / "model.gguf"
    shutil.copy(shards[0], odd)
    with pytest.raises(ModelFormatError, match=r"model\.gguf.*split\.no.*-00001-of-00003\.gguf"):
        read_gguf(odd)


def _patch_split_no(path: Path, value: int) -> None:
    """Rewrite the u16 value of the 'split.no' key in place."""
    data = bytearray(path.read_bytes())
    key = b"split.no"
    at = data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key)
    assert int.from_bytes(data[at : at + 4], "little") == gguf.GGUFValueType.UINT16
    data[at + 4 : at + 6] = value.to_bytes(2, "little")
    path.write_bytes(bytes(data))


def test_inconsistent_shards_are_refused(shards, tmp_path):
    for p in shards:
        shutil.copy(p, tmp_path / p.name)
    third = tmp_path / shards[2].name
    _patch_split_no(third, 1)  # the third shard claims to be the second
    with pytest.raises(ModelFormatError) as e:
        read_gguf(tmp_path / shards[0].name)
    msg = str(e.value)
    assert msg.startswith(str(third)) and "'split.no' should be 2" in msg


def test_offloading_a_split_model_is_refused_clearly(shards):
    import edgerun

    with pytest.raises(UnsupportedError) as e:
        edgerun.load(shards[0], n_ctx=256, threads=2, ram_budget="400M")
    msg = str(e.value)
    assert str(shards[0]) in msg and "split into 3 shards" in msg and "--merge" in msg


def test_info_says_the_model_is_split(shards, capsys):
    from edgerun.cli import main

    assert main(["info", str(shards[2])]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        "split in 3 shards" in first
        and f"{sum(p.stat().st_size for p in shards) / 1e6:.1f} MB" in first
    )
