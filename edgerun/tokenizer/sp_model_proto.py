"""sentencepiece's ModelProto, written and read by hand, and :class:`SentencePieceSpec`.

The ``sentencepiece`` library loads a model only as a serialized ModelProto, and a
``tokenizer.model`` file is one. The schema is small and stable, so a minimal protobuf writer and
parser live here rather than a protobuf dependency in the runtime. Kept apart from
:mod:`.sentencepiece` because it is a wire format, not a tokenizer: :class:`SentencePieceSpec`
is the model's content (pieces, scores, types, the settings that change encoding) and converts
to and from those bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from edgerun.errors import ModelFormatError
from edgerun.tokenizer.base import TOKEN_TYPE_NORMAL

# sentencepiece's ModelProto, written and read by hand: the schema is small and stable, and doing
# it here keeps protobuf out of the runtime dependencies. Field numbers are those of
# sentencepiece_model.proto (ModelProto, SentencePiece, TrainerSpec, NormalizerSpec).
_SPM_UNIGRAM = 1
_SPM_BPE = 2
_SPM_MODEL_TYPES = {"unigram": _SPM_UNIGRAM, "bpe": _SPM_BPE, "word": 3, "char": 4}


def _pb_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int32/int64 negatives: ten-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_field_varint(field: int, n: int) -> bytes:
    return _pb_varint(field << 3) + _pb_varint(int(n))


def _pb_field_bytes(field: int, data: bytes) -> bytes:
    return _pb_varint((field << 3) | 2) + _pb_varint(len(data)) + data


def _pb_field_float(field: int, x: float) -> bytes:
    return _pb_varint((field << 3) | 5) + struct.pack("<f", x)


_SHORT_VARINTS = [bytes((i,)) for i in range(128)]
_PB_TYPE_FIELDS = {ty: _pb_field_varint(3, ty) for ty in range(7)}


def _pb_piece(out: bytearray, piece: str, score: bytes, ty: int) -> None:
    """Append one ModelProto ``pieces`` entry to ``out``: a SentencePiece message with 1 piece
    (string), 2 score (``score``: the float's four bytes), 3 type (enum, left out when normal)."""
    short = _SHORT_VARINTS
    p = piece.encode("utf-8")
    lp = len(p)
    head = short[lp] if lp < 128 else _pb_varint(lp)
    tail = b"" if ty == TOKEN_TYPE_NORMAL else _PB_TYPE_FIELDS.get(ty) or _pb_field_varint(3, ty)
    n = 6 + len(head) + lp + len(tail)
    out += b"\x0a" + (short[n] if n < 128 else _pb_varint(n)) + b"\x0a" + head
    out += p
    out += b"\x15" + score + tail


def _pb_parse(data: bytes) -> list[tuple[int, int, Any]]:
    """One protobuf message's fields as ``(field, wire type, value)``; raises ValueError."""
    out = []
    i, n = 0, len(data)

    def varint() -> int:
        nonlocal i
        r = shift = 0
        while True:
            if i >= n or shift > 63:
                raise ValueError("truncated varint")
            c = data[i]
            i += 1
            r |= (c & 0x7F) << shift
            shift += 7
            if c < 0x80:
                return r

    while i < n:
        key = varint()
        fnum, wire = key >> 3, key & 7
        if wire == 0:
            value: Any = varint()
        elif wire == 1:
            value = data[i : i + 8]
            i += 8
        elif wire == 2:
            size = varint()
            value = data[i : i + size]
            i += size
        elif wire == 5:
            value = data[i : i + 4]
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if i > n:
            raise ValueError("truncated field")
        out.append((fnum, wire, value))
    return out


def _pb_int32(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass
class SentencePieceSpec:
    """What a SentencePiece model is made of: the pieces, their scores and types, and the few
    trainer/normalizer settings that change how text is encoded. :func:`to_model_proto` writes it
    as the serialized ModelProto ``sentencepiece`` loads; :func:`from_model_proto` reads one.

    ``types`` uses SentencePiece's numbering, which is also GGUF's ``tokenizer.ggml.token_type``
    (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    """

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = _SPM_BPE
    byte_fallback: bool = False
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = False
    escape_whitespaces: bool = True
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = "identity"
    precompiled_charsmap: bytes = b""
    unk_surface: str | None = None
    # Special ids as a .model file's trainer_spec states them (-1: none).
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    # A denormalizer, kept verbatim from a .model file (rare; None: none).
    denormalizer: bytes | None = field(default=None, repr=False)

    def to_model_proto(self) -> bytes:
        out = bytearray()
        pack = struct.Struct("<f").pack
        for piece, score, ty in zip(self.pieces, self.scores, self.types):
            _pb_piece(out, piece, pack(score), ty)
        out += self._proto_settings(len(self.pieces))
        return bytes(out)

    def _proto_settings(self, n_pieces: int) -> bytes:
        """The ModelProto fields after the pieces: trainer, normalizer, denormalizer specs."""
        parts = []
        trainer = (
            _pb_field_varint(3, self.model_type)
            + _pb_field_varint(4, n_pieces)
            + _pb_field_varint(24, self.treat_whitespace_as_suffix)
            + _pb_field_varint(35, self.byte_fallback)
            + _pb_field_varint(40, self.unk_id)
            + _pb_field_varint(41, self.bos_id)
            + _pb_field_varint(42, self.eos_id)
            + _pb_field_varint(43, self.pad_id)
        )
        if self.unk_surface is not None:
            trainer += _pb_field_bytes(44, self.unk_surface.encode("utf-8"))
        parts.append(_pb_field_bytes(2, trainer))
        normalizer = (
            _pb_field_bytes(1, self.normalizer_name.encode("utf-8"))
            + (_pb_field_bytes(2, self.precompiled_charsmap) if self.precompiled_charsmap else b"")
            + _pb_field_varint(3, self.add_dummy_prefix)
            + _pb_field_varint(4, self.remove_extra_whitespaces)
            + _pb_field_varint(5, self.escape_whitespaces)
        )
        parts.append(_pb_field_bytes(3, normalizer))
        if self.denormalizer is not None:
            parts.append(_pb_field_bytes(5, self.denormalizer))
        return b"".join(parts)

    @classmethod
    def from_model_proto(cls, data: bytes) -> SentencePieceSpec:
        """Read a serialized ModelProto (the contents of a ``tokenizer.model`` file)."""
        try:
            top = _pb_parse(data)
            pieces, scores, types = [], [], []
            spec = cls(pieces, scores, types, model_type=_SPM_UNIGRAM)
            # Proto defaults, which a file leaves out: a default NormalizerSpec is NFKC with a
            # dummy prefix and whitespace clean-up; sentencepiece applies the same.
            spec.add_dummy_prefix = True
            spec.remove_extra_whitespaces = True
            spec.normalizer_name = ""
            for f, wire, value in top:
                if f == 1 and wire == 2:
                    piece, score, ty = "", 0.0, TOKEN_TYPE_NORMAL
                    for pf, pw, pv in _pb_parse(value):
                        if pf == 1 and pw == 2:
                            piece = bytes(pv).decode("utf-8")
                        elif pf == 2 and pw == 5:
                            score = struct.unpack("<f", pv)[0]
                        elif pf == 3 and pw == 0:
                            ty = int(pv)
                    pieces.append(piece)
                    scores.append(score)
                    types.append(ty)
                elif f == 2 and wire == 2:
                    for tf, tw, tv in _pb_parse(value):
                        if tw == 0:
                            if tf == 3:
                                spec.model_type = int(tv)
                            elif tf == 24:
                                spec.treat_whitespace_as_suffix = bool(tv)
                            elif tf == 35:
                                spec.byte_fallback = bool(tv)
                            elif tf in (40, 41, 42, 43):
                                setattr(
                                    spec,
                                    {40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id"}[tf],
                                    _pb_int32(tv),
                                )
                        elif tf == 44 and tw == 2:
                            spec.unk_surface = bytes(tv).decode("utf-8")
                elif f == 3 and wire == 2:
                    for nf, nw, nv in _pb_parse(value):
                        if nf == 1 and nw == 2:
                            spec.normalizer_name = bytes(nv).decode("utf-8")
                        elif nf == 2 and nw == 2:
                            spec.precompiled_charsmap = bytes(nv)
                        elif nf == 3 and nw == 0:
                            spec.add_dummy_prefix = bool(nv)
                        elif nf == 4 and nw == 0:
                            spec.remove_extra_whitespaces = bool(nv)
                        elif nf == 5 and nw == 0:
                            spec.escape_whitespaces = bool(nv)
                elif f == 5 and wire == 2:
                    spec.denormalizer = bytes(value)
        except (ValueError, UnicodeDecodeError, struct.error) as e:
            raise ModelFormatError(
                f"not a valid SentencePiece model ({e}); expected the serialized ModelProto of a "
                "tokenizer.model file"
            ) from e
        if not pieces:
            raise ModelFormatError(
                "the SentencePiece model has no pieces; expected the serialized ModelProto of a "
                "tokenizer.model file"
            )
        return spec
