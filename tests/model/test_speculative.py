"""Speculative decoding (generate/speculative.py): the verification pass's rows equal
one-token steps bit for bit, and decoding with drafts gives the text decoding without
them gives, token for token, greedy and seeded, ending where it ends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.errors import UnsupportedError
from edgerun.generate.engine import Generator, verify_bytes_per_row, verify_rows_within
from edgerun.generate.sampling import SamplingParams
from edgerun.generate.speculative import DraftLength, ModelDrafter, NgramDrafter, Speculation
from edgerun.model.kvcache import KVCache
from edgerun.offload.plan import STEP_MARGIN_BYTES, Plan

FAMILIES = Path(__file__).resolve().parent.parent / "data" / "families"

CODE = """def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    total = subtotal + tax
    return total
"""
STORY = "Once upon a time, in a small village by the sea,"  # SmolLM2 goes on past 48 tokens
# SmolLM2 copies this list back, so its n-gram drafts are accepted
EDIT = "Here is a list: apple, banana, cherry, grape, lemon, mango, orange, peach. Repeat it:"


def _run(model, prompt, draft, **kw):
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0.0)
    text = "".join(model.generate(prompt, draft=draft, **kw))
    return text, model.stats


@pytest.fixture(scope="module")
def offloaded(smollm2_path):
    return edgerun.load(smollm2_path, n_ctx=256, threads=2, offload="dense")


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("which", ["resident", "offloaded"])
def test_verification_rows_equal_one_token_steps(request, which, kv_type):
    model = request.getfixturevalue("smollm2" if which == "resident" else which)
    tr = model.transformer
    ids = model.tokenize(CODE)[:20]
    one, many = (KVCache(tr.spec, 64, kv_type) for _ in range(2))
    tr.forward(ids[:12], one)
    tr.forward(ids[:12], many)
    rest = ids[12:]
    single = np.stack([tr.forward([t], one) for t in rest])
    rows = tr.verify(rest, many)
    assert rows.shape == single.shape
    assert np.array_equal(rows, single)
    assert many.tokens == one.tokens
    n = len(ids)
    assert np.array_equal(many.k[:, :, :n], one.k[:, :, :n])
    assert np.array_equal(many.v[:, :, :n], one.v[:, :, :n])


def test_ngram_drafts_are_accepted_and_change_nothing(smollm2):
    plain, st0 = _run(smollm2, EDIT, "none")
    assert st0.decode_passes == 0
    spec, st = _run(smollm2, EDIT, "ngram")
    assert spec == plain
    assert st.generated_tokens == st0.generated_tokens
    assert st.accepted_tokens > 0 and st.tokens_per_pass > 1.0
    assert st.decode_passes < st.generated_tokens
    assert "tokens/pass" in st.draft_summary()


@pytest.fixture(scope="module")
def itself(smollm2):
    """SmolLM2 drafting for itself, 4 tokens every pass (greedy: every draft stands)."""
    return Speculation(ModelDrafter(smollm2.engine), 4, adaptive=False)


def test_a_model_drafting_for_itself_is_always_accepted_greedy(smollm2, itself):
    kw = dict(max_tokens=40, repeat_penalty=1.0)  # the draft's argmax is the target's
    plain, _ = _run(smollm2, STORY, "none", **kw)
    spec, st = _run(smollm2, STORY, itself, **kw)
    assert spec == plain
    assert st.draft_tokens > 0 and st.accepted_tokens == st.draft_tokens


@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_seeded_sampling_gives_the_same_text(smollm2, itself, draft):
    d = itself if draft == "self" else draft
    accepted = 0
    for seed in range(6):
        kw = dict(temperature=0.9, seed=seed, max_tokens=24)
        plain, _ = _run(smollm2, EDIT, "none", **kw)
        spec, st = _run(smollm2, EDIT, d, **kw)
        assert spec == plain, seed
        accepted += st.accepted_tokens
    assert accepted > 0  # some drafts stood, so the accept rule ran


def test_sampled_first_tokens_keep_the_targets_distribution(smollm2, itself):
    """Identity per seed is the strong form; this checks the distribution directly: the
    first two sampled tokens of many seeded runs with a self-draft (whose second token
    comes from a verification row) against plain runs' counts."""
    kw = dict(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0, max_tokens=2)
    counts: dict[str, dict[tuple, int]] = {"none": {}, "self": {}}
    for draft in counts:
        d = itself if draft == "self" else draft
        for seed in range(40):
            ids = []
            for _ in smollm2.generate("Once upon a time", seed=seed, draft=d, **kw):
                pass
            ids = tuple(smollm2.generator.cache.tokens[-1:])
            counts[draft][ids] = counts[draft].get(ids, 0) + 1
    assert counts["none"] == counts["self"]


