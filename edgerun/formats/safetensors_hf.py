"""Hugging Face checkpoints (config.json + *.safetensors + tokenizer) as a conversion source.

Maps the HF tensor names and layouts onto edgerun's (GGUF) conventions:

- names: model.layers.{i}.self_attn.q_proj.weight -> blk.{i}.attn_q.weight, ...
- Llama q/k projections are permuted as llama.cpp's converter does (rows of each head
  reordered so that RoPE rotates adjacent pairs), so the llama spec's "interleaved"
  RoPE applies; Qwen2 / Gemma 3 use NeoX RoPE and are not permuted.
- Gemma's RMSNorm multiplies by (1 + w): the gains are stored +1, as in GGUF.
- f32 / f16 / bf16 tensors are read with safetensors (bf16 widened to f32 exactly).

The config becomes GGUF-style metadata ("llama.block_count", ...), so the same
arch/ spec builders serve both sources. Tokenizers: a SentencePiece tokenizer.model is
kept verbatim; a byte-level BPE tokenizer.json becomes GGUF-style vocab/merges metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError
from edgerun.quant.formats import QuantTensor, QuantType

__all__ = ["HFCheckpoint", "is_hf_dir"]

_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# the post-attention norm is the FFN's pre-norm in Llama/Qwen, a real post-norm in Gemma 3
_LAYER_MAP_LLAMA = {"post_attention_layernorm.weight": "ffn_norm.weight"}
_LAYER_MAP_GEMMA = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


ROPE_FREQS = "rope_freqs.weight"


def llama3_freq_factors(params: dict[str, Any], base: float, head_dim: int) -> np.ndarray:
    """Llama 3's rope scaling as per-frequency divisors [head_dim / 2] (float32): what
    transformers' _compute_llama3_parameters does to inv_freq, as inv_freq / scaled.
    Long wavelengths (past original_max_position_embeddings / low_freq_factor) are
    divided by `factor`, short ones (below .. / high_freq_factor) kept, and the band
    between blended smoothly."""
    factor = float(params.get("factor", 8.0))
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_ctx = float(params.get("original_max_position_embeddings", 8192))
    if not (factor > 0 and high > low > 0 and old_ctx > 0):
        raise ModelFormatError(
            f"llama3 rope scaling needs factor > 0, high_freq_factor > low_freq_factor > 0 "
            f"and original_max_position_embeddings > 0, found {params}"
        )
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)  # the band between
    divisor = np.where(wavelen < old_ctx / high, 1.0, divisor)
    divisor = np.where(wavelen > old_ctx / low, factor, divisor)
    return divisor.astype(np.float32)


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


class HFCheckpoint:
    """A Hugging Face model directory, read lazily tensor by tensor."""

    kind = "hf"

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelNotFoundError(f"Hugging Face checkpoint directory not found: {self.path}")
        cfg_path = self.path / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"{self.path}: config.json is missing") from None
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{cfg_path}: not valid JSON ({e})") from None
        if "text_config" in cfg and cfg.get("model_type") == "gemma3":
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        self.config = cfg
        mt = cfg.get("model_type")
        self.arch = _ARCH.get(mt)
        if self.arch is None:
            raise UnsupportedError(
                f"{cfg_path}: model_type {mt!r} is not supported (supported: {', '.join(_ARCH)})"
            )
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{self.path}: no *.safetensors files")
        self._files = files
        self._handles = {}
        self._hf_names: dict[str, tuple[Path, str]] = {}
        for f in files:
            h = safe_open(str(f), framework="numpy")
            self._handles[f] = h
            for k in h.keys():
                self._hf_names[k] = (f, k)
        self.metadata = self._gguf_metadata()
        from edgerun.arch import spec_from_gguf

        self.spec = spec_from_gguf(self.metadata, str(self.path))
        self._map: dict[str, str] = {}  # our name -> hf name
        lm = _LAYER_MAP | (_LAYER_MAP_GEMMA if self.arch == "gemma3" else _LAYER_MAP_LLAMA)
        for hf in self._hf_names:
            ours = None
            if hf in _GLOBAL_MAP:
                ours = _GLOBAL_MAP[hf]
            elif hf.startswith("model.layers."):
                rest = hf[len("model.layers.") :]
                i, _, role = rest.partition(".")
                if role in lm:
                    ours = f"blk.{int(i)}.{lm[role]}"
            if ours is None:
                if hf.endswith("rotary_emb.inv_freq"):
                    continue
                raise UnsupportedError(f"{self.path}: tensor {hf!r} has no edgerun mapping")
            self._map[ours] = hf
        if cfg.get("tie_word_embeddings", False) and "output.weight" in self._map:
            del self._map["output.weight"]
        self._shapes: dict[str, tuple[int, int]] = {}
        if self._rope_freqs is not None:  # computed, not read: no HF name
            self._shapes[ROPE_FREQS] = (1, self._rope_freqs.size)
        for ours, hf in self._map.items():
            f, k = self._hf_names[hf]
            shape = self._handles[f].get_slice(k).get_shape()
            if len(shape) == 1:
                self._shapes[ours] = (1, int(shape[0]))
            elif len(shape) == 2:
                self._shapes[ours] = (int(shape[0]), int(shape[1]))
            else:
                raise UnsupportedError(f"{self.path}: tensor {hf!r} has shape {shape}")

    # -- config -> GGUF-style metadata ------------------------------------------------
    def _gguf_metadata(self) -> dict[str, Any]:
        c = self.config
        a = self.arch

        def req(key: str) -> Any:
            if key not in c:
                raise ModelFormatError(f"{self.path / 'config.json'}: field {key!r} is missing")
            return c[key]

        n_heads = int(req("num_attention_heads"))
        d = int(req("hidden_size"))
        head_dim = int(c.get("head_dim") or d // n_heads)
        rope = c.get("rope_parameters") or {}
        rope_theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = c.get("rope_scaling") or {}
        stype = scaling.get("rope_type", scaling.get("type")) if scaling else None
        if rope and a != "gemma3":
            stype = stype or rope.get("rope_type")
        params = scaling or (rope if a != "gemma3" else {})
        # Llama 3's scaling becomes the per-frequency divisors llama.cpp's converter
        # stores as rope_freqs.weight (llama3_freq_factors); linear scaling, metadata
        self._rope_freqs: np.ndarray | None = None
        linear = None
        if stype == "llama3" and a == "llama":
            self._rope_freqs = llama3_freq_factors(params, float(rope_theta), head_dim)
        elif stype == "linear" and a != "gemma3":
            linear = float(params.get("factor", 1.0))
        elif stype not in (None, "default"):
            raise UnsupportedError(
                f"{self.path / 'config.json'}: RoPE scaling {stype!r} is not supported yet"
            )
        meta: dict[str, Any] = {
            "general.architecture": a,
            "general.name": str(c.get("_name_or_path") or self.path.name),
            f"{a}.block_count": int(req("num_hidden_layers")),
            f"{a}.context_length": int(c.get("max_position_embeddings", 2048)),
            f"{a}.embedding_length": d,
            f"{a}.feed_forward_length": int(req("intermediate_size")),
            f"{a}.attention.head_count": n_heads,
            f"{a}.attention.head_count_kv": int(c.get("num_key_value_heads") or n_heads),
            f"{a}.attention.key_length": head_dim,
            f"{a}.attention.value_length": head_dim,
            f"{a}.rope.freq_base": float(rope_theta),
            f"{a}.rope.dimension_count": head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps", 1e-6)),
            f"{a}.vocab_size": int(req("vocab_size")),
        }
        if linear is not None:
            meta[f"{a}.rope.scaling.type"] = "linear"
            meta[f"{a}.rope.scaling.factor"] = linear
        if a == "gemma3":
            from edgerun.arch.gemma3 import SWA_PERIOD

            n = meta[f"{a}.block_count"]
            want = [
                "full_attention" if i % SWA_PERIOD == SWA_PERIOD - 1 else "sliding_attention"
                for i in range(n)
            ]
            if c.get("layer_types") not in (None, want):
                raise UnsupportedError(
                    f"{self.path / 'config.json'}: field 'layer_types' is not Gemma 3's "
                    f"every-{SWA_PERIOD}th-global pattern"
                )
            qpa = c.get("query_pre_attn_scalar")
            if qpa is not None and int(qpa) != head_dim:
                raise UnsupportedError(
                    f"{self.path / 'config.json'}: field 'query_pre_attn_scalar' = {qpa} "
                    f"differs from head_dim {head_dim}"
                )
            if isinstance(rope, dict) and "full_attention" in rope:
                meta[f"{a}.rope.freq_base"] = float(
                    rope["full_attention"].get("rope_theta", rope_theta)
                )
            meta[f"{a}.attention.sliding_window"] = int(c.get("sliding_window") or 0)
            cap = c.get("final_logit_softcapping")
            if cap:
                meta[f"{a}.final_logit_softcapping"] = float(cap)
        return meta

    # -- tensors ----------------------------------------------------------------------
    def shapes(self) -> dict[str, tuple[int, int]]:
        return dict(self._shapes)

    def source_types(self) -> None:
        return None

    def tensor_names(self) -> list[str]:
        return list(self._map) + ([ROPE_FREQS] if self._rope_freqs is not None else [])

    def float_tensor(self, name: str) -> np.ndarray:
        """float32 [rows, cols] (1-D tensors: [1, n]) in edgerun's layout."""
        if name == ROPE_FREQS and self._rope_freqs is not None:
            return self._rope_freqs.reshape(1, -1).copy()
        hf = self._map.get(name)
        if hf is None:
            raise ModelFormatError(f"{self.path}: tensor '{name}' is missing")
        f, k = self._hf_names[hf]
        h = self._handles[f]
        try:
            arr = h.get_tensor(k)
        except TypeError:  # bfloat16: numpy has no such dtype; read the raw bits
            arr = None
        if arr is None or arr.dtype == np.dtype("V2"):
            arr = self._bf16(f, k)
        arr = np.asarray(arr, dtype=np.float32)
        s = self.spec
        if self.arch == "llama":
            if name.endswith("attn_q.weight"):
                arr = _permute(arr, s.n_heads)
            elif name.endswith("attn_k.weight"):
                arr = _permute(arr, s.n_kv_heads)
        if self.arch == "gemma3" and "norm" in name:
            arr = arr + np.float32(1.0)
        return np.ascontiguousarray(arr.reshape(self._shapes[name]))

    def _bf16(self, f: Path, k: str) -> np.ndarray:
        """Read a BF16 tensor's bits from the documented safetensors layout."""
        import struct

        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            hdr = json.loads(fh.read(n))
            ent = hdr[k]
            if ent["dtype"] != "BF16":
                raise UnsupportedError(f"{f}: tensor {k!r} has dtype {ent['dtype']}")
            b, e = ent["data_offsets"]
            fh.seek(8 + n + b)
            raw = np.frombuffer(fh.read(e - b), dtype=np.uint16)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(ent["shape"])

    def tensor(self, name: str) -> QuantTensor:
        """Reader protocol (for calibration runs): the tensor as F32 blocks."""
        x = self.float_tensor(name)
        return QuantTensor(name, QuantType.F32, x.shape, x.view(np.uint8))

    # -- tokenizer ----------------------------------------------------------------------
    def tokenizer_section(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """(the pack's 'tokenizer' field, extra files to write into the pack)."""
        tcfg = {}
        tc = self.path / "tokenizer_config.json"
        if tc.is_file():
            try:
                tcfg = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise ModelFormatError(f"{tc}: not valid JSON ({e})") from None
        template = tcfg.get("chat_template")
        ct = self.path / "chat_template.jinja"
        if template is None and ct.is_file():
            template = ct.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next(
                (t.get("template") for t in template if t.get("name") == "default"), None
            )
        spm = self.path / "tokenizer.model"
        if spm.is_file():
            add_bos = tcfg.get("add_bos_token")
            sec = {
                "kind": "sentencepiece",
                "file": "tokenizer.model",
                "add_bos": None if add_bos is None else bool(add_bos),
                "chat_template": template,
            }
            return sec, {"tokenizer.model": spm.read_bytes()}
        tj = self.path / "tokenizer.json"
        if tj.is_file():
            meta = _bpe_metadata(tj, tcfg, self.config)
            if template:
                meta["tokenizer.chat_template"] = template
            return {"kind": "gguf", "metadata": meta}, {}
        raise ModelFormatError(
            f"{self.path}: no tokenizer (tokenizer.model or tokenizer.json) in the checkpoint"
        )

    def sha256(self) -> str:
        """sha256 over config.json and the safetensors files (name + each file's sha256)."""
        h = hashlib.sha256()
        for f in [self.path / "config.json", *self._files]:
            h.update(f.name.encode() + b"\0" + _file_sha256(f).encode() + b"\n")
        return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _bpe_metadata(path: Path, tcfg: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """GGUF-style metadata for a byte-level BPE tokenizer.json (GPT-2 / Qwen / Llama 3)."""
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedError(f"{path}: tokenizer model {model.get('type')!r} is not BPE")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: t for t in tj.get("added_tokens") or []}
    for t in added.values():
        vocab[t["content"]] = int(t["id"])
    n = max(int(cfg.get("vocab_size", 0)), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # unused, until set
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 1
    for t in added.values():
        types[int(t["id"])] = 3 if t.get("special") else 4
    merges = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    pre = _guess_pre(tj.get("pre_tokenizer"))
    if pre is None:
        raise UnsupportedError(
            f"{path}: pre-tokenizer {json.dumps(tj.get('pre_tokenizer'))[:200]} is not one "
            "edgerun knows (GPT-2 byte level, digit-split byte level, Llama 3, Qwen2)"
        )

    def tid(key: str) -> int | None:
        v = tcfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if isinstance(v, str) else None

    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(tcfg.get("add_bos_token", False)),
    }
    for key, field in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
        ("unk_token", "unknown_token_id"),
    ):
        v = tid(key)
        if v is not None:
            meta[f"tokenizer.ggml.{field}"] = v
    return meta


def _guess_pre(pt: Any) -> str | None:
    """tokenizer.ggml.pre for a tokenizer.json pre_tokenizer, by its structure and regex."""
    from edgerun.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT

    if not isinstance(pt, dict):
        return None
    parts = pt.get("pretokenizers") if pt.get("type") == "Sequence" else [pt]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = (parts[0].get("pattern") or {}).get("Regex")
        return {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}.get(regex)
    return None
