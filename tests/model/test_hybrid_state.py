"""A hybrid model's recurrent states (model/state_cache.py) wherever the KV cache goes, on
a tiny random LFM2 (short-convolution layers 0 and 2, attention layers 1 and 3:
tiny_families.py) and, where the check is not LFM2's own, a tiny random Qwen3.5 (gated
DeltaNet layers 0 and 2, gated attention layers 1 and 3) and Granite 4.0 H (Mamba-2 layers
0 and 2): decode rows against prompt
passes, batched sequences against each alone, prefix reuse, speculative rollback, context
limits and the RAM budget's plan.
(Sessions saved and resumed, the batching scheduler, packs and FFN offloading under a
RAM budget: test_family_paths.py, which runs every tiny family, the hybrids included.)"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_families import family_gguf

import edgerun
from edgerun.errors import ContextOverflowError
from edgerun.model.kvcache import KVCache

GREEDY = dict(temperature=0.0, repeat_penalty=1.0)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    path = family_gguf(tmp_path_factory.mktemp("hybrid") / "lfm2.gguf", "lfm2")
    m = edgerun.load(path, n_ctx=256, threads=1, kv_type="f32")
    yield m
    m.close()


# the hybrid families, each with its recurrent mixer: LFM2's short convolution, Qwen3.5's
# gated DeltaNet (with gated attention layers), Granite 4.0 H's Mamba-2
@pytest.fixture(scope="module", params=["lfm2", "qwen35", "granitehybrid"])
def hybrid(request, tmp_path_factory):
    family = request.param
    path = family_gguf(tmp_path_factory.mktemp("hybrid") / f"{family}.gguf", family)
    m = edgerun.load(path, n_ctx=256, threads=1, kv_type="f32")
    yield m
    m.close()


def _states(cache: KVCache) -> dict[str, np.ndarray]:
    return {k: a.copy() for k, a in cache.state.arrays().items()}


def test_only_attention_layers_hold_kv_rows(lfm2):
    s = lfm2.spec
    assert s.layer_mixers == ("shortconv", "attention", "shortconv", "attention")
    c = KVCache(s, 16)
    assert c.k.shape[0] == 2 and set(c.state.layers) == {0, 2}
    assert c.state.layers[0]["conv"].shape == (2, s.d_model)


def test_one_token_steps_follow_the_prompt_pass(hybrid):
    """The state a prompt pass leaves continues as one-token steps would: logits of the
    whole text at once equal those of the steps, and the states end equal."""
    tr, ids = hybrid.transformer, hybrid.tokenize("hello world, this is the test")
    full_cache, step_cache = KVCache(hybrid.spec, 64), KVCache(hybrid.spec, 64)
    full = tr.forward(ids, full_cache, all_logits=True)
    steps = np.stack([tr.forward([t], step_cache) for t in ids])
    # the prompt's GEMM and the steps' matvecs quantize activations in blocks of their own:
    # on the avx2 path they round apart by up to 2.1e-4 of the spread (Qwen3.5)
    assert np.allclose(full, steps, atol=4e-4 * np.ptp(full))
    assert (full.argmax(-1) == steps.argmax(-1)).all()
    for k, a in _states(full_cache).items():
        # the prompt's matmuls and the steps' matvecs round apart; deeper layers' states
        # (Qwen3.5's layer 2 conv holds raw projections) carry that rounding
        atol = max(1e-5, 3e-4 * np.abs(a).max())
        assert np.allclose(a, step_cache.state.arrays()[k], atol=atol), k
    assert any(np.abs(a).max() > 0 for a in _states(full_cache).values())


def test_verification_rows_equal_one_token_steps_and_keep_each_state(hybrid):
    tr, ids = hybrid.transformer, hybrid.tokenize("the theme of the day")
    one, many = KVCache(hybrid.spec, 64), KVCache(hybrid.spec, 64)
    tr.forward(ids[:3], one)
    tr.forward(ids[:3], many)
    rows = tr.verify(ids[3:], many)
    per_position = []
    for t in ids[3:]:
        per_position.append((tr.forward([t], one), _states(one)))
    assert np.array_equal(rows, np.stack([r for r, _ in per_position]))
    # a rejected draft rolls the states back to the verified position, bit for bit
    keep = 4
    many.truncate(many.reusable(keep))
    assert many.length == keep
    for k, a in _states(many).items():
        assert np.array_equal(a, per_position[keep - 4][1][k]), k


def test_batched_sequences_equal_each_alone_and_never_share_a_state(hybrid):
    tr = hybrid.transformer
    prompts = [hybrid.tokenize(p) for p in ("the theme", "hello world", "x", "thethethe")]
    alone, batch = [], []
    for p in prompts:
        a, b = KVCache(hybrid.spec, 64), KVCache(hybrid.spec, 64)
        la, lb = tr.forward(p, a), tr.forward(p, b)
        alone.append([a, [int(la.argmax())]])
        batch.append([b, [int(lb.argmax())]])
    for _ in range(6):
        for cache, toks in alone:
            toks.append(int(tr.forward([toks[-1]], cache).argmax()))
        logits = tr.forward_batch([t[-1] for _, t in batch], [c for c, _ in batch])
        for (_, toks), row in zip(batch, logits):
            toks.append(int(row.argmax()))
    for (a, ta), (b, tb) in zip(alone, batch):
        assert ta == tb
        for k, x in _states(a).items():
            assert np.array_equal(x, b.state.arrays()[k]), k
    # different texts leave different states: nothing was shared between the rows
    s0, s1 = _states(batch[0][0]), _states(batch[1][0])
    assert any(not np.array_equal(s0[k], s1[k]) for k in s0)


def test_a_repeated_prompt_reuses_the_kept_state_and_gives_the_same_text(hybrid):
    g = hybrid.generator
    first = "".join(hybrid.generate("the theme of the day", max_tokens=12, **GREEDY))
    n = len(hybrid.tokenize("the theme of the day"))
    assert g.cache.length > n  # the cache holds the answer past the prompt
    second = "".join(hybrid.generate("the theme of the day", max_tokens=12, **GREEDY))
    assert second == first
    assert g.stats.cached_tokens == n - 1  # the state kept at the prompt's end
    # a prompt sharing only a prefix of no kept state starts over, and is still right
    other = "".join(hybrid.generate("the theme of the night", max_tokens=12, **GREEDY))
    g.cache.clear()
    fresh = "".join(hybrid.generate("the theme of the night", max_tokens=12, **GREEDY))
    assert other == fresh


class _HalfRightDrafter:
    """Proposes the plain run's next tokens with the third one wrong: every verification
    pass keeps two drafts and rejects the rest, so the states roll back to the middle of
    the pass."""

    name, resident_bytes = "half-right", 0

    def __init__(self, truth: list[int], vocab: int) -> None:
        self.truth, self.vocab = truth, vocab

    def propose(self, history, k: int) -> list[int]:
        out = list(self.truth[len(history) : len(history) + k])
        if len(out) > 2:
            out[2] = (out[2] + 1) % self.vocab
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("drafter", ["ngram", "half-right", "self"])
def test_speculative_decoding_gives_the_plain_greedy_text(hybrid, drafter):
    """Drafts verified in one pass, rejected ones rolled back through the states kept at
    each verified position: the text equals plain greedy decoding's."""
    from edgerun.generate.speculative import ModelDrafter, Speculation

    prompt = "hello world, this is the test"
    # n-grams propose only once the text repeats: the random Qwen3.5 does after ~100 tokens
    n = 150 if drafter == "ngram" else 60
    plain = "".join(hybrid.generate(prompt, max_tokens=n, draft="none", **GREEDY))
    truth = list(hybrid.generator.cache.tokens)
    if drafter == "half-right":
        d = Speculation(_HalfRightDrafter(truth, hybrid.spec.vocab_size), 5, adaptive=False)
    elif drafter == "self":  # a model drafting for itself: every draft stands
        d = Speculation(ModelDrafter(hybrid.engine), 4, adaptive=False)
    else:
        d = drafter
    spec = "".join(hybrid.generate(prompt, max_tokens=n, draft=d, **GREEDY))
    st = hybrid.generator.stats
    assert spec == plain
    assert hybrid.generator.cache.tokens == truth
    assert st.draft_tokens > 0
    if drafter == "half-right":
        assert 0 < st.accepted_tokens < st.draft_tokens
    if drafter == "self":
        assert st.accepted_tokens == st.draft_tokens