def test_rejections_roll_the_cache_back_to_a_plain_runs(smollm2):
    prompt = EDIT
    plain, _ = _run(smollm2, prompt, "none", max_tokens=40)
    cache = smollm2.generator.cache
    tokens, n = list(cache.tokens), cache.length
    k, v = cache.k[:, :, :n].copy(), cache.v[:, :, :n].copy()
    spec, st = _run(smollm2, prompt, "ngram", max_tokens=40)
    assert spec == plain
    assert st.draft_tokens > st.accepted_tokens  # some drafts were rejected
    assert cache.tokens == tokens
    assert np.array_equal(cache.k[:, :, :n], k) and np.array_equal(cache.v[:, :, :n], v)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_inside_accepted_drafts(smollm2, itself, max_tokens):
    plain, st0 = _run(smollm2, STORY, "none", max_tokens=max_tokens)
    spec, st = _run(smollm2, STORY, itself, max_tokens=max_tokens)
    assert (spec, st.generated_tokens, st.finish_reason) == (
        plain,
        st0.generated_tokens,
        st0.finish_reason,
    )


def test_stop_string_and_eos_inside_accepted_drafts(smollm2, itself):
    plain, _ = _run(smollm2, STORY, "none", max_tokens=40)
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    want, st0 = _run(smollm2, STORY, "none", max_tokens=40, stop=[stop])
    got, st = _run(smollm2, STORY, itself, max_tokens=40, stop=[stop])
    assert st0.finish_reason == "stop" and (got, st.finish_reason) == (want, "stop")
    assert st.generated_tokens == st0.generated_tokens
    msgs = [{"role": "user", "content": "Say hello."}]
    want = smollm2.chat(msgs, max_tokens=64, temperature=0.0, draft="none")
    st0 = smollm2.stats
    got = smollm2.chat(msgs, max_tokens=64, temperature=0.0, draft=itself)
    assert st0.finish_reason == "stop"  # the EOS
    assert (got, smollm2.stats.finish_reason) == (want, "stop")
    assert smollm2.stats.generated_tokens == st0.generated_tokens


def test_a_full_context_window_ends_where_plain_decoding_ends(smollm2):
    engine = smollm2.engine
    ids = smollm2.tokenize(EDIT)
    params = SamplingParams(temperature=0.0)
    out = {}
    for name, spec in (("none", None), ("ngram", Speculation(NgramDrafter()))):
        gen = Generator(engine)
        gen.cache = KVCache(engine.spec, len(ids) + 9, engine.kv_type)
        gen.speculation = spec
        text = "".join(gen.stream(ids, params, max_tokens=100))
        out[name] = (text, gen.stats.generated_tokens, gen.stats.finish_reason)
    assert out["ngram"] == out["none"]
    assert out["none"][2] == "length" and out["none"][1] == 10


def test_a_draft_model_of_another_vocabulary_is_refused(smollm2):
    tiny = FAMILIES / "qwen2" / "q8_0.gguf"
    with pytest.raises(UnsupportedError, match=r"q8_0\.gguf .*SmolLM2.*49152 vs 384"):
        smollm2.speculation(str(tiny))


