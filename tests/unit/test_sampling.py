import numpy as np
import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.generate.engine import StopMatcher
from edgerun.generate.sampling import Sampler, SamplingParams, apply_repeat_penalty


def _logits(vocab=50, seed=0):
    return np.random.default_rng(seed).standard_normal(vocab).astype(np.float32) * 3


def test_greedy_is_argmax():
    lg = _logits()
    assert Sampler(SamplingParams(temperature=0))(lg) == int(np.argmax(lg))


def test_same_seed_same_sequence_and_different_seed_differs():
    lg = _logits()
    p = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = [Sampler(SamplingParams(**p, seed=7))(lg) for _ in range(1)]
    s1, s2, s3 = (Sampler(SamplingParams(**p, seed=s)) for s in (7, 7, 8))
    seq1 = [s1(lg) for _ in range(40)]
    seq2 = [s2(lg) for _ in range(40)]
    seq3 = [s3(lg) for _ in range(40)]
    assert seq1 == seq2 and seq1[0] == a[0]
    assert seq1 != seq3


def test_top_k_restricts_support():
    lg = _logits()
    top3 = set(np.argsort(-lg)[:3].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=1))
    assert {s(lg) for _ in range(300)} <= top3


def test_top_p_and_min_p_restrict_support():
    lg = np.array([5.0, 4.0, 0.0, -1.0, -2.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=1))
    assert {s(lg) for _ in range(200)} == {0}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=1))
    assert {s(lg) for _ in range(500)} == {0, 1}


def test_repeat_penalty():
    lg = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repeat_penalty(lg, [0, 1], 2.0, 64)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=3.0))(lg, [0]) == 2


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(min_p=1.0),
        dict(top_k=-2),
        dict(repeat_penalty=0),
    ],
)
def test_bad_params_are_clear_errors(kw):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kw)


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>"])
    assert m.feed("hello <") == "hello "
    assert m.feed("/e") == ""
    assert m.feed("x") == "</ex"
    assert m.feed(" ok</en") == " ok"
    assert m.feed("d> tail") == ""
    assert m.hit


def test_stop_matcher_without_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


class _Bytes:
    """A tokenizer stand-in: token i is the i-th entry of `pieces`."""

    special_ids: frozenset = frozenset()

    def __init__(self, pieces):
        self.pieces = pieces

    def token_bytes(self, i):
        return self.pieces[i]


def _one_hot(i, vocab=8):
    lg = np.full(vocab, -10.0, np.float32)
    lg[i] = 10.0
    return lg


def _run(seq, tokens):
    """Feed greedy logits for `tokens` until the sequence ends; the text it showed."""
    out = []
    for t in tokens:
        out.append(seq.step(_one_hot(t)))
        if seq.done:
            break
    seq.end("length")
    return "".join(out) + seq.tail()


def test_sequence_ends_on_eos_stop_string_and_length():
    from edgerun.generate.sequence import Sequence

    tok = _Bytes([b"a", b"b", b"</", b"s>", b"\xc3", b"\xa9", b"", b"!"])
    greedy = SamplingParams(temperature=0.0)
    eos = Sequence(tok, greedy, [0], max_tokens=10, eos_ids=[6])
    assert _run(eos, [0, 1, 6, 0]) == "ab" and eos.finish_reason == "stop"
    assert eos.stats.generated_tokens == 2 and eos.history == [0, 0, 1]
    stop = Sequence(tok, greedy, [0], max_tokens=10, stop=["</s>"])
    # "</" is held back until it could no longer start the stop string
    assert stop.step(_one_hot(0)) == "a" and stop.step(_one_hot(2)) == ""
    assert _run(stop, [3, 0]) == "" and stop.finish_reason == "stop"
    assert "".join(stop.matcher.stops) == "</s>" and stop.stats.generated_tokens == 3
    length = Sequence(tok, greedy, [], max_tokens=3)
    # a character split over two tokens comes out whole; the held "</" at the end
    assert _run(length, [4, 5, 2, 7]) == "é</" and length.finish_reason == "length"
    assert length.stats.finish_reason == "length" and length.stats.ttft_seconds > 0
    cut = Sequence(tok, greedy, [], max_tokens=9)
    cut.step(_one_hot(0))
    cut.end("cancelled")
    cut.end("length")  # the first reason stays
    assert cut.finish_reason == cut.stats.finish_reason == "cancelled"


def test_one_stats_class_for_every_driver():
    import edgerun
    from edgerun.generate.sequence import GenerationStats
    from edgerun.serving.batching import ResponseStats

    assert ResponseStats is GenerationStats is edgerun.GenerationStats
    st = GenerationStats(prompt_tokens=5, generated_tokens=3)
    assert st.total_tokens == 8 and st.ttft_seconds == 0.0 and st.batch_sizes == []