def test_large_states_cap_the_rows_of_a_verification_pass(hybrid, monkeypatch):
    """Each verification row keeps a copy of the states: where they are large, a pass
    runs at most state_cache.verify_rows rows and the text stays the plain one."""
    from edgerun.generate.speculative import ModelDrafter, Speculation
    from edgerun.model import state_cache

    prompt = "hello world, this is the test"
    plain = "".join(hybrid.generate(prompt, max_tokens=30, draft="none", **GREEDY))
    one = state_cache.StateCache.state_bytes(hybrid.spec)
    monkeypatch.setattr(state_cache, "VERIFY_STATE_BYTES", 3 * one)
    rows = []
    verify = hybrid.engine.transformer.verify
    monkeypatch.setattr(
        hybrid.engine.transformer, "verify", lambda t, c: rows.append(len(t)) or verify(t, c)
    )
    # the generator's cache was made before: it takes the cap a new one would
    cap = state_cache.verify_rows(one)
    monkeypatch.setattr(hybrid.generator.cache.state, "max_verify_rows", cap)
    d = Speculation(ModelDrafter(hybrid.engine), 6, adaptive=False)
    spec = "".join(hybrid.generate(prompt, max_tokens=30, draft=d, **GREEDY))
    assert spec == plain
    assert rows and max(rows) == 3