def test_a_draft_model_of_the_same_vocabulary_with_rejections():
    """The ModelDrafter's mechanics on a tiny family model: its q8_0 copy drafts for its
    f32 original (same vocabulary, other numbers: some drafts are rejected)."""
    target = edgerun.load(FAMILIES / "llama" / "f32.gguf", n_ctx=128, threads=2)
    target.set_draft(str(FAMILIES / "llama" / "q8_0.gguf"), 4)
    assert isinstance(target.draft.drafter, ModelDrafter)
    for seed in (None, 3):
        kw = dict(max_tokens=40, temperature=0.0 if seed is None else 0.9, seed=seed)
        plain, _ = _run(target, "the theory then", "none", **kw)
        spec, st = _run(target, "the theory then", None, **kw)
        assert spec == plain
        assert st.draft_tokens > 0 and st.decode_passes > 0


def test_ngram_drafter_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    h = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # [1, 2, 3] occurred at 0..2 (then 4, 5); [2, 3] later at 6..7 (then 7): longest wins
    assert d.propose(h, 3) == [4, 5, 9]
    assert d.propose(h + [4], 2) == [5, 9]
    assert d.propose([5, 6, 7, 8], 4) == []  # nothing repeats (a new text: rebuilt)
    assert d.propose([5, 6, 7, 5, 6], 4) == [7, 5, 6]
    assert d.propose([5, 6, 7, 5, 6], 0) == []


def test_ngram_drafter_reports_its_match_length_and_takes_one_token_matches():
    d = NgramDrafter()
    h = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(h, 2) == [4, 5] and d.match_length == 3
    assert d.propose([7, 8, 9, 8], 3) == [9, 8] and d.match_length == 1
    assert d.propose([1, 2, 3], 2) == [] and d.match_length == 0


def test_an_ngram_draft_length_follows_its_match_length():
    """A long match is a copy in progress, a one-token match often a coincidence: each
    match length keeps its own acceptance, so one does not shorten the other's drafts."""
    length = DraftLength(16, row_cost=0.12)
    assert length.next(match=12) > length.next(match=1) >= 1  # the priors
    assert length.next(match=0) == 0  # nothing matched: nothing to draft
    for _ in range(30):
        length.update(8, 0, match=2)
    assert length.best(match=2) == 0
    assert length.best(match=12) >= 8
    for _ in range(30):
        length.update(16, 16, match=1)
    assert length.best(match=1) == 16
    assert length.acceptance == length.prior  # a model draft's acceptance is apart


def test_draft_length_backs_off_and_grows():
    length = DraftLength(8, row_cost=0.3, probe=4)
    for _ in range(30):
        length.update(4, 0)
    assert length.best() == 0
    assert [length.next() for _ in range(8)].count(1) == 2  # probes only
    for _ in range(30):
        length.update(8, 8)
    assert length.best() == 8


def test_long_drafts_are_priced_by_what_their_passes_measured():
    """The batched kernels' cost per row grows with the rows: a length is priced by the
    measured cost of a pass of that many rows, not by a line through short passes."""
    length = DraftLength(16, row_cost=0.05)
    length.by_match[8] = 0.96
    length.timed(1, 1.0, 0.0, 0)
    assert length.best(match=12) == 16  # a line of 0.05 a row: 17 rows cost 1.8
    for rows, cost in ((2, 1.05), (9, 2.0), (17, 6.5)):
        for _ in range(30):
            length.timed(rows, cost, 0.0, 0)
    assert abs(length.pass_cost[17] - 6.5) < 0.01
    assert length.best(match=12) < 16


