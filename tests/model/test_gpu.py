"""GPU hand-off through torch (edgerun/gpu/): the torch path run on the CPU device must
give the CPU path's tokens on the real model; torch stays a lazy, optional import."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from edgerun.errors import EdgerunError, GpuUnavailableError, InvalidArgumentError
from edgerun.gpu import import_torch, resolve_device
from edgerun.model.kvcache import KVCache
from edgerun.model.transformer import Transformer
from edgerun.model.weights import ResidentProjections
from edgerun.ops import qmatvec

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top "
    "he could see the fishing boats returning to the harbour, their lamps swinging in "
    "the wind, while gulls circled above the grey water and the town lit its windows."
)
# torch f32 on the CPU against the CPU kernels, 64 tokens of TEXT, logits up to |33|:
# measured 3.5e-5 on the portable path; the vnni path quantizes x to two-level int8
# blocks, and that rounding applied to the torch layers' inputs moves logits by 7.5e-3
MAX_LOGIT_DIFF = 0.1


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ids(smollm2):
    ids = smollm2.tokenize(TEXT)[:64]
    assert len(ids) >= 48
    return ids


def _logits(tr: Transformer, ids: list[int]) -> np.ndarray:
    cache = KVCache(tr.spec, len(ids), "f32")
    return tr.forward(ids, cache, all_logits=True)


@pytest.fixture(scope="module")
def reference(smollm2, ids):
    return _logits(Transformer(smollm2.spec, smollm2.store), ids)


@pytest.fixture(scope="module")
def moved_all(smollm2, torch):
    from edgerun.gpu.place import move_layers

    tr = Transformer(smollm2.spec, smollm2.store)
    t0 = time.perf_counter()
    pl = move_layers(tr, smollm2.store, list(range(smollm2.spec.n_layers)), "cpu")
    print(f"\nmove_layers: all {len(pl.layers)} layers in {time.perf_counter() - t0:.2f} s")
    return tr, pl


def _compare(name: str, got: np.ndarray, want: np.ndarray) -> float:
    diff = float(np.abs(got - want).max())
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    print(f"\n{name}: argmax agreement {agree:.0%}, max |logit diff| {diff:.2e}")
    assert agree == 1.0
    assert diff < MAX_LOGIT_DIFF
    return diff


def test_all_layers_on_torch_cpu_match_the_cpu_path(smollm2, moved_all, reference, ids):
    from edgerun.gpu.executors import TorchFFN, TorchProjections
    from edgerun.gpu.place import layer_device_bytes

    tr, pl = moved_all
    s = smollm2.spec
    assert pl.device == "cpu" and pl.dtype == "float32"
    assert pl.layers == tuple(range(s.n_layers)) and pl.parts == ("ffn", "attention")
    per = layer_device_bytes(s, "float32")
    assert per["ffn"] == 3 * s.d_ff * s.d_model * 4
    assert pl.device_bytes == s.n_layers * (per["ffn"] + per["attention"])
    assert set(pl.layer_bytes) == set(pl.layers)
    assert "layers 0..29" in pl.describe()
    for layer in tr.layers:
        assert isinstance(layer.ffn, TorchFFN) and isinstance(layer.attn_proj, TorchProjections)
    _compare("all layers, ffn + attention", _logits(tr, ids), reference)


def test_partial_placement_matches(smollm2, torch, reference, ids):
    from edgerun.gpu.executors import TorchFFN
    from edgerun.gpu.place import move_layers

    tr = Transformer(smollm2.spec, smollm2.store)
    pl = move_layers(tr, smollm2.store, range(10), "cpu", parts=("ffn",))
    assert pl.layers == tuple(range(10)) and pl.parts == ("ffn",)
    assert all(isinstance(tr.layers[i].ffn, TorchFFN) for i in range(10))
    assert all(isinstance(la.attn_proj, ResidentProjections) for la in tr.layers)
    assert not isinstance(tr.layers[10].ffn, TorchFFN)
    _compare("layers 0..9, ffn only", _logits(tr, ids), reference)


def test_f16_device_weights_keep_the_tokens(smollm2, torch, reference, ids):
    """The CUDA default dtype, run on the CPU (measured: max diff 0.040, argmax 100%)."""
    from edgerun.gpu.place import move_layers

    tr = Transformer(smollm2.spec, smollm2.store)
    pl = move_layers(tr, smollm2.store, range(smollm2.spec.n_layers), "cpu", dtype="f16")
    assert pl.dtype == "float16"
    got = _logits(tr, ids)
    diff = float(np.abs(got - reference).max())
    agree = float((got.argmax(-1) == reference.argmax(-1)).mean())
    print(f"\nf16 weights: argmax agreement {agree:.0%}, max |logit diff| {diff:.2e}")
    assert agree >= 0.95 and diff < 0.5


def _batch_and_single(tr: Transformer, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    prefixes = [ids[:5], ids[10:19], ids[30:33]]
    nxt = [ids[5], ids[19], ids[33]]

    def prefilled():
        caches = [KVCache(tr.spec, 16, "f32") for _ in prefixes]
        for p, c in zip(prefixes, caches):
            tr.forward(p, c)
        return caches

    batch = tr.forward_batch(nxt, prefilled())
    single = np.stack([tr.forward([t], c) for t, c in zip(nxt, prefilled())])
    return batch, single


def test_cpu_forward_batch_stays_bit_identical(smollm2, ids):
    """Through ResidentProjections, a batched decode row is still the one-token result."""
    batch, single = _batch_and_single(Transformer(smollm2.spec, smollm2.store), ids)
    assert np.array_equal(batch, single)


def test_forward_batch_with_moved_layers_matches_forward(moved_all, ids):
    batch, single = _batch_and_single(moved_all[0], ids)
    assert np.array_equal(batch.argmax(-1), single.argmax(-1))
    np.testing.assert_allclose(batch, single, atol=1e-3, rtol=0)


def test_ffn_executor_alone(smollm2, torch):
    """TorchFFN against DenseFFN on one layer: prefill rows and decode_batch."""
    from edgerun.gpu.executors import TorchFFN

    s, store = smollm2.spec, smollm2.store
    dense = store.ffn(s, 3)
    ffn = TorchFFN(dense.gate, dense.up, dense.down, s.activation, "cpu")
    assert (ffn.d_model, ffn.d_ff) == (s.d_model, s.d_ff)
    x = np.random.default_rng(0).standard_normal((5, s.d_model)).astype(np.float32)
    got, want = ffn(x), dense(x)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
    np.testing.assert_allclose(ffn.decode_batch(x[:3]), got[:3], atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidArgumentError):
        ffn(x[:, :10])


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_activations_match_glu(torch, kind):
    from edgerun.gpu.executors import TorchFFN
    from edgerun.ops.activations import glu_reference
    from edgerun.quant.formats import QuantTensor, QuantType

    rng = np.random.default_rng(1)
    d, f = 32, 64

    def mat(rows, cols):
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return w, QuantTensor("w", QuantType.F32, (rows, cols), w.view(np.uint8))

    (g, gq), (u, uq), (dn, dq) = mat(f, d), mat(f, d), mat(d, f)
    x = (3 * rng.standard_normal((4, d))).astype(np.float32)
    want = glu_reference(x @ g.T, x @ u.T, kind) @ dn.T
    got = TorchFFN(gq, uq, dq, kind, "cpu")(x)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidArgumentError, match="relu"):
        TorchFFN(gq, uq, dq, "relu", "cpu")


def test_device_weights_dequantize_every_registry_format(torch):
    from edgerun.gpu.weights import to_device
    from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, row_bytes
    from edgerun.quant.reference import dequantize, random_blocks

    rng = np.random.default_rng(2)
    for qt in BLOCK_LAYOUT:
        rows, cols = 3, 256
        raw = random_blocks(qt, rows, cols, rng)
        assert raw.shape == (rows, row_bytes(qt, cols))
        t = QuantTensor("t", qt, (rows, cols), raw)
        got = to_device(t, torch.device("cpu"), "float32").numpy()
        np.testing.assert_array_equal(got, dequantize(qt, raw), err_msg=qt.name)
        half = to_device(t, torch.device("cpu"), "f16")
        assert half.dtype == torch.float16 and tuple(half.shape) == (rows, cols)


def test_resident_projections_are_the_cpu_kernels(smollm2):
    """The default attn_proj computes exactly what model.py computed before the seam."""
    tr = Transformer(smollm2.spec, smollm2.store)
    layer = tr.layers[2]
    p = layer.attn_proj
    assert isinstance(p, ResidentProjections)
    assert (p.q, p.k, p.v, p.o) == (layer.q, layer.k, layer.v, layer.o)
    rng = np.random.default_rng(3)
    s = smollm2.spec
    for n in (1, 4):
        x = rng.standard_normal((n, s.d_model)).astype(np.float32)
        ctx = rng.standard_normal((n, s.q_dim)).astype(np.float32)
        for a, b in zip(p.qkv(x), qmatvec.project_many((layer.q, layer.k, layer.v), x)):
            assert np.array_equal(a, b)
        assert np.array_equal(p.out(ctx), qmatvec.project(layer.o, ctx))
        for a, w in zip(p.qkv_batch(x), (layer.q, layer.k, layer.v)):
            assert np.array_equal(a, qmatvec.matvec_batch(w, x))
        assert np.array_equal(p.out_batch(ctx), qmatvec.matvec_batch(layer.o, ctx))


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` -> ImportError
    with pytest.raises(GpuUnavailableError, match=r"edgerun\[gpu\]") as e:
        import_torch()
    assert isinstance(e.value, EdgerunError)
    with pytest.raises(GpuUnavailableError, match=r"pip install 'edgerun\[gpu\]'"):
        resolve_device("cpu")


def test_cuda_without_a_cuda_device(torch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    for name in ("cuda", "cuda:0", "CUDA:1"):
        with pytest.raises(GpuUnavailableError, match="no CUDA device is visible") as e:
            resolve_device(name)
        assert "--gpu-device cpu" in str(e.value)


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "cpu:0", "", "mps", "cuda:-1"])
def test_bad_device_names(name):
    with pytest.raises(InvalidArgumentError, match="'cpu'.*'cuda'.*'cuda:N'"):
        resolve_device(name)


def test_bad_placements(smollm2, torch):
    from edgerun.gpu.place import move_layers

    tr = Transformer(smollm2.spec, smollm2.store)
    before = [(la.ffn, la.attn_proj) for la in tr.layers]
    for kw in (
        {"layers": [30]},
        {"layers": [-1]},
        {"layers": [1, 1]},
        {"layers": [0], "parts": ("ffn", "head")},
        {"layers": [0], "parts": ()},
        {"layers": [0], "dtype": "int4"},
        {"layers": [0], "device": "tpu"},
    ):
        kw = {"device": "cpu", **kw}
        with pytest.raises(InvalidArgumentError):
            move_layers(tr, smollm2.store, **kw)
    assert [(la.ffn, la.attn_proj) for la in tr.layers] == before
    empty = move_layers(tr, smollm2.store, [], "cpu")
    assert empty.device_bytes == 0 and "nothing placed" in empty.describe()


def test_layer_device_bytes_f16_halves_f32(smollm2):
    from edgerun.gpu.place import layer_device_bytes

    s = smollm2.spec
    f16, f32 = layer_device_bytes(s, "float16"), layer_device_bytes(s, "f32")
    assert f16["attention"] == (2 * s.q_dim + 2 * s.kv_dim) * s.d_model * 2
    assert {k: 2 * v for k, v in f16.items()} == f32


def test_measure_device_cpu(torch):
    from edgerun.gpu.calibrate import measure_device

    m = measure_device("cpu")
    print("\nmeasure_device('cpu'):", m)
    assert m["device"] == "cpu" and m["dtype"] == "float32"
    for key in ("matvec_bytes_per_s", "roundtrip_seconds", "h2d_bytes_per_s", "d2h_bytes_per_s"):
        assert m[key] > 0
    assert m["seconds"] < 3.0


def test_torch_is_lazy_and_only_in_gpu():
    """No module outside edgerun/gpu/ imports torch; model code never imports gpu/; and
    importing the package (gpu/ included) does not import torch."""
    from test_layering import PKG, imports_of

    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for line, mod, text in imports_of(path, PKG):
            if (mod == "torch" or mod.startswith("torch.")) and not rel.startswith("gpu/"):
                bad.append(f"{rel}:{line}: {text}")
            below = ("model/", "generate/", "ops/", "quant/", "formats/")
            if rel.startswith(below) and mod.startswith("edgerun.gpu"):
                bad.append(f"{rel}:{line}: {text}")
            # gpu/ takes layers and weights, never the forward pass or anything above it
            if rel.startswith("gpu/") and any(
                mod == f"edgerun.{m}" or mod.startswith(f"edgerun.{m}.")
                for m in (
                    "model.transformer",
                    "model.decode_step",
                    "api",
                    "generate",
                    "cli",
                    "tools",
                    "formats",
                    "offload",
                    "serving",
                )
            ):
                bad.append(f"{rel}:{line}: {text}")
    assert not bad, "\n".join(bad)
    code = (
        "import sys, edgerun.api, edgerun.model.transformer, edgerun.gpu, edgerun.gpu.place, "
        "edgerun.gpu.calibrate; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