def test_context_limits(hybrid):
    tr = hybrid.transformer
    cache = KVCache(hybrid.spec, 8)
    tr.forward(list(range(3, 10)), cache)
    with pytest.raises(ContextOverflowError):
        tr.forward([3, 4], cache)
    before = _states(cache)
    tr.forward([5], cache)  # the last position still fits
    assert cache.length == 8 and any(
        not np.array_equal(before[k], cache.state.arrays()[k]) for k in before
    )


def test_the_ram_budget_plan_counts_the_states_and_the_mixers(lfm2):
    from edgerun.formats.gguf import read_gguf
    from edgerun.offload.plan import footprint
    from edgerun.offload.plan import plan as plan_budget

    fp = footprint(lfm2.spec, read_gguf(lfm2.path), "f32")
    assert fp.state_bytes == KVCache.state_bytes(lfm2.spec) > 0
    assert fp.kv_bytes(100) == 100 * KVCache.bytes_for(lfm2.spec, 1, "f32") + fp.state_bytes
    d = lfm2.spec.d_model
    mixer = 2 * (4 * d * d) * 34 // 32  # in_proj + out_proj of two layers, q8_0
    attention = 2 * sum(r * d for r in (64, 32, 32)) * 34 // 32 + 2 * 64 * d * 34 // 32
    assert fp.attention_bytes >= mixer + attention
    plan = plan_budget(fp, 400 << 20, 150 << 20, 100, mode="dense")
    assert plan.state_bytes == fp.state_bytes and plan.kv_bytes == fp.kv_bytes(100)
    text = plan.describe()
    assert "recurrent states, with snapshots" in text
    assert f"{fp.state_bytes / 1024:,.0f} KiB" in text


def test_sessions_sharing_a_system_prompt_copy_its_states(hybrid):
    """The scheduler keeps a system prompt's KV rows and states once (prefix_cache); a
    later session starts from them and answers as the first one did, computed whole."""
    system = "You answer in few words."
    first = hybrid.session(system=system)
    a = first.send("the theme of the day", max_tokens=10, **GREEDY)
    entries = list(hybrid.engine.prefix_cache._entries.values())
    assert entries and all(e.states is not None for e in entries)
    second = hybrid.session(system=system)
    b = second.send("the theme of the day", max_tokens=10, **GREEDY)
    assert b == a
    assert second.stats.cached_tokens == len(entries[0].tokens) > 0


def test_a_spilled_cache_keeps_its_states(hybrid, tmp_path):
    """An idle session's KV rows moved to disk and back (kv_spill): its states stay in
    memory, and the next step equals that of a cache never spilled."""
    from edgerun.serving import kv_spill

    tr, ids = hybrid.transformer, hybrid.tokenize("hello world, this is the test")
    spilled, kept = KVCache(hybrid.spec, 64), KVCache(hybrid.spec, 64)
    tr.forward(ids, spilled)
    tr.forward(ids, kept)
    assert kv_spill.spill(spilled, tmp_path) > 0
    assert kv_spill.restore(spilled) == len(ids)
    assert np.array_equal(tr.forward([5], spilled), tr.forward([5], kept))
    for k, a in _states(kept).items():
        assert np.array_equal(a, spilled.state.arrays()[k]), k


def test_layers_moved_to_a_torch_device_keep_the_recurrent_mixers(tmp_path):
    """Placing every layer on a torch device moves the attention layers' projections and
    every FFN; the short-convolution layers keep their mixers, and the logits stay."""
    pytest.importorskip("torch")
    from edgerun.gpu.place import move_layers

    path = family_gguf(tmp_path / "lfm2.gguf", "lfm2")
    m = edgerun.load(path, n_ctx=64, threads=1, interleave=False)
    try:
        ids = m.tokenize("hello world, this is the test")
        want = m.logits(ids)
        placed = move_layers(m.transformer, m.store, range(m.spec.n_layers), "cpu")
        assert sorted(placed.layers) == [0, 1, 2, 3]
        assert m.transformer.layers[0].attn_proj is None
        got = m.logits(ids)
        assert np.allclose(got, want, atol=1e-3 * np.ptp(want))
        assert (got.argmax(-1) == want.argmax(-1)).all()
    finally:
        m.close()