def test_a_probe_after_idle_passes_prices_a_draft_step_not_its_catch_up():
    """A draft model that sat out a few passes catches up on their tokens before it
    drafts one: its cost is the time per forward step, so a good draft keeps drafting."""
    length = DraftLength(4, draft_cost=0.4, row_cost=0.1)
    for _ in range(20):
        length.update(8, 7)  # acceptance ~0.87
    length.timed(1, 1.0, 0.0, 0)  # a one-token pass: the unit
    for _ in range(20):  # a probe: 9 steps (8 tokens behind, then the draft) for 1 token
        length.timed(2, 1.1, 9 * 0.45, 1, draft_steps=9)
    assert abs(length.draft_cost - 0.45) < 0.01 and abs(length.row_cost - 0.1) < 0.01
    assert length.best() >= 1  # it drafts
    per_token = DraftLength(4, draft_cost=0.4, row_cost=0.1)
    for _ in range(20):
        per_token.update(8, 7)
    per_token.timed(1, 1.0, 0.0, 0)
    for _ in range(20):  # the same time counted per drafted token prices it out
        per_token.timed(2, 1.1, 9 * 0.45, 1)
    assert per_token.best() == 0


def test_the_scheduler_drafts_for_a_lone_request_and_batches_several(smollm2):
    from edgerun.serving.batching import Serving

    params = SamplingParams(temperature=0.0)
    prompts = [smollm2.tokenize(EDIT), smollm2.tokenize(STORY)]
    out, stats = {}, {}
    for name, spec in (("none", None), ("ngram", Speculation(NgramDrafter()))):
        serving = Serving(smollm2.engine)
        serving.speculation = spec
        lone = serving.scheduler.submit(prompts[0], params, max_tokens=48)
        lone.wait()
        pair = [serving.scheduler.submit(ids, params, max_tokens=24) for ids in prompts]
        for r in pair:
            r.wait()
        out[name] = [(r.text, r.stats.finish_reason) for r in (lone, *pair)]
        stats[name] = (lone.stats, pair[0].stats)
        serving.close()
    assert out["ngram"] == out["none"]
    lone, batched = stats["ngram"]
    assert lone.accepted_tokens > 0 and lone.tokens_per_pass > 1.0
    assert 2 in batched.batch_sizes  # decoded together while both ran


