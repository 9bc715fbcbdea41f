"""Neuron activation profiles (edgerun.offload.profile): counts, coverage, files, CLI."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from edgerun.errors import EdgerunError, InvalidArgumentError, ModelFormatError
from edgerun.offload.profile import NeuronProfile, profile_model, read_text

SHA = "ab" * 32


def synthetic(n_layers: int = 2, d_ff: int = 10) -> NeuronProfile:
    counts = np.zeros((n_layers, d_ff), np.int64)
    counts[0] = [9, 1, 0, 0, 0, 0, 0, 0, 0, 0]  # one hot neuron: top 10% covers 90%
    counts[1] = 1  # flat: top 10% covers 10%
    mass = counts.astype(np.float64) * 0.5
    mass[1, 3] = 4.5  # layer 1 by mass: neuron 3 holds 4.5 of 9
    return NeuronProfile(
        counts, mass, 10, 0.5, np.array([0.1, 0.2], np.float32)[:n_layers], SHA, "toy"
    )


# ------------------------------------------------------------------------- coverage
def test_coverage_by_count_and_mass():
    p = synthetic()
    per, overall = p.coverage(0.1)
    np.testing.assert_allclose(per, [0.9, 0.1])
    assert overall == pytest.approx((9 + 1) / (10 + 10))
    per, _ = p.coverage(0.2)
    np.testing.assert_allclose(per, [1.0, 0.2])
    per, overall = p.coverage(0.5)
    np.testing.assert_allclose(per, [1.0, 0.5])
    per, overall = p.coverage(0.1, by="mass")
    # layer 0: mass 4.5 of 5; layer 1: 4.5 of (9 * 0.5 + 4.5) = 9
    np.testing.assert_allclose(per, [0.9, 0.5])
    assert overall == pytest.approx((4.5 + 4.5) / (5 + 9))
    assert p.coverage(1.0)[1] == pytest.approx(1.0)
    assert p.coverage(0.0)[1] == 0.0


def test_coverage_rounds_the_share_up_and_checks_arguments():
    p = synthetic()
    per, _ = p.coverage(0.15)  # ceil(1.5) = 2 neurons
    np.testing.assert_allclose(per, [1.0, 0.2])
    with pytest.raises(InvalidArgumentError):
        p.coverage(1.5)
    with pytest.raises(InvalidArgumentError):
        p.coverage(0.1, by="tokens")


def test_frequencies_hot_order_and_table():
    p = synthetic()
    np.testing.assert_allclose(p.frequencies(0)[:2], [0.9, 0.1])
    assert p.hot_order(0)[:2].tolist() == [0, 1]
    assert p.hot_order(1)[0] == 3  # equal counts: the larger mass first
    assert sorted(p.hot_order(1).tolist()) == list(range(10))
    with pytest.raises(InvalidArgumentError):
        p.frequencies(2)
    text = p.describe()
    assert "top10%" in text and "by mass" in text
    all_row = next(line for line in text.splitlines() if line.strip().startswith("all"))
    assert "50.0%" in all_row  # top 10% by count overall
    assert len(text.splitlines()) == 4 + 2 + 3


def test_empty_profile_is_not_a_division_by_zero():
    p = NeuronProfile(
        np.zeros((1, 4), np.int64), np.zeros((1, 4)), 0, 0.1, np.zeros(1, np.float32), SHA, "x"
    )
    per, overall = p.coverage(0.1)
    assert per.tolist() == [0.0] and overall == 0.0
    assert (p.frequencies(0) == 0).all()
    p.describe()


# ----------------------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path):
    p = synthetic()
    path = p.save(tmp_path / "sub" / "p.profile.npz")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    q = NeuronProfile.load(path, expect_sha256=SHA.upper())
    for f in ("counts", "mass", "thresholds"):
        a, b = getattr(p, f), getattr(q, f)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert (q.n_tokens, q.sparsity, q.source_sha256, q.model) == (10, 0.5, SHA, "toy")


def _write(path, **over):
    """A profile .npz with some fields replaced (None: left out; bytes: a raw .npy)."""
    p = synthetic()
    arrays = {
        "version": np.array(1, np.int64),
        "counts": p.counts,
        "mass": p.mass,
        "n_tokens": np.array(p.n_tokens, np.int64),
        "sparsity": np.array(p.sparsity),
        "thresholds": p.thresholds,
        "source_sha256": np.array(p.source_sha256),
        "model": np.array(p.model),
    }
    arrays.update(over)
    with zipfile.ZipFile(path, "w") as zf:
        for k, v in arrays.items():
            if v is None:
                continue
            if not isinstance(v, bytes):
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.asanyarray(v), allow_pickle=True)
                v = buf.getvalue()
            zf.writestr(f"{k}.npy", v)
    return path


@pytest.mark.parametrize(
    "field,value",
    [
        ("counts", np.zeros((2, 10), np.int32)),  # wrong dtype
        ("counts", np.zeros(10, np.int64)),  # wrong rank
        ("counts", np.full((2, 10), 11, np.int64)),  # more than n_tokens
        ("mass", np.zeros((2, 9))),  # wrong shape
        ("mass", np.full((2, 10), np.nan)),  # not finite
        ("thresholds", np.zeros(3, np.float32)),  # wrong shape
        ("thresholds", np.zeros(2, np.float64)),  # wrong dtype
        ("thresholds", np.array([np.inf, 0], np.float32)),
        ("sparsity", np.array(1.5)),
        ("n_tokens", np.array(-1)),
        ("source_sha256", np.array("not a sha")),
        ("version", np.array(7)),
        ("model", None),  # missing
        ("mass", np.array([1, 2], dtype=object)),  # a pickle
    ],
)
def test_load_rejects_bad_fields(tmp_path, field, value):
    path = _write(tmp_path / "bad.npz", **{field: value})
    with pytest.raises(ModelFormatError) as e:
        NeuronProfile.load(path)
    assert str(path) in str(e.value) and f"'{field}'" in str(e.value)


def test_load_rejects_another_files_profile(tmp_path):
    path = synthetic().save(tmp_path / "p.npz")
    with pytest.raises(ModelFormatError, match="'source_sha256'.*another file"):
        NeuronProfile.load(path, expect_sha256="cd" * 32)


def test_load_rejects_corrupt_files(tmp_path):
    path = synthetic().save(tmp_path / "p.npz")
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):  # inside an array's bytes
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=str(path)):
        NeuronProfile.load(path)
    path.write_bytes(b"not a zip file")
    with pytest.raises(ModelFormatError, match="not a neuron profile"):
        NeuronProfile.load(path)
    path.write_bytes(path.read_bytes()[:5])
    with pytest.raises(ModelFormatError):
        NeuronProfile.load(path)
    with pytest.raises(ModelFormatError, match="no such"):
        NeuronProfile.load(tmp_path / "missing.npz")


def test_load_checks_shapes_before_reading(tmp_path):
    """A header claiming a huge array is refused without allocating it."""
    buf = io.BytesIO()
    hdr = {"descr": "<i8", "fortran_order": False, "shape": (10**6, 10**6)}
    np.lib.format.write_array_header_1_0(buf, hdr)
    path = _write(tmp_path / "huge.npz", counts=buf.getvalue())
    with pytest.raises(ModelFormatError, match="'counts'.*bounds"):
        NeuronProfile.load(path)


def test_read_text_errors_name_the_file(tmp_path):
    with pytest.raises(EdgerunError, match="missing.txt"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(EdgerunError, match="empty.txt is empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(EdgerunError, match="bin.txt"):
        read_text(tmp_path / "bin.txt")
    with pytest.raises(EdgerunError, match="cannot read"):
        read_text(tmp_path)  # a directory
    assert len(read_text(None)) > 1000


# ------------------------------------------------------------------------ real model
def _parts(m):
    """What profile_model takes of a loaded model: its file path, the opened file, the
    resident Transformer and the tokenizer."""
    return m.path, m.file, m.transformer, m.tokenizer


def test_counts_match_a_brute_force_recount(smollm2):
    """Layers 0 and 1 recounted from their recorded FFN inputs through the numpy
    reference (dequantized gate, float64): each count lies between the recounts at
    t(1 + 1e-3) and t(1 - 1e-3) (the kernels' rounding moves scores at the edge)."""
    from edgerun.offload.sparsity import abs_act, collect_activations
    from edgerun.quant.reference import dequantize

    ids = smollm2.tokenize("The quick brown fox jumps over the lazy dog. " * 3)[:24]
    prof = profile_model(*_parts(smollm2), ids, sparsity=0.5, chunk=8, progress=False)
    assert prof.n_tokens == len(ids) and prof.counts.shape == (30, smollm2.spec.d_ff)
    rec = collect_activations(smollm2.transformer, ids, layers=[0, 1], keep_x=True, chunk=8)
    for layer in (0, 1):
        gate = smollm2.transformer.layers[layer].ffn.gate
        w = dequantize(gate.qtype, np.asarray(gate.data)).reshape(gate.shape)
        x = rec.layer_x(layer).astype(np.float64)
        act = smollm2.transformer.layers[layer].ffn.activation
        s = abs_act((x @ w.T.astype(np.float64)).astype(np.float32), act)
        t = prof.thresholds[layer]
        lo = (s >= t * (1 + 1e-3)).sum(axis=0)
        hi = (s >= t * (1 - 1e-3)).sum(axis=0)
        c = prof.counts[layer]
        assert ((lo <= c) & (c <= hi)).all()
        assert (c == (s >= t).sum(axis=0)).mean() > 0.99
        np.testing.assert_allclose(prof.mass[layer], s.sum(axis=0), rtol=2e-2, atol=1e-2)
    # the executors are restored
    from edgerun.model.ffn import DenseFFN

    assert all(isinstance(ly.ffn, DenseFFN) for ly in smollm2.transformer.layers)


def test_profile_model_checks_arguments(smollm2):
    with pytest.raises(InvalidArgumentError):
        profile_model(*_parts(smollm2), [1, 2], sparsity=1.0, progress=False)
    with pytest.raises(InvalidArgumentError):
        profile_model(*_parts(smollm2), [], progress=False)
    with pytest.raises(InvalidArgumentError):
        profile_model(*_parts(smollm2), [10**9], progress=False)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "edgerun.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_cli_profiles_end_to_end(smollm2_path, tmp_path):
    from edgerun.offload.bundle import source_sha256
    from edgerun.registry import find_by_file

    out = tmp_path / "smol.profile.npz"
    r = _cli("profile", "smollm2-135m", "--tokens", "128", "-o", str(out), "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "top10%" in r.stdout and "by count" in r.stdout and f"wrote {out}" in r.stdout
    assert sum(line.split()[0].isdigit() for line in r.stdout.splitlines()) == 30
    m = find_by_file(smollm2_path)
    sha = m.sha256 if m is not None and m.sha256 else source_sha256(smollm2_path)
    p = NeuronProfile.load(out, expect_sha256=sha)
    assert p.n_tokens == 128 and p.sparsity == 0.1 and p.counts.shape[0] == 30
    # at 10% sparsity about 90% of the neurons are active per token
    assert 0.8 < p.active_fraction().mean() < 0.97


def test_cli_missing_text_file_is_a_clean_error(tmp_path):
    r = _cli("profile", "smollm2-135m", "--text", str(tmp_path / "nope.txt"), "-o", "x.npz")
    assert r.returncode != 0
    assert "nope.txt" in r.stderr and "Traceback" not in r.stderr
    r = _cli("profile", "smollm2-135m", "--tokens", "0")
    assert r.returncode != 0 and "--tokens" in r.stderr and "Traceback" not in r.stderr


def test_default_path_and_load_default_profile(smollm2, tmp_path, monkeypatch):
    import edgerun.offload.profile as prof_mod
    from edgerun.offload.profile import default_profile_path, load_default_profile

    path = default_profile_path(smollm2.path)
    assert path.name.endswith("-q8_0.profile.npz") and path.parent.name == "offload"
    assert default_profile_path(smollm2.path, 0.5).name.endswith("-q8_0.profile-s0.5.npz")
    assert default_profile_path(smollm2.path, 0.1) == path

    where = {None: tmp_path / "d.npz", 0.5: tmp_path / "h.npz"}
    monkeypatch.setattr(prof_mod, "default_profile_path", lambda m, s=None: where[s])
    assert load_default_profile(smollm2.path, smollm2.spec) is None
    ids = smollm2.tokenize("def f(x):\n    return x + 1\n")
    p = profile_model(*_parts(smollm2), ids, sparsity=0.5, progress=False)
    p.save(where[0.5])
    q = load_default_profile(smollm2.path, smollm2.spec, 0.5)
    assert q is not None and np.array_equal(q.counts, p.counts)
    p.save(where[None])  # a 0.5 profile where the default one should be
    with pytest.raises(ModelFormatError, match="'sparsity'"):
        load_default_profile(smollm2.path, smollm2.spec)