def _lfm2_meta(**over):
    meta = {
        "general.architecture": "lfm2",
        "lfm2.block_count": 4,
        "lfm2.embedding_length": 64,
        "lfm2.feed_forward_length": 128,
        "lfm2.attention.head_count": 4,
        "lfm2.attention.head_count_kv": [0, 2, 0, 2],
        "lfm2.attention.layer_norm_rms_epsilon": 1e-5,
        "lfm2.shortconv.l_cache": 3,
        "lfm2.vocab_size": 100,
    }
    return {**meta, **over}


def test_lfm2_metadata():
    from edgerun.arch import spec_from_gguf
    from edgerun.errors import ModelFormatError

    s = spec_from_gguf(_lfm2_meta())
    assert s.layer_mixers == ("shortconv", "attention", "shortconv", "attention")
    assert (s.n_kv_heads, s.shortconv_l_cache, s.layer_windows) == (2, 3, ())
    assert s.global_tensors["output_norm"] == "token_embd_norm.weight"
    s = spec_from_gguf(_lfm2_meta(**{"lfm2.attention.sliding_window": 8}))
    assert s.layer_windows == (0, 8, 0, 8)
    for bad in ([0, 2, 0], [0, 2, 0, 4], "x"):
        with pytest.raises(ModelFormatError, match="head_count_kv"):
            spec_from_gguf(_lfm2_meta(**{"lfm2.attention.head_count_kv": bad}), "f.gguf")
    with pytest.raises(ModelFormatError, match="l_cache"):
        spec_from_gguf(_lfm2_meta(**{"lfm2.shortconv.l_cache": 1}), "f.gguf")


def _granitehybrid_meta(**over):
    a = "granitehybrid"
    meta = {
        "general.architecture": a,
        f"{a}.block_count": 4,
        f"{a}.embedding_length": 64,
        f"{a}.feed_forward_length": 128,
        f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": [0, 2, 0, 2],
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.vocab_size": 100,
        f"{a}.ssm.conv_kernel": 4,
        f"{a}.ssm.state_size": 16,
        f"{a}.ssm.group_count": 2,
        f"{a}.ssm.time_step_rank": 8,
        f"{a}.ssm.inner_size": 128,
        f"{a}.rope.scaling.finetuned": False,
        f"{a}.expert_count": 0,
        f"{a}.expert_used_count": 0,
    }
    return {**meta, **{f"{a}.{k}": v for k, v in over.items()}}


def test_granitehybrid_metadata():
    from edgerun.arch import spec_from_gguf
    from edgerun.errors import ModelFormatError

    s = spec_from_gguf(_granitehybrid_meta())
    assert s.layer_mixers == ("mamba2", "attention", "mamba2", "attention")
    assert (s.mamba_heads, s.mamba_head_dim, s.mamba_state, s.mamba_groups) == (8, 16, 16, 2)
    assert (s.ssm_conv_kernel, s.n_kv_heads, s.n_expert) == (4, 2, 0)
    assert not any(s.rotates(i) for i in s.attention_layers)  # Granite 4.0 H: no RoPE
    assert all(spec_from_gguf(_granitehybrid_meta(**{"rope.scaling.finetuned": True}))
               .rotates(i) for i in range(4))  # fmt: skip
    # the MoE form (granite-4.0-h-tiny): the experts are feed_forward_length wide
    moe = {"expert_count": 8, "expert_used_count": 2, "feed_forward_length": 32,
           "expert_shared_feed_forward_length": 64}  # fmt: skip
    s = spec_from_gguf(_granitehybrid_meta(**moe))
    assert (s.n_expert, s.n_expert_used, s.expert_ff, s.expert_shared_ff) == (8, 2, 32, 64)
    assert s.expert_norm and s.expert_gating == "softmax"
    for over, field in (
        ({"ssm.inner_size": 100}, "inner_size"),  # not a multiple of the 8 heads
        ({"ssm.group_count": 3}, "mamba_heads"),  # 8 heads over 3 groups
        ({"ssm.group_count": 0}, "group_count"),
        ({"ssm.conv_kernel": 1}, "conv_kernel"),
        ({"ssm.state_size": 1 << 20}, "state_size"),
        ({"attention.head_count_kv": [0, 2, 0]}, "head_count_kv"),
        ({"rope.scaling.finetuned": 1}, "finetuned"),
    ):
        with pytest.raises(ModelFormatError, match=field):
            spec_from_gguf(_granitehybrid_meta(**over), "f.gguf")


