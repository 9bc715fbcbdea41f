"""Hugging Face checkpoint -> pack, end to end against transformers.

A tiny random Llama (and Qwen2) is built with transformers and saved as safetensors,
with a SentencePiece tokenizer trained here on a small text; it is converted to a float
pack (logits must match transformers to float precision) and to q8_0 (argmax agreement).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

TEXT = """The quick brown fox jumps over the lazy dog. Python is a programming language
that lets you work quickly and integrate systems more effectively. Numbers like 12345
and symbols like {}[]() appear in code. def main(): return 0 if x else 1
A tokenizer splits text into pieces; a model predicts the next piece.""".splitlines()


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT * 20),
        model_writer=buf,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    return buf.getvalue()


def _save_checkpoint(path, arch: str, vocab: int, dtype, sp_bytes: bytes, tied: bool = False):
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "llama3":  # Llama 3.1's rope scaling, with a short original context so
        # that the 2-token..128-token wavelengths span all three of its bands
        scaling = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=32)  # fmt: skip
        cfg = transformers.LlamaConfig(**common, rope_parameters=scaling)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:  # gemma3: 6 layers so that one is global, a short sliding window
        common.update(num_hidden_layers=6, tie_word_embeddings=True)
        cfg = transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # make norms non-trivial so a wrong mapping shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.model").write_bytes(sp_bytes)
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        out = model.float()(torch.tensor([ids]))
    return out.logits[0].numpy()


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "gemma3"])
def test_hf_float_pack_matches_transformers(tmp_path, sp_model, arch):
    import edgerun
    from edgerun.tools.convert import convert

    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    vocab = sp.get_piece_size()
    hf_dir = tmp_path / "hf"
    model = _save_checkpoint(hf_dir, arch, vocab, torch.float32, sp_model)
    out = convert(hf_dir, tmp_path / "pack", "f32", progress=False)
    m = edgerun.load(out, n_ctx=128, threads=1)
    text = "The lazy fox writes Python code 42."
    ids = m.tokenize(text)
    assert ids[0] == sp.bos_id() and ids[1:] == sp.encode(text)
    ours = m.logits(ids)
    ref = _hf_logits(model, ids)
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())

    # q8_0 on random weights: logits close (argmax is fragile here: near-flat logits)
    out8 = convert(hf_dir, tmp_path / "pack8", "q8_0", progress=False)
    m8 = edgerun.load(out8, n_ctx=128, threads=1)
    rng = np.random.default_rng(0)
    ids = [sp.bos_id()] + rng.integers(3, vocab, 120).tolist()
    ref = _hf_logits(model, ids)
    q8 = m8.logits(ids)
    assert np.abs(q8 - ref).max() < 0.15 * ref.std()
    assert (q8.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_hf_q8_argmax_agreement(tmp_path, sp_model):
    """q8_0 pack vs transformers float32: greedy argmax agrees on >= 99% of positions.

    Tied embeddings give the random model peaked next-token distributions (as trained
    models have); an untied random model's near-flat logits make argmax a coin toss
    between near-ties (~98% there, see above)."""
    import edgerun
    from edgerun.tools.convert import convert

    vocab = spm.SentencePieceProcessor(model_proto=sp_model).get_piece_size()
    model = _save_checkpoint(tmp_path / "hf", "llama", vocab, torch.float32, sp_model, tied=True)
    out8 = convert(tmp_path / "hf", tmp_path / "pack8", "q8_0", progress=False)
    m8 = edgerun.load(out8, n_ctx=512, threads=1)
    rng = np.random.default_rng(0)
    ids = [1] + rng.integers(3, vocab, 400).tolist()
    ref = _hf_logits(model, ids)
    agree = (m8.logits(ids).argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= 0.99, agree


def test_hf_bf16_checkpoint(tmp_path, sp_model):
    """bf16 safetensors (no numpy dtype) are read exactly, tied embeddings have no output."""
    import edgerun
    from edgerun.formats.pack import read_pack
    from edgerun.tools.convert import convert

    vocab = spm.SentencePieceProcessor(model_proto=sp_model).get_piece_size()
    model = _save_checkpoint(tmp_path / "hf", "llama", vocab, torch.bfloat16, sp_model, tied=True)
    out = convert(tmp_path / "hf", tmp_path / "pack", "f32", progress=False)
    assert "output.weight" not in read_pack(out).tensor_names()
    m = edgerun.load(out, n_ctx=64, threads=1)
    ids = m.tokenize("def main(): return 0")
    ref = _hf_logits(model, ids)  # the bf16 weights widened to f32, as ours
    assert np.abs(m.logits(ids) - ref).max() < 1e-3 * max(1.0, np.abs(ref).max())


def test_hf_errors(tmp_path):
    from edgerun.errors import EdgerunError
    from edgerun.tools.convert import convert

    (tmp_path / "d").mkdir()
    with pytest.raises(EdgerunError, match="not a Hugging Face checkpoint"):
        convert(tmp_path / "d", tmp_path / "o", "f32", progress=False)
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "d" / "model.safetensors").write_bytes(b"")
    with pytest.raises(EdgerunError, match="bert"):
        convert(tmp_path / "d", tmp_path / "o", "f32", progress=False)


def test_hf_bpe_tokenizer_json(tmp_path, sp_model):
    """A byte-level BPE tokenizer.json (no tokenizer.model) converts to GGUF-style vocab
    metadata; the pack's tokenizer encodes as the `tokenizers` library does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import edgerun
    from edgerun.tools.convert import convert

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    vocab = tok.get_vocab_size()
    hf = tmp_path / "hf"
    model = _save_checkpoint(hf, "qwen2", vocab, torch.float32, b"")
    (hf / "tokenizer.model").unlink()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    out = convert(hf, tmp_path / "pack", "f32", progress=False)
    m = edgerun.load(out, n_ctx=64, threads=1)
    text = "The quick fox: 12345 {}[] def main()"
    ids = m.tokenize(text)
    assert ids == tok.encode(text).ids
    assert m.detokenize(ids) == text
    assert m.tokenizer.eos_id == tok.token_to_id("<|endoftext|>")
    ref = _hf_logits(model, ids)
    assert np.abs(m.logits(ids) - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


def test_convert_with_imatrix(tmp_path, sp_model):
    """--imatrix auto calibrates on the built-in text; the pack records it; the weighted
    3-bit quantization lowers the activation-weighted error of every layer's matrices."""
    from edgerun.formats.pack import read_pack
    from edgerun.quant.formats import QuantType
    from edgerun.quant.reference import dequantize
    from edgerun.tools.calibrate import load_imatrix
    from edgerun.tools.convert import convert

    if not hasattr(QuantType, "Q3_G64"):
        pytest.skip("Q3_G64 not registered in QuantType")
    vocab = spm.SentencePieceProcessor(model_proto=sp_model).get_piece_size()
    _save_checkpoint(tmp_path / "hf", "llama", vocab, torch.float32, sp_model)
    imf = tmp_path / "imatrix.npz"
    out = convert(
        tmp_path / "hf",
        tmp_path / "p",
        "q3_g64",
        imatrix="auto",
        calib_tokens=256,
        save_imatrix=imf,
        progress=False,
    )
    plain = convert(tmp_path / "hf", tmp_path / "p0", "q3_g64", progress=False)
    meta = read_pack(out).metadata["quantization"]
    assert meta["imatrix"]["tokens"] == 256 and meta["recipe"] == "q3_g64"
    imat = load_imatrix(imf)
    assert "blk.0.ffn_down.weight" in imat and imat["blk.0.ffn_down.weight"].shape == (128,)
    from edgerun.formats.safetensors_hf import HFCheckpoint

    hf = HFCheckpoint(tmp_path / "hf")
    a, b = read_pack(out), read_pack(plain)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        w = hf.float_tensor(name)
        t1, t0 = a.tensor(name), b.tensor(name)
        assert t1.qtype == QuantType.Q3_G64
        e1 = (((dequantize(t1.qtype, t1.data) - w) ** 2) * imat[name]).sum()
        e0 = (((dequantize(t0.qtype, t0.data) - w) ** 2) * imat[name]).sum()
        assert e1 < e0, name


def test_llama3_freq_factors_are_transformers_scaling():
    """The divisors a llama3-scaled checkpoint gets (rope_freqs.weight) turn the plain
    inverse frequencies into transformers' _compute_llama3_parameters ones, in all three
    bands (kept, blended, divided by factor)."""
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    from edgerun.formats.safetensors_hf import llama3_freq_factors

    scaling = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip
    cfg = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, rope_parameters=scaling
    )
    scaled, _ = _compute_llama3_parameters(cfg)
    plain = 1.0 / (500000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64))
    ours = llama3_freq_factors(scaling, 500000.0, 64)
    assert ours.shape == (32,) and ours.dtype == np.float32
    np.testing.assert_allclose(plain / ours, scaled.double().numpy(), rtol=1e-6)
    assert ours.min() == 1.0 and ours.max() == 32.0 and ((ours > 1) & (ours < 32)).any()
