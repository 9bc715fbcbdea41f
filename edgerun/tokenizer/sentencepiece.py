"""SentencePiece (``tokenizer.ggml.model = "llama"``): Llama 1/2, Mistral, Gemma, Phi-3, ...

Its own module because it is the other whole way of tokenizing: :class:`SentencePieceTokenizer`
builds a ModelProto (:mod:`.sp_model_proto`) from GGUF pieces, scores and types, or loads a
``tokenizer.model`` file, and encodes with the ``sentencepiece`` library, cutting control-token
strings out first; decoding goes through :class:`~.base.Tokenizer`, with SentencePiece's
dummy-prefix space rule. :func:`sentencepiece_spec_to_metadata` goes the other way, from a
:class:`~.sp_model_proto.SentencePieceSpec` to GGUF-style metadata.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.tokenizer.base import (
    _BYTE_TOKEN,
    _EOT_KEYS,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
    _as_int,
    _ByteTable,
    _check_len,
    _int_array,
    _literal_regex,
    _meta_bool,
    _num_array,
    _vocabulary,
)
from edgerun.tokenizer.sp_model_proto import _SPM_BPE, SentencePieceSpec, _pb_piece

_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece (``tokenizer.ggml.model = "llama"``): Llama 1/2, Mistral, Gemma, Phi-3, ...

    Encoding is done by the ``sentencepiece`` library, on a ModelProto built from the GGUF's
    ``tokenizer.ggml.tokens``, ``tokenizer.ggml.scores`` and ``tokenizer.ggml.token_type`` (BPE
    over the scores, as llama.cpp's SPM tokenizer does; byte fallback when the vocabulary has the
    ``<0xNN>`` byte tokens; identity normalization, spaces escaped as ``▁``; a dummy prefix space
    when ``tokenizer.ggml.add_space_prefix`` says so, true by default as in llama.cpp).
    :meth:`from_file` loads a Hugging Face / original ``tokenizer.model`` through the same code.

    Special tokens: control tokens (``<bos>``, ``<start_of_turn>``, ...) are never produced from
    text by SentencePiece; with ``parse_special=True`` their strings in the text are cut out and
    become their ids first (leftmost-longest), and each piece of text between them is encoded on
    its own (so with a dummy prefix each gets its ``▁``, as llama.cpp does). User-defined tokens
    are matched whole by SentencePiece itself, always (inside the escaped text: with a dummy
    prefix, text that starts with one gets a ``▁`` token first, where llama.cpp, which cuts them
    out beforehand, gives none; vocabularies without a dummy prefix, such as Gemma's, agree).

    Decoding: a normal or user-defined token is its text with ``▁`` as a space, a byte token
    ``<0xNN>`` the byte itself, a control or unknown token its text (dropped with
    ``skip_special``). With a dummy prefix, :meth:`decode` drops the space that starts the first
    piece, as SentencePiece and transformers do; :class:`StreamDecoder` keeps it unless asked
    (``strip_leading_space=True``), since a generated continuation's first space is real text.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        *,
        spec: SentencePieceSpec | None = None,
    ) -> None:
        """Build from GGUF metadata. ``spec``, when given, supplies the SentencePiece model
        settings (normalizer, model type) that a GGUF does not carry; :meth:`from_file` passes
        the file's own."""
        super().__init__()
        tokens = _vocabulary(meta)
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(n, TOKEN_TYPE_NORMAL, dtype=np.int32)
        types = _int_array(types)
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            scores = np.zeros(n, dtype=np.float32)
        scores = _num_array(scores, "tokenizer.ggml.scores", "iuf")
        if scores.dtype.kind != "f":
            scores = scores.astype(np.float64)
        if np.isnan(scores).any():
            raise ModelFormatError("GGUF metadata 'tokenizer.ggml.scores' should not hold NaN")
        _check_len("token_type", types, n)
        _check_len("scores", scores, n)

        def _id(key: str) -> int | None:
            v = _as_int(meta.get(key), key)
            if v is None or v < 0:  # -1: none (a .model file's pad_id, for one)
                return None
            if v >= n:
                raise ModelFormatError(
                    f"GGUF metadata {key!r} = {v} is outside the vocabulary of {n} tokens"
                )
            return v

        self.vocab_size = n
        self.bos_id = _id("tokenizer.ggml.bos_token_id")
        self.eos_id = _id("tokenizer.ggml.eos_token_id")
        self.pad_id = _id("tokenizer.ggml.padding_token_id")
        unk_id = _id("tokenizer.ggml.unknown_token_id")
        if unk_id is None:
            unknown = np.flatnonzero(types == TOKEN_TYPE_UNKNOWN)
            unk_id = int(unknown[0]) if len(unknown) else 0
        self.unk_id = unk_id

        # The scores as the ModelProto stores them (float32, four bytes each; a float64
        # beyond the float32 range becomes +-inf, as struct would refuse it).
        with np.errstate(over="ignore"):
            score_bytes = scores.astype("<f4").tobytes()

        # One pass over the vocabulary builds the model the library runs (its pieces, serialized
        # straight into the ModelProto), the decoding table and the special-token strings.
        # Types are normalized to what SentencePiece accepts: exactly one unknown piece (Gemma
        # files label <unk> a control token), byte pieces only when spelled <0xNN>, no empty or
        # repeated pieces (those become unused placeholders, which text never produces; the first
        # of a repeated spelling keeps it).
        escape = spec.escape_whitespaces if spec is not None else True
        sp_types = bytearray(n)
        proto = bytearray()
        seen: set[str] = set()
        byte_ids: list[int] = []
        special_text: dict[str, int] = {}
        blob = bytearray()
        offsets = array("q", [0])
        for i, (text, ty) in enumerate(zip(tokens, types.tolist())):
            if i == unk_id:
                ty = TOKEN_TYPE_UNKNOWN
            elif ty == TOKEN_TYPE_UNKNOWN:
                ty = TOKEN_TYPE_CONTROL
            elif ty == TOKEN_TYPE_BYTE and not _BYTE_TOKEN.match(text):
                ty = TOKEN_TYPE_NORMAL
            elif ty not in (
                TOKEN_TYPE_NORMAL,
                TOKEN_TYPE_CONTROL,
                TOKEN_TYPE_USER_DEFINED,
                TOKEN_TYPE_UNUSED,
                TOKEN_TYPE_BYTE,
            ):
                ty = TOKEN_TYPE_NORMAL  # 0, "undefined" in llama.cpp
            piece = text
            if ty == TOKEN_TYPE_USER_DEFINED and escape:
                # GGUF stores user-defined pieces as raw text ("  " for two spaces); SentencePiece
                # matches them in the escaped text ("▁▁").
                piece = piece.replace(" ", _SPACE)
            if not piece or piece in seen:
                piece = f"<edgerun-placeholder-{i}>"
                ty = TOKEN_TYPE_UNUSED if ty != TOKEN_TYPE_UNKNOWN else ty
            seen.add(piece)
            sp_types[i] = ty
            _pb_piece(proto, piece, score_bytes[4 * i : 4 * i + 4], ty)
            # Decoding: a byte token is its byte, a control or unknown token its text, any other
            # its text with ▁ as a space. Control and unknown strings are parsed as special.
            if ty == TOKEN_TYPE_BYTE:
                byte_ids.append(i)
                blob.append(int(text[3:5], 16))
            elif ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                if text:
                    special_text.setdefault(text, i)
                blob += text.encode("utf-8")
            else:
                blob += text.replace(_SPACE, " ").encode("utf-8")
            offsets.append(len(blob))
        self._token_bytes = _ByteTable(blob, offsets)
        del seen, score_bytes, blob, offsets
        self.token_types = np.frombuffer(sp_types, dtype=np.uint8)
        self._tokens = tokens
        self._scores = scores

        has_bytes = bool(byte_ids)
        if spec is None:
            add_prefix = _meta_bool(meta, "tokenizer.ggml.add_space_prefix")
            spec = SentencePieceSpec(
                pieces=[],
                scores=[],
                types=[],
                model_type=_SPM_BPE,
                byte_fallback=has_bytes,
                add_dummy_prefix=True if add_prefix is None else bool(add_prefix),
                remove_extra_whitespaces=False,
                escape_whitespaces=True,
            )
        else:
            spec = replace(spec, pieces=[], scores=[], types=[])
            spec.byte_fallback = spec.byte_fallback and has_bytes
        spec.unk_id = unk_id
        spec.bos_id = -1 if self.bos_id is None else self.bos_id
        spec.eos_id = -1 if self.eos_id is None else self.eos_id
        spec.pad_id = -1 if self.pad_id is None else self.pad_id
        self._settings = spec  # the spec without its pieces: see the spec property
        self.add_space_prefix = spec.add_dummy_prefix
        proto += spec._proto_settings(n)
        model_proto = bytes(proto)
        del proto

        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        except (RuntimeError, OSError) as e:
            raise ModelFormatError(
                f"the SentencePiece vocabulary could not be loaded ({e}); the GGUF tokenizer "
                "metadata is inconsistent"
            ) from e
        del model_proto

        # decode() drops the first piece's leading space where SentencePiece does.
        self._strip_first_space = (
            spec.add_dummy_prefix or spec.remove_extra_whitespaces
        ) and not spec.treat_whitespace_as_suffix
        self._byte_ids = frozenset(byte_ids)

        # Special-token strings in text are matched leftmost-longest.
        self._special_text = special_text
        self._special_re = _literal_regex(special_text)

        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        self._set_turn_and_special_ids(
            meta, self.token_types, [_id(k) for k in _EOT_KEYS], special_text.get, True
        )

    @property
    def spec(self) -> SentencePieceSpec:
        """The SentencePiece model this tokenizer runs: its pieces (as the library holds them),
        scores, types and settings. Rebuilt on each access; the vocabulary is not kept twice."""
        pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        return replace(
            self._settings,
            pieces=pieces,
            scores=self._scores.tolist(),
            types=self.token_types.tolist(),
        )

    @property
    def model_proto(self) -> bytes:
        """The serialized ModelProto the ``sentencepiece`` library was loaded from."""
        return self.spec.to_model_proto()

    # -- construction from a tokenizer.model --------------------------------------------------

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        add_bos: bool | None = None,
        chat_template: str | None = None,
    ) -> SentencePieceTokenizer:
        """Load a SentencePiece ``tokenizer.model`` file (Hugging Face repos, original releases).

        The file's pieces, types and normalizer settings are kept as they are. ``add_bos``
        defaults to true when the model has a BOS piece (as Llama and Gemma want).
        """
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read SentencePiece model {str(path)!r}: {e}") from e
        return cls.from_model_proto(data, add_bos=add_bos, chat_template=chat_template)

    @classmethod
    def from_model_proto(
        cls,
        data: bytes,
        *,
        add_bos: bool | None = None,
        chat_template: str | None = None,
    ) -> SentencePieceTokenizer:
        """As :meth:`from_file`, from the serialized ModelProto's bytes."""
        spec = SentencePieceSpec.from_model_proto(bytes(data))
        meta = sentencepiece_spec_to_metadata(spec)
        if add_bos is not None:
            meta["tokenizer.ggml.add_bos_token"] = bool(add_bos)
        elif meta.get("tokenizer.ggml.bos_token_id") is None:
            meta["tokenizer.ggml.add_bos_token"] = False
        if chat_template:
            meta["tokenizer.chat_template"] = chat_template
        return cls(meta, spec=spec)

    # -- encoding -------------------------------------------------------------------------------

    def _encode_text(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int) if text else []

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() takes a str, got {type(text).__name__}")
        pattern = self._special_re if parse_special else None
        return self._with_bos(self._encode_around(text, pattern, self._special_text), add_bos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = True
    ) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos, parse_special=parse_special) for t in texts]

    # -- decoding -------------------------------------------------------------------------------

    def _strips_leading_space(self, id: int) -> bool:
        return (
            self._strip_first_space
            and id not in self._byte_ids
            and id not in self.special_ids
            and self._token_bytes[id][:1] == b" "
        )

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        if not self._strip_first_space:
            return super().decode(ids, skip_special)
        ids = [int(i) for i in ids]
        skip = self.special_ids if skip_special else ()
        first = next((i for i in ids if i not in skip), None)
        text = super().decode(ids, skip_special)
        if first is not None and self._strips_leading_space(first):
            text = text[1:]
        return text

    def id_to_token(self, id: int) -> str:
        """The token as the vocabulary spells it (``▁`` for a space in normal tokens)."""
        self.token_bytes(id)  # range check
        return self._tokens[id]


def sentencepiece_spec_to_metadata(spec: SentencePieceSpec) -> dict[str, Any]:
    """GGUF-style tokenizer metadata for a SentencePiece model, as llama.cpp's converter writes
    it (user-defined pieces keep ``▁``: :class:`SentencePieceTokenizer` accepts both)."""
    n = len(spec.pieces)

    def ok(i: int) -> int | None:
        return i if 0 <= i < n else None

    unk = ok(spec.unk_id)
    if unk is None or spec.types[unk] != TOKEN_TYPE_UNKNOWN:
        unk = next((i for i, ty in enumerate(spec.types) if ty == TOKEN_TYPE_UNKNOWN), unk)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": list(spec.pieces),
        "tokenizer.ggml.scores": list(spec.scores),
        "tokenizer.ggml.token_type": list(spec.types),
        "tokenizer.ggml.add_space_prefix": spec.add_dummy_prefix,
        "tokenizer.ggml.unknown_token_id": unk,
        "tokenizer.ggml.bos_token_id": ok(spec.bos_id),
        "tokenizer.ggml.eos_token_id": ok(spec.eos_id),
        "tokenizer.ggml.padding_token_id": ok(spec.pad_id),
    }
    return {k: v for k, v in meta.items() if v is not None}
