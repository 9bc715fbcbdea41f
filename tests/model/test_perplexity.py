"""Perplexity: exact math on a fake model, consistency with Model.logits on the real one,
and the `edgerun perplexity` / `edgerun convert` commands."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from edgerun.arch.spec import ModelSpec
from edgerun.errors import InvalidArgumentError
from edgerun.tools.perplexity import calibration_text, evaluation_text, perplexity


class _Tok:
    add_bos = True
    bos_id = 0

    def encode(self, text, add_bos=None, parse_special=True):
        return [1 + (ord(c) % 7) for c in text]


class _FakeTransformer:
    """Logits: uniform over 8 tokens, except a fixed preference for token 3."""

    def __init__(self, boost: float) -> None:
        self.boost = boost
        self.seen: list[list[int]] = []

    def new_cache(self, n_ctx: int, kv_type: str = "f32") -> SimpleNamespace:
        return SimpleNamespace(tokens=[], n_ctx=n_ctx, kv_type=kv_type)

    def forward(self, ids, cache, all_logits=False):
        self.seen.append(list(ids))
        cache.tokens.extend(ids)
        lg = np.zeros((len(ids), 8), np.float32)
        lg[:, 3] = self.boost
        return lg


def _fake(boost: float = 0.0):
    spec = ModelSpec(
        arch="fake", name="fake", n_layers=1, d_model=1, d_ff=1, n_heads=1, n_kv_heads=1,
        head_dim=1, vocab_size=8, context_length=64, norm_eps=1e-6, rope_base=1e4, rope_dim=0,
    )  # fmt: skip
    return SimpleNamespace(
        spec=spec, tokenizer=_Tok(), transformer=_FakeTransformer(boost), threads=1
    )


def test_uniform_model_has_vocab_perplexity():
    m = _fake()
    res = perplexity(m, "abcdefgh" * 20, n_ctx=16, batch=5)
    assert res.n_chunks == 160 // 16
    assert res.n_scored == res.n_chunks * (16 - 1 - 8)
    assert res.ppl == pytest.approx(8.0, rel=1e-6)
    assert res.stderr == pytest.approx(0.0, abs=1e-9)
    # every chunk starts with BOS (replacing its first token) and is fed in batches of 5
    assert all(s[0] == 0 for s in m.transformer.seen[:: math.ceil(16 / 5)])
    assert "PPL = 8.0000" in str(res)


def test_known_nll_and_stderr():
    boost = 2.0
    m = _fake(boost)
    text = "abcdefgh" * 8
    res = perplexity(m, text, n_ctx=32)
    toks = _Tok().encode(text)
    z = 7 + math.exp(boost)
    nll = []
    for c in range(len(toks) // 32):
        ids = toks[c * 32 : (c + 1) * 32]
        for p in range(16, 31):
            nll.append(-(boost - math.log(z)) if ids[p + 1] == 3 else math.log(z))
    nll = np.array(nll)
    assert res.nll == pytest.approx(nll.mean(), rel=1e-6)
    assert res.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    se = nll.std(ddof=1) / math.sqrt(len(nll))
    assert res.stderr == pytest.approx(res.ppl * se, rel=1e-5)


def test_errors_and_texts():
    with pytest.raises(InvalidArgumentError, match="fewer than one chunk"):
        perplexity(_fake(), "abc", n_ctx=16)
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        perplexity(_fake(), "abc" * 100, n_ctx=128)
    ev, cal = evaluation_text(), calibration_text()
    assert len(ev) > 100_000 and cal and ev.endswith(cal)
    assert ev[:20000] not in cal  # the evaluated head is not calibration data


def test_real_model_matches_logits(smollm2):
    """perplexity() scores exactly what Model.logits gives for each chunk."""
    text = evaluation_text()[:2000]
    res = perplexity(smollm2, text, n_ctx=64, limit_tokens=128)
    toks = smollm2.tokenizer.encode(text, add_bos=False, parse_special=False)[:128]
    nll = []
    for c in range(2):
        ids = toks[c * 64 : (c + 1) * 64]
        ids[0] = smollm2.tokenizer.bos_id if smollm2.tokenizer.add_bos else ids[0]
        lg = smollm2.logits(ids).astype(np.float64)
        for p in range(32, 63):
            row = lg[p]
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[ids[p + 1]])
    assert res.n_scored == 62
    assert res.nll == pytest.approx(float(np.mean(nll)), rel=1e-4)
    assert 2 < res.ppl < 100


def test_cli_convert_and_perplexity(tmp_path, smollm2_path, capsys):
    from edgerun.cli import main

    out = tmp_path / "pack"
    assert main(["convert", str(smollm2_path), "-o", str(out), "--quant", "keep"]) == 0
    assert "wrote" in capsys.readouterr().out
    rc = main(["perplexity", "-m", str(out), "-c", "64", "--limit-tokens", "128", "-t", "2"])
    assert rc == 0
    assert "PPL = " in capsys.readouterr().out
    # user errors are one line, no traceback
    assert main(["convert", str(smollm2_path), "-o", str(tmp_path / "x"), "--quant", "q7"]) == 1
    assert "unknown quantization" in capsys.readouterr().err
    assert main(["perplexity", "-m", str(out), "-c", "2"]) == 1


@pytest.mark.slow
def test_imatrix_beats_rtn_at_3_and_2_bits(tmp_path, smollm2_path):
    """On SmolLM2 (from its Q4_1 weights), importance-weighted 3- and 2-bit quantization
    has a lower perplexity than plain round-to-nearest (short run: 512 tokens)."""
    import contextlib
    import io

    import edgerun
    from edgerun.quant.formats import QuantType
    from edgerun.tools.convert import GGUFSource, _calibrate, convert

    if not hasattr(QuantType, "Q3_G64"):
        pytest.skip("low-bit formats not registered in QuantType")
    src = GGUFSource(smollm2_path)
    imat = _calibrate(src, 512, 256, progress=False)
    ppl = {}
    for recipe in ("q3_g64", "q2_g64"):
        for method in ("rtn", "imatrix"):
            out = tmp_path / f"{recipe}-{method}"
            with contextlib.redirect_stderr(io.StringIO()):
                convert(
                    smollm2_path,
                    out,
                    recipe,
                    imatrix=imat if method == "imatrix" else None,
                    method="rtn" if method == "rtn" else "search",
                    progress=False,
                    source=src,
                )
            m = edgerun.load(out, n_ctx=256, threads=2)
            ppl[recipe, method] = perplexity(m, n_ctx=256, limit_tokens=512).ppl
    assert ppl["q3_g64", "imatrix"] < 0.8 * ppl["q3_g64", "rtn"], ppl
    assert ppl["q2_g64", "imatrix"] < 0.5 * ppl["q2_g64", "rtn"], ppl
