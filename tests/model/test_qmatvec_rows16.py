"""The interleaved decode copies (ops/int8/rows16.py): the layout holds the file's
blocks, the kernels match the references as the row kernels do, batched rows equal the
single vector's bit for bit, and a resident model reads the copies end to end."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import QuantTensor, QuantType
from edgerun.quant.reference import dequantize, random_blocks

FORMATS = [
    QuantType.Q4_0,
    QuantType.Q4_1,
    QuantType.Q5_0,
    QuantType.Q8_0,
    QuantType.Q4_K,
    QuantType.Q6_K,
    QuantType.Q5_K,
    QuantType.IQ4_XS,
    QuantType.Q3_K,
    QuantType.Q2_K,
]
KQUANTS = tuple(q for q in FORMATS if q.name.endswith("_K") or q.name == "IQ4_XS")

pytestmark = pytest.mark.skipif(
    "vnni" not in qm.available_paths(), reason="the interleaved kernels need AVX-512 VNNI"
)


@pytest.fixture(autouse=True)
def vnni_path():
    old = qm.kernel_path()
    qm.set_kernel_path("vnni")
    yield
    qm.set_kernel_path(old)


def _tensor(q: QuantType, rows: int, cols: int, seed: int) -> QuantTensor:
    rng = np.random.default_rng(seed)
    return QuantTensor(f"t{q.name}", q, (rows, cols), random_blocks(q, rows, cols, rng))


def _deinterleave(q: QuantType, il: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols] from the interleaved bytes, in numpy (the layout, spelled
    independently of the kernels)."""
    from edgerun.ops.int8 import rows16 as r16

    kind = r16.KIND_OF[q]
    gb, nb = r16.GROUP_BYTES[kind], cols // 32
    if q == QuantType.Q4_K:  # super-blocks: 8 records of 288 bytes, then d and dmin
        sup = il.reshape(il.shape[0], nb // 8, r16.Q4K_SUPER)
        rec = sup[:, :, :2304].reshape(-1, nb // 8, 8, 288)
        packed = rec[..., :256].reshape(-1, nb, 4, 64)
        w = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(-1, nb, 8, 16, 4)
        w = w.transpose(0, 3, 1, 2, 4).reshape(-1, 16, nb, 32).astype(np.float32)
        d = sup[:, :, 2304:2336].copy().view(np.float16).astype(np.float32)  # [g, nsb, 16]
        dmin = sup[:, :, 2336:2368].copy().view(np.float16).astype(np.float32)
        sc = rec[..., 256:272].astype(np.float32)  # [g, nsb, 8, 16]
        mn = rec[..., 272:288].astype(np.float32)
        scale = (d[:, :, None, :] * sc).reshape(-1, nb, 16).transpose(0, 2, 1)[..., None]
        low = (dmin[:, :, None, :] * mn).reshape(-1, nb, 16).transpose(0, 2, 1)[..., None]
        return (w * scale - low).reshape(-1, cols)[:rows]
    if q == QuantType.Q6_K:  # super-blocks: 8 records of 416 bytes, then d
        sup = il.reshape(il.shape[0], nb // 8, r16.Q6K_SUPER)
        rec = sup[:, :, :3328].reshape(-1, nb, 416)
        packed = rec[..., :256].reshape(-1, nb, 4, 64)
        lo = np.concatenate([packed & 15, packed >> 4], axis=2)  # [g, nb, 8, 64]
        planes = rec[..., 256:384].reshape(-1, nb, 2, 64)
        hi = np.stack([(planes[:, :, k // 4] >> (2 * (k % 4))) & 3 for k in range(8)], axis=2)
        w = (lo | (hi << 4)).astype(np.float32) - 32
        w = w.reshape(-1, nb, 8, 16, 4).transpose(0, 3, 1, 2, 4).reshape(-1, 16, nb, 32)
        d = sup[:, :, 3328:3360].copy().view(np.float16).astype(np.float32)  # [g, nsb, 16]
        sc = rec[..., 384:416].view(np.int8).astype(np.float32).reshape(-1, nb // 8, 8, 2, 16)
        ds = (d[:, :, None, None, :] * sc).reshape(-1, nb, 2, 16).transpose(0, 3, 1, 2)
        return (np.repeat(ds, 16, axis=-1) * w).reshape(-1, cols)[:rows]
    if q == QuantType.Q5_K:  # super-blocks: 8 records of 352 bytes, then d and dmin
        sup = il.reshape(il.shape[0], nb // 8, r16.Q5K_SUPER)
        rec = sup[:, :, :2816].reshape(-1, nb // 8, 8, 352)
        packed = rec[..., :256].reshape(-1, nb, 4, 64)
        w = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(-1, nb, 8, 16, 4)
        masks = np.unpackbits(rec[..., 256:320].reshape(-1, nb, 64), bitorder="little")
        w = w + 16 * masks.reshape(-1, nb, 8, 16, 4)
        w = w.transpose(0, 3, 1, 2, 4).reshape(-1, 16, nb, 32).astype(np.float32)
        d = sup[:, :, 2816:2848].copy().view(np.float16).astype(np.float32)  # [g, nsb, 16]
        dmin = sup[:, :, 2848:2880].copy().view(np.float16).astype(np.float32)
        sc = rec[..., 320:336].astype(np.float32)  # [g, nsb, 8, 16]
        mn = rec[..., 336:352].astype(np.float32)
        scale = (d[:, :, None, :] * sc).reshape(-1, nb, 16).transpose(0, 2, 1)[..., None]
        low = (dmin[:, :, None, :] * mn).reshape(-1, nb, 16).transpose(0, 2, 1)[..., None]
        return (w * scale - low).reshape(-1, cols)[:rows]
    if q == QuantType.IQ4_XS:  # super-blocks: 8 records of 272 bytes, then d
        from edgerun.quant.iquants import KVALUES

        sup = il.reshape(il.shape[0], nb // 8, r16.IQ4XS_SUPER)
        rec = sup[:, :, :2176].reshape(-1, nb // 8, 8, 272)
        packed = rec[..., :256].reshape(-1, nb, 4, 64)
        idx = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(-1, nb, 8, 16, 4)
        w = KVALUES[idx].transpose(0, 3, 1, 2, 4).reshape(-1, 16, nb, 32).astype(np.float32)
        d = sup[:, :, 2176:2208].copy().view(np.float16).astype(np.float32)  # [g, nsb, 16]
        sc = rec[..., 256:272].view(np.int8).astype(np.float32)  # [g, nsb, 8, 16]
        scale = (d[:, :, None, :] * sc).reshape(-1, nb, 16).transpose(0, 2, 1)[..., None]
        return (w * scale).reshape(-1, cols)[:rows]
    if q in (QuantType.Q3_K, QuantType.Q2_K):  # 8 records, then d (and Q2_K's dmin)
        q3 = q == QuantType.Q3_K
        rec_bytes, sup_bytes = (224, r16.Q3K_SUPER) if q3 else (160, r16.Q2K_SUPER)
        sup = il.reshape(il.shape[0], nb // 8, sup_bytes)
        rec = sup[:, :, : 8 * rec_bytes].reshape(-1, nb, rec_bytes)
        planes = rec[..., :128].reshape(-1, nb, 2, 64)
        w = np.stack([(planes[:, :, k // 4] >> (2 * (k % 4))) & 3 for k in range(8)], axis=2)
        w = w.astype(np.int16)  # [g, nb, 8, 64]
        e = 8 * rec_bytes
        d = sup[:, :, e : e + 32].copy().view(np.float16).astype(np.float32)  # [g, nsb, 16]
        if q3:
            masks = np.unpackbits(rec[..., 128:192], bitorder="little").reshape(-1, nb, 8, 64)
            w = w + 4 * masks.astype(np.int16) - 4
            sc = rec[..., 192:224].view(np.int8).astype(np.float32).reshape(-1, nb // 8, 8, 2, 16)
            ml = np.zeros_like(sc)
        else:
            raw = rec[..., 128:160].reshape(-1, nb // 8, 8, 2, 16)
            sc = (raw & 15).astype(np.float32)
            dmin = sup[:, :, e + 32 : e + 64].copy().view(np.float16).astype(np.float32)
            ml = dmin[:, :, None, None, :] * (raw >> 4).astype(np.float32)
        w = w.reshape(-1, nb, 8, 16, 4).transpose(0, 3, 1, 2, 4).reshape(-1, 16, nb, 32)
        ds = (d[:, :, None, None, :] * sc).reshape(-1, nb, 2, 16).transpose(0, 3, 1, 2)
        ml = ml.reshape(-1, nb, 2, 16).transpose(0, 3, 1, 2)
        out = np.repeat(ds, 16, axis=-1) * w.astype(np.float32) - np.repeat(ml, 16, axis=-1)
        return out.reshape(-1, cols)[:rows]
    blk = il.reshape(il.shape[0], nb, gb)
    if q == QuantType.Q8_0:
        w = blk[:, :, :512].reshape(-1, nb, 8, 16, 4).astype(np.int16) - 128
        d_at = 512
    else:
        packed = blk[:, :, :256].reshape(-1, nb, 4, 64)
        w = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(-1, nb, 8, 16, 4)
        w = w.astype(np.int16)
        d_at = 256
        if q == QuantType.Q5_0:
            masks = np.unpackbits(blk[:, :, 256:320], bitorder="little").reshape(-1, nb, 8, 16, 4)
            w = w + 16 * masks.astype(np.int16) - 16
            d_at = 320
        elif q == QuantType.Q4_0:
            w = w - 8
    # [group, block, k, row, i] -> [group, row, block, 4k + i]
    w = w.transpose(0, 3, 1, 2, 4).reshape(-1, 16, nb, 32).astype(np.float32)
    d = blk[:, :, d_at : d_at + 32].copy().view(np.float16).astype(np.float32)  # [g, nb, 16]
    d = d.transpose(0, 2, 1)[..., None]
    out = w * d
    if q == QuantType.Q4_1:
        m = blk[:, :, 288:320].copy().view(np.float16).astype(np.float32).transpose(0, 2, 1)
        out = out + m[..., None]
    return out.reshape(-1, cols)[:rows]


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [16, 37, 96])
def test_layout_holds_the_files_blocks(q, rows):
    cols = 512 if q in KQUANTS else 96
    w = _tensor(q, rows, cols, seed=rows)
    il = qm.interleave(w)
    assert il.interleaved is not None and not il.interleaved.flags.writeable
    assert il.interleaved.shape[0] == -(-rows // 16)
    got = _deinterleave(q, il.interleaved, rows, cols)
    ref = dequantize(q, w.data)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    ids = np.array([rows - 1, 0, 5, 5, rows // 2])
    assert np.array_equal(qm.embedding_rows(il, ids), ref[ids])  # a tied head's lookup


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 4, 5, 9, 10])
def test_kernels_match_the_reference_and_batched_rows_equal_single(q, n):
    cols = 512 if q in KQUANTS else 128
    w = _tensor(q, 53, cols, seed=7 * n)
    il = qm.interleave(w)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    ref = np.stack([qm.matvec_reference(w, x[i]) for i in range(n)])
    rows = np.stack([qm.matvec(w, x[i]) for i in range(n)])  # the row kernels
    single = np.stack([qm.matvec(il, x[i]) for i in range(n)])
    batched = qm.matvec_batch(il, x)
    scale = np.abs(ref).max()
    # the same activations as the row kernels: the same error against the reference
    assert np.abs(single - ref).max() <= 1.05 * np.abs(rows - ref).max() + 1e-6 * scale
    assert np.abs(single - rows).max() <= 1e-5 * scale
    assert np.array_equal(batched, single)
    assert np.array_equal(qm.matmul(il, x), single)  # prompts take the copies too


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.name)
def test_three_matrices_in_one_call_equal_one_at_a_time(q):
    cols = 256 if q in KQUANTS else 64
    ws = [qm.interleave(_tensor(q, r, cols, seed=r)) for r in (16, 40, 8)]
    x = np.random.default_rng(3).standard_normal(cols).astype(np.float32)
    X = np.random.default_rng(4).standard_normal((3, cols)).astype(np.float32)
    for a, b in zip(qm.matvec_many(ws, x), ws):
        assert np.array_equal(a, qm.matvec(b, x))
    for a, b in zip(qm.matvec_batch_many(ws, X), ws):
        assert np.array_equal(a, qm.matvec_batch(b, X))
    calls = qm.bound_matvecs_batch(ws, X, [np.zeros((3, w.shape[0]), np.float32) for w in ws])
    assert len(calls) == 1  # one launch for the three


def test_mixed_layouts_and_formats_keep_apart():
    a = qm.interleave(_tensor(QuantType.Q8_0, 32, 64, seed=1))
    b = _tensor(QuantType.Q8_0, 32, 64, seed=2)  # no copy: the row kernel
    c = _tensor(QuantType.Q3_G64, 32, 256, seed=3)
    assert qm.interleave(c) is c  # a format without interleaved kernels
    x = np.random.default_rng(5).standard_normal(64).astype(np.float32)
    ya, yb = qm.matvec_many([a, b], x)
    assert np.array_equal(ya, qm.matvec(a, x)) and np.array_equal(yb, qm.matvec(b, x))


def test_other_paths_read_the_rows():
    w = _tensor(QuantType.Q5_0, 24, 64, seed=9)
    il = qm.interleave(w)
    x = np.random.default_rng(6).standard_normal(64).astype(np.float32)
    qm.set_kernel_path("portable")
    assert qm.interleave(w) is w  # no copies made off the vnni path
    assert np.array_equal(qm.matvec(il, x), qm.matvec(w, x))  # the copy is not read


def test_a_resident_model_decodes_from_the_copies(smollm2_path):
    """SmolLM2 (Q4_1, a tied Q8_0 head): the copies are made, the mapped rows' pages let
    go, greedy decoding agrees with the row kernels, and a batched step equals the
    single-sequence steps bit for bit."""
    import edgerun
    from edgerun.model.kvcache import KVCache

    il = edgerun.load(smollm2_path, n_ctx=128, threads=2)
    rows = edgerun.load(smollm2_path, n_ctx=128, threads=2, interleave=False)
    assert il.loader.interleaved_bytes > 0.8 * rows.file.file_size
    assert rows.loader.interleaved_bytes == 0
    tr = il.transformer
    assert tr.output.interleaved is not None and tr.token_embd is tr.output  # tied
    assert all(layer.ffn.gate.interleaved is not None for layer in tr.layers)
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of"
    ids = il.tokenize(text)
    a = il.logits(ids)
    b = rows.logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.95
    assert np.abs(a - b).max() < 0.5
    # a batch of three sequences decodes as each alone
    spec = tr.spec
    caches = [KVCache(spec, 32) for _ in range(3)]
    singles = [KVCache(spec, 32) for _ in range(3)]
    prompts = [ids[:5], ids[2:9], ids[4:6]]
    for c, s, p in zip(caches, singles, prompts):
        tr.forward(p, c)
        tr.forward(p, s)
    step = tr.forward_batch([7, 8, 9], caches)
    for i, s in enumerate(singles):
        assert np.array_equal(step[i], tr.forward([7 + i], s))
    with pytest.raises(InvalidArgumentError, match="interleave"):
        edgerun.load(smollm2_path, ram_budget="2G", interleave=True)


def test_long_prompts_read_the_mapped_rows_and_let_them_go(smollm2_path):
    """Past the batched limit a prompt takes the GEMM on the mapped rows (qmatvec.reads_rows);
    the model then lets each layer's pages go again, and its logits stay those of the
    rows (the GEMMs are the row layout's)."""
    import edgerun

    k = qm.interleave(_tensor(QuantType.Q4_K, 16, 256, seed=1))
    q5 = qm.interleave(_tensor(QuantType.Q5_0, 16, 64, seed=2))
    limit = qm.mvb_prefill_max(QuantType.Q4_K)
    assert not qm.reads_rows(k, limit) and qm.reads_rows(k, limit + 1)
    assert not qm.reads_rows(q5, qm.ROWS16_PREFILL_MAX) and qm.reads_rows(q5, 200)
    assert not qm.reads_rows(_tensor(QuantType.Q5_0, 16, 64, seed=2), 200)  # no copy

    model = edgerun.load(smollm2_path, n_ctx=256, threads=2)
    tr = model.transformer
    released: list[str] = []
    release = tr._release
    tr._release = lambda name: released.append(name) or release(name)
    ids = list(range(300, 300 + qm.ROWS16_PREFILL_MAX + 16))
    model.logits(ids[:8])
    assert released == []  # a short prompt reads the copies only
    model.logits(ids)
    copied = {t.name for ts in tr._copied for t in ts}
    assert set(released) == copied and len(copied) == 30 * 7 + 1


def test_copies_only_where_they_fit_the_memory_left():
    """A copy is anonymous memory, which nothing pages out: by default a load makes the
    copies only where they fit what the machine (or its memory cgroup) has left, and says
    why not."""
    from edgerun import api

    need = 100 << 20
    assert api.copies_fit(need, headroom=need * 2) == (True, "")
    fits, why = api.copies_fit(need, headroom=need)
    assert not fits and "176 MiB" in why and "100 MiB is left" in why
    assert api.copies_fit(0, headroom=1 << 40) == (False, "")


def test_a_load_plans_for_the_memory_left(smollm2_path, monkeypatch):
    """A default load of a model that does not fit what is left plans a RAM budget of what
    it holds and what is left, less 5% (the row kernels' output, an f16 KV cache); below
    the model's minimum it reads the mapping without copies; where it fits, it is
    resident with copies."""
    import edgerun
    from edgerun import api
    from edgerun.model.kvcache import KVCache

    prompt = "The capital of France is"
    n_ctx = 256
    ref = edgerun.load(smollm2_path, n_ctx=n_ctx, threads=2, interleave=False)
    want = "".join(ref.generate(prompt, max_tokens=8, temperature=0))
    need = ref.file.file_size + KVCache.bytes_for(ref.spec, n_ctx, "f32") + (64 << 20)
    left = need - (1 << 20)  # just short of what it needs
    monkeypatch.setattr(api, "memory_headroom_bytes", lambda: left)
    monkeypatch.setattr(api, "anonymous_rss_bytes", lambda: 4 << 30)
    m = edgerun.load(smollm2_path, n_ctx=n_ctx, threads=2)
    budget = int(((4 << 30) + left) / 1.05)
    assert m.plan is not None and m.plan.budget == budget and m.loader.interleaved_bytes == 0
    assert f"{left >> 20} MiB is left: planned for a RAM budget of {budget >> 20} MiB" in (
        m.loader.auto_budget_note
    )
    assert m.kv_type == "f16"
    assert "".join(m.generate(prompt, max_tokens=8, temperature=0)) == want
    from edgerun.tools import bench  # and edgerun bench says what the load did

    rep = bench.run(m, 8, 4, repeats=1, bandwidth=False, progress=False, predict=False)
    assert m.loader.auto_budget_note in bench.format_table(rep).splitlines()
    monkeypatch.setattr(api, "memory_headroom_bytes", lambda: 1 << 20)
    monkeypatch.setattr(api, "anonymous_rss_bytes", lambda: 1 << 20)
    m = edgerun.load(smollm2_path, n_ctx=64, threads=2)
    assert m.plan is None and "less than its minimum RAM budget" in m.loader.auto_budget_note
    assert m.loader.interleaved_bytes == 0 and "1 MiB is left" in m.loader.interleave_note
    assert m.kv_type == "f32"
    monkeypatch.setattr(api, "memory_headroom_bytes", lambda: 1 << 40)
    m = edgerun.load(smollm2_path, n_ctx=64, threads=2)
    assert m.plan is None and m.loader.auto_budget_note == "" and m.loader.interleave_note == ""
    assert m.loader.interleaved_bytes == ref.transformer.interleave_bytes() > 0.8 * m.file.file_size
