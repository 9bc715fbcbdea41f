"""Every ``tokenizer.ggml.pre`` edgerun knows splits text as llama.cpp does.

For each name in :data:`edgerun.tokenizer.bpe.PRE_TOKENIZERS` a vocabulary-only GGUF is
written with that name and without ``tokenizer.ggml.add_bos_token`` (so each name's BOS
default shows too) and edgerun's ids must equal llama.cpp's for that file (``vocab_only``).
Every name is checked on strings that tell the splits apart, with a vocabulary made here whose
merges rebuild any piece of those strings (so the ids show where the text was split, which a
real vocabulary's merges, made after its own split, mostly hide); one name of each kind also on
the whole tricky-string corpus with SmolLM2's real vocabulary (and, slow, Qwen2.5's).

llama.cpp's ids come from tests/data/pre_tokenizer_ids.json (recorded by
tests/data/make_pre_tokenizer_ids.py), so these tests run where llama-cpp-python is not
installed; where it is, each is also checked against llama.cpp live, which shows when the
recording has drifted from the installed llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pre_tokenizer_cases import (
    CHAIN_VOCAB,
    GROUPS,
    LLAMA_CPP_NAME,
    PROBES,
    REGENERATE,
    golden_ids,
    inputs_digest,
    kind_representatives,
    llama_cpp_ids,
    load_goldens,
    write_vocab_gguf,
)
from tricky_strings import TRICKY_STRINGS

from edgerun import registry
from edgerun.errors import UnsupportedError
from edgerun.formats.gguf import read_gguf
from edgerun.tokenizer import tokenizer_from_gguf_metadata
from edgerun.tokenizer.bpe import PRE_TOKENIZERS

try:
    import llama_cpp
except ImportError:  # a reference, never a dependency: the recorded ids stand in for it
    llama_cpp = None

REPRESENTATIVES = kind_representatives()
GOLDENS = load_goldens()


def _registry_path(name: str) -> Path | None:
    try:
        p = Path(registry.resolve_path(registry.find(name)))
    except Exception:  # not installed here
        return None
    return p if p.exists() else None


@pytest.fixture(scope="module")
def smollm_vocab(smollm2_path) -> dict:
    return dict(read_gguf(smollm2_path).metadata)


def _recorded(group: str, meta: dict, pre: str) -> list:
    """llama.cpp's recorded ids for ``pre`` in ``group``; fails, naming the command that
    records them, when they are missing or were recorded for other inputs."""
    strings, specials = GROUPS[group]
    body = GOLDENS.get(group)
    assert body is not None, f"no recorded ids for {group!r}; run {REGENERATE}"
    assert body["digest"] == inputs_digest(meta, strings, specials), (
        f"the {group!r} inputs (vocabulary, strings or settings) changed since the ids were "
        f"recorded; run {REGENERATE}"
    )
    ids = golden_ids(group, GOLDENS)
    assert pre in ids, f"no recorded ids for {pre!r} in {group!r}; run {REGENERATE}"
    return ids[pre]


def _compare(group: str, path: Path, pre: str, meta: dict) -> list:
    """(string, parse_special, llama.cpp's ids, ours) for every string where edgerun's ids
    differ from llama.cpp's recorded ones, and from llama.cpp live where it is installed;
    BOS as each side's model default (llama.cpp's add_special, our add_bos=None)."""
    strings, specials = GROUPS[group]
    want = _recorded(group, meta, pre)
    if llama_cpp is not None:
        live = llama_cpp_ids(llama_cpp, path, strings, specials)
        drift = [
            (s, specials[k], want[i][k][:24], live[i][k][:24])
            for i, s in enumerate(strings)
            for k in range(len(specials))
            if want[i][k] != live[i][k]
        ]
        assert not drift, (
            f"llama.cpp {llama_cpp.__version__} gives other ids than the ones recorded with "
            f"{GOLDENS['llama_cpp_version']} for {pre!r} in {group!r}; check the change, then "
            f"run {REGENERATE}: {drift[:2]}"
        )
    ours = tokenizer_from_gguf_metadata(read_gguf(path).metadata)
    bad = []
    for i, s in enumerate(strings):
        for k, special in enumerate(specials):
            got = ours.encode(s, parse_special=special)
            if want[i][k] != got:
                bad.append((s, special, want[i][k][:24], got[:24]))
    return bad


def test_recorded_ids_cover_every_pre_tokenizer():
    """A name added to PRE_TOKENIZERS needs llama.cpp's ids recorded for it."""
    missing = sorted(set(PRE_TOKENIZERS) - set(golden_ids("chain", GOLDENS)))
    assert not missing, f"no recorded llama.cpp ids for {missing}; run {REGENERATE}"
    missing = sorted(REPRESENTATIVES - set(golden_ids("smollm2", GOLDENS)))
    assert not missing, f"no recorded SmolLM2 ids for {missing}; run {REGENERATE}"


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_matches_llama_cpp(pre, tmp_path):
    """Each name on the probes, with the chain vocabulary (control tokens parsed and not)."""
    path = write_vocab_gguf(tmp_path / "v.gguf", CHAIN_VOCAB, LLAMA_CPP_NAME.get(pre, pre))
    bad = _compare("chain", path, pre, CHAIN_VOCAB)
    assert not bad, bad[:3]
    if pre in LLAMA_CPP_NAME:  # our alias gives the same ids as llama.cpp's name
        ours = tokenizer_from_gguf_metadata(dict(CHAIN_VOCAB, **{"tokenizer.ggml.pre": pre}))
        ref = tokenizer_from_gguf_metadata(read_gguf(path).metadata)
        for s in PROBES + TRICKY_STRINGS:
            assert ours.encode(s) == ref.encode(s), repr(s)