def test_under_a_ram_budget_the_draft_model_comes_out_of_the_budget(smollm2_path):
    """A draft model is resident beside an offloaded target: load counts its bytes (file
    pages and KV cache) and plans the target for what is left; a draft that leaves too
    little is refused naming it."""
    from edgerun.api import minimum_ram_budget
    from edgerun.errors import BudgetError

    draft = edgerun.load(smollm2_path, n_ctx=256, threads=2, kv_type="f16")
    need = draft.memory_bytes()
    floor = minimum_ram_budget(smollm2_path, n_ctx=256)
    budget = need + floor + (64 << 20)
    m = edgerun.load(smollm2_path, n_ctx=256, threads=2, ram_budget=budget, draft_model=draft)
    try:
        assert m.loader.plan.budget == budget - need
        assert isinstance(m.draft.drafter, ModelDrafter)
        # the verification rows fit the step margin beside the draft's own step
        rows = verify_rows_within(m.spec, STEP_MARGIN_BYTES - verify_bytes_per_row(draft.spec))
        assert m.draft.length.max_tokens == min(5, rows - 1)
        prompt = "Repeat: the cat sat on the mat. The cat sat on the mat."
        with_draft = "".join(m.generate(prompt, max_tokens=24, temperature=0.0))
        assert m.stats.draft_tokens > 0
        plain = "".join(m.generate(prompt, max_tokens=24, temperature=0.0, draft="none"))
        assert with_draft == plain
    finally:
        m.close()
    with pytest.raises(BudgetError, match="draft model"):
        edgerun.load(smollm2_path, n_ctx=256, ram_budget=need - (1 << 20), draft_model=draft)
    with pytest.raises(BudgetError, match="after the draft model"):
        edgerun.load(smollm2_path, n_ctx=256, ram_budget=need + floor // 2, draft_model=draft)
    draft.close()


def test_a_streamed_model_s_drafts_start_from_its_plan_s_prices(offloaded, smollm2):
    """Before any pass ran, a streaming plan prices the verification passes and a
    resident draft's step: DraftLength starts from them, not from the resident line."""
    length, plan = offloaded.speculation(smollm2, 12).length, offloaded.loader.plan
    assert plan.mode == "dense"
    predicted = plan.pass_costs(length.max_tokens + 1, length.row_cost)
    assert length.pass_cost == predicted and len(predicted) == length.max_tokens == 12
    one = plan.pass_seconds(1, length.row_cost)
    figures = offloaded.loader.device_figures()
    assert length.draft_cost == pytest.approx(
        figures.cpu_seconds((("", smollm2.loader.model_bytes),)) / one
    )


def _plan(mode: str, split: dict[str, float], active: float = 1.0) -> Plan:
    return Plan(
        mode=mode, budget=1, floor=0, kv_bytes=0, resident_bytes=0, gate_resident=True,
        predictor_bytes=0, scratch_bytes=0, cache_neurons=0, cache_bytes=0, flash_bytes=0,
        read_bytes_per_token=0.0, predicted_tok_s=1.0, active_fraction=active,
        time_split=split,
    )  # fmt: skip


def test_a_plan_prices_verification_passes_by_where_the_weights_are():
    """Streamed rows are read once for all of a pass's rows beside the compute (dense),
    a sparse pass reads the union of its rows' neurons, a MoE pass each row's experts."""
    dense = _plan("dense", {"cpu": 0.04, "flash": 0.1, "layers": 0.01})
    assert dense.pass_seconds(1, 0.25) == pytest.approx(0.15)
    assert dense.pass_seconds(9, 0.25) == pytest.approx(0.15)  # 0.12 s of compute hides
    assert dense.pass_seconds(17, 0.25) == pytest.approx(0.04 * 5 + 0.01)
    hidden = _plan("dense", {"cpu": 0.1, "flash": 0.0, "layers": 0.01})
    assert hidden.pass_seconds(5, 0.25) == pytest.approx(0.2 + 0.01)
    sparse = _plan("sparse", {"cpu": 0.0, "flash": 0.1, "layers": 0.0}, active=0.5)
    assert sparse.pass_seconds(2, 0.25) == pytest.approx(0.1 * 0.75 / 0.5)
    experts = _plan("experts", {"cpu": 0.0, "flash": 0.1, "layers": 0.0})
    assert experts.pass_seconds(4, 0.25) == pytest.approx(0.4)
    costs = dense.pass_costs(17, 0.25)
    assert sorted(costs) == list(range(2, 18)) and costs[9] == pytest.approx(1.0)
    with pytest.raises(edgerun.errors.InvalidArgumentError):
        dense.pass_seconds(0, 0.25)


def test_predicted_pass_costs_set_the_first_drafts_until_measured():
    """A plan's prices make long drafts pay from the first pass where extra rows are
    nearly free; the first measured pass of a row count replaces its prediction."""
    spec = Speculation(NgramDrafter(), 16)
    assert spec.length.best_for(0.8) < 8  # the line of 0.25 a row
    spec.fit(9, {r: 1.0 + 0.01 * r for r in range(2, 10)})
    assert spec.length.max_tokens == 8
    assert spec.length.best_for(0.8) == 8
    spec.length.timed(1, 1.0, 0.0, 0)
    spec.length.timed(9, 3.0, 0.0, 8)
    assert spec.length.pass_cost[9] == pytest.approx(3.0)  # replaced, not averaged
    spec.length.timed(9, 2.0, 0.0, 8)
    assert spec.length.pass_cost[9] == pytest.approx(2.8)  # measured ones average
    assert spec.length.speedup(0, 0.8) == 1.0
    with pytest.raises(edgerun.errors.InvalidArgumentError):
        spec.fit(0)


def test_verification_rows_within_a_margin_count_every_row_s_logits(smollm2):
    per_row = verify_bytes_per_row(smollm2.spec)
    assert per_row > 4 * smollm2.spec.vocab_size
    assert verify_rows_within(smollm2.spec, 10 * per_row + 1) == 10
    assert verify_rows_within(smollm2.spec, 0) == 1
