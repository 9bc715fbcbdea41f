"""Build tests/data/qwen3-embedding/ (run by hand, not by CI): a tiny Qwen3-Embedding-style
model and transformers' embeddings of a few texts.

Qwen3-Embedding is a `Qwen3Model` (no LM head) with a sentence-transformers Pooling module
that takes the last token (`pooling_mode_lasttoken`), and a tokenizer whose post-processor
appends `<|endoftext|>`, the token whose state is pooled. This builds the same shape at
tiny size (random weights, fixed seed, float32; the byte-level BPE of
families/make_family_models.py) and converts it with llama.cpp's own convert_hf_to_gguf.py,
which reads `modules.json` + `1_Pooling/config.json` into `qwen3.pooling_type` = 3 (last) and
the post-processor into `tokenizer.ggml.add_eos_token` = true. The folder holds:

- ``f32.gguf``
- ``reference.npz``: ``ids`` (int32, every text's ids one after another, as transformers'
  tokenizer gives them, EOS included), ``lengths`` (int32 per text), ``last`` and ``mean``
  (float32 [texts, d_model]: transformers' final hidden states, after the output norm,
  pooled and L2-normalised)
- ``reference.json``: the texts, the config, and llama.cpp's own cosine with ``last``.

Usage (from the repository root)::

    python tests/data/make_qwen3_embedding.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "qwen3-embedding"
sys.path.insert(0, str(HERE / "families"))
import make_family_models as fam  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer splits text into pieces.",
    "def main(): return 0",
    "x",
    "Sliding window attention lets a token see only the most recent tokens of the sequence.",
]
CONFIG = dict(
    fam.BASE,
    head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)


def _append_eos(hf_dir: Path) -> None:
    """The post-processor Qwen3-Embedding's tokenizer has: every text ends in <|endoftext|>."""
    path = hf_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
        ],
        "pair": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}},
        ],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [eos], "tokens": ["<|endoftext|>"]}
        },
    }
    path.write_text(json.dumps(tok))


def _sentence_transformers_modules(hf_dir: Path, d_model: int) -> None:
    """modules.json and the Pooling module's config, as Qwen3-Embedding ships them."""
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (hf_dir / "modules.json").write_text(json.dumps(modules, indent=1))
    (hf_dir / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": d_model,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=1))


def _unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def main() -> None:
    import torch
    import transformers

    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "Qwen3-Embedding-tiny"
        hf_dir.mkdir()
        fam._train_bpe(hf_dir, add_bos=False)
        _append_eos(hf_dir)
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        cfg = transformers.Qwen3Config(
            **CONFIG, vocab_size=len(tok), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos
        )
        cfg._attn_implementation = "eager"
        torch.manual_seed(fam.SEED)
        model = transformers.Qwen3Model(cfg).float().eval()
        fam._perturb(model)
        seqs = [tok(t)["input_ids"] for t in TEXTS]
        assert all(s[-1] == eos for s in seqs), "the post-processor appends <|endoftext|>"
        last, mean = [], []
        for ids in seqs:
            with torch.no_grad():
                h = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
            last.append(h[-1])
            mean.append(h.mean(0))
        model.save_pretrained(hf_dir, safe_serialization=True)
        _sentence_transformers_modules(hf_dir, cfg.hidden_size)
        gguf = OUT / "f32.gguf"
        fam._convert(fam.LLAMA_CPP, hf_dir, "f32", gguf, "qwen2")

    ref = {"last": _unit(np.array(last)), "mean": _unit(np.array(mean))}
    np.savez(
        OUT / "reference.npz",
        ids=np.array([t for s in seqs for t in s], np.int32),
        lengths=np.array([len(s) for s in seqs], np.int32),
        **ref,
    )
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(gguf), embedding=True, n_ctx=128, n_batch=128, n_ubatch=128,
        type_k=0, type_v=0, verbose=False,
    )  # fmt: skip
    theirs = np.array(llm.embed(TEXTS, normalize=True), np.float64)
    llm.close()
    info = {
        "texts": TEXTS,
        "transformers_class": "Qwen3Model",
        "config": {k: v for k, v in CONFIG.items()},
        "pooling": "last (1_Pooling/config.json: pooling_mode_lasttoken)",
        "llama_cpp_cosine_last_min": float((theirs * ref["last"]).sum(1).min()),
    }
    (OUT / "reference.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