@pytest.mark.parametrize("pre", sorted(REPRESENTATIVES))
def test_each_kind_matches_llama_cpp_on_corpus(pre, smollm_vocab, tmp_path):
    """One name per kind, SmolLM2's vocabulary, the whole corpus."""
    path = write_vocab_gguf(tmp_path / "v.gguf", smollm_vocab, LLAMA_CPP_NAME.get(pre, pre))
    bad = _compare("smollm2", path, pre, smollm_vocab)
    assert not bad, bad[:3]


def test_probes_tell_every_kind_apart():
    """With the chain vocabulary no two kinds give the same ids on all probes (with the same
    BOS default), so the per-name test checks which kind each name maps to."""
    seen: dict[tuple, str] = {}
    for pre in sorted(REPRESENTATIVES):
        t = tokenizer_from_gguf_metadata(dict(CHAIN_VOCAB, **{"tokenizer.ggml.pre": pre}))
        key = (t.add_bos, *(tuple(t.encode(s, add_bos=False)) for s in PROBES))
        assert key not in seen, f"{pre!r} splits the probes as {seen.get(key)!r} does"
        seen[key] = pre


@pytest.mark.slow
def test_pre_tokenizers_on_qwen_vocabulary(tmp_path):
    """One name per kind on Qwen2.5's 151k vocabulary (more multi-byte merges: CJK, code).
    Control-token strings as text only (see pre_tokenizer_cases.GROUPS)."""
    qwen = _registry_path("qwen2.5-coder-0.5b")
    if qwen is None:
        pytest.skip("qwen2.5-coder-0.5b not installed (python -m edgerun pull qwen2.5-coder-0.5b)")
    vocab = dict(read_gguf(qwen).metadata)
    for pre in sorted(REPRESENTATIVES):
        path = write_vocab_gguf(tmp_path / f"{pre}.gguf", vocab, LLAMA_CPP_NAME.get(pre, pre))
        bad = _compare("qwen2.5-coder-0.5b", path, pre, vocab)
        assert not bad, (pre, bad[:3])


def test_unknown_pre_tokenizer_names_file_field_and_choices(smollm_vocab, tmp_path):
    path = write_vocab_gguf(tmp_path / "odd.gguf", smollm_vocab, "no-such-split")
    with pytest.raises(UnsupportedError) as e:
        tokenizer_from_gguf_metadata(read_gguf(path).metadata)
    msg = str(e.value)
    assert msg.startswith(f"{path}:"), msg
    assert "'tokenizer.ggml.pre'" in msg and "'no-such-split'" in msg
    for name in PRE_TOKENIZERS:
        assert name in msg