@pytest.mark.parametrize(
    "key, value, tensor",
    [
        ("ssm.state_size", 8, "ssm_in"),  # B and C narrower than the file's rows
        ("ssm.time_step_rank", 4, "ssm_in"),  # fewer heads of 32: fewer dt rows
        ("ssm.inner_size", 64, "ssm_in"),
        ("ssm.conv_kernel", 3, "ssm_conv1d"),
    ],
)
def test_ssm_sizes_that_do_not_match_the_tensors_are_refused(tmp_path, key, value, tensor):
    from tiny_families import FAMILIES

    from edgerun.errors import ModelFormatError

    kind = FAMILIES["granitehybrid"]["keys"][key][0]
    path = family_gguf(tmp_path / "bad.gguf", "granitehybrid", keys={key: (kind, value)})
    with pytest.raises(ModelFormatError, match=rf"blk\.0\.{tensor}.*ssm metadata"):
        edgerun.load(path, n_ctx=64, threads=1)


@pytest.mark.parametrize(
    "name, values, message",
    [
        ("blk.0.ssm_a", [-1.0] * 7 + [np.nan], "non-finite"),  # -exp(A_log) per head
        ("blk.2.ssm_d", [1.0] * 7, "should hold 8 values"),
        ("blk.0.ssm_conv1d.bias", [0.0] * 100, "should hold 192 values"),
        ("blk.2.ssm_norm.weight", [1.0] * 64, "should hold 128 values"),
    ],
)
def test_mamba2_vectors_of_the_wrong_size_or_not_finite_are_refused(
    tmp_path, name, values, message
):
    from edgerun.errors import ModelFormatError

    vectors = {name: np.asarray(values, np.float32)}
    path = family_gguf(tmp_path / "bad.gguf", "granitehybrid", vectors=vectors)
    with pytest.raises(ModelFormatError, match=rf"{name}.*{message}"):
        edgerun.load(path, n_ctx=64, threads=1)


def test_the_scheduler_speculating_for_a_lone_request_gives_the_plain_text(hybrid):
    from edgerun.generate.sampling import SamplingParams
    from edgerun.generate.speculative import Speculation
    from edgerun.serving.batching import Serving

    ids = hybrid.tokenize("hello world, this is the test")
    out, accepted = {}, 0
    for name in ("none", "half-right"):
        serving = Serving(hybrid.engine)
        if name != "none":
            truth = ids + out["none"][1]
            drafter = _HalfRightDrafter(truth, hybrid.spec.vocab_size)
            serving.speculation = Speculation(drafter, 5, adaptive=False)
        r = serving.scheduler.submit(ids, SamplingParams(temperature=0.0), max_tokens=30)
        r.wait()
        out[name] = (r.text, list(r.cache.tokens[len(ids) :]))
        accepted = r.stats.accepted_tokens
        serving.close()
    assert out["half-right"][0] == out["none"][0]
    assert 0 < accepted


def test_a_saved_session_without_its_states_is_refused(lfm2, tmp_path):
    """A session file of a hybrid model carries its states ('state.<layer>.conv'); one
    whose states are missing or of another shape is refused, not resumed from zeros."""
    import json

    from edgerun.serving.session import Session, SessionFileError

    s = lfm2.session()
    s.send("the theme of the day", max_tokens=4, **GREEDY)
    path = s.save(tmp_path / "chat.safetensors")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert {"state.0.conv", "state.2.conv"} <= set(header)
    for change in ("drop", "shape"):
        h = dict(header)
        if change == "drop":
            del h["state.2.conv"]
        else:
            h["state.2.conv"] = {**h["state.2.conv"], "shape": [1, 2 * lfm2.spec.d_model]}
        head = json.dumps(h).encode()
        head += b" " * (-len(head) % 8)
        bad = tmp_path / f"{change}.safetensors"
        bad.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n :])
        with pytest.raises(SessionFileError, match="state"):
            Session.load(lfm2, bad)


def test_a_reset_session_answers_as_a_new_one(lfm2):
    """A session reset (its slot reused for a new conversation) starts from zero states:
    nothing of the previous conversation's states reaches the next answer."""
    s = lfm2.session()
    s.send("hello world, this is the test", max_tokens=8, **GREEDY)
    s.reset()
    assert all(not a.any() for a in s.cache.state.arrays().values())
    again = s.send("the theme of the day", max_tokens=8, **GREEDY)
    assert again == lfm2.session().send("the theme of the day", max_tokens=8, **GREEDY)
