"""Session: one conversation on a shared engine, with its own KV cache and history.

Many sessions share one loaded model (its Engine: weights, kernels; and the scheduler
that batches their decode steps, serving/batching.Serving). A session keeps its KV cache
between turns, so a new message computes only its own tokens; `save` writes history and
cache to one safetensors file (atomically), and `Session.load` resumes it without
recomputing the conversation.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.errors import EdgerunError, InvalidArgumentError, ModelFormatError
from edgerun.generate.constraint import response_format_constraint
from edgerun.generate.engine import Engine
from edgerun.model.kvcache import (
    KEY_CENTRE,
    KEY_SCALE_LIMIT,
    KV_TYPES,
    QUANTISED_KV_TYPES,
    KVCache,
    kv_types,
)
from edgerun.offload.io import drop_page_cache
from edgerun.ops.attention import cache_floats, cache_values
from edgerun.ops.kv_blocks import ROTATION, rotation, row_width
from edgerun.runtime.atomic import write_atomic
from edgerun.serving import kv_spill
from edgerun.serving.batching import Request, ResponseStats, Serving

SESSION_FORMAT = "edgerun-session/1"
_MAX_META = 64 << 20  # a session's JSON metadata (history, tokens) is at most this long


def system_prefix_len(
    engine: Engine, conversation: list[dict[str, str]], ids: Sequence[int]
) -> int:
    """How many leading tokens of `ids` (the rendered `conversation`) are its system turn
    alone: the part sessions with the same system prompt share (engine.prefix_cache).
    0 when the conversation has no system turn or the template renders it differently."""
    if not conversation or conversation[0]["role"] != "system":
        return 0
    head = engine.encode_chat(conversation[:1], add_generation_prompt=False)
    n = len(head)
    return n if 0 < n < len(ids) and list(ids[:n]) == head else 0


class SessionFileError(EdgerunError):
    """A saved session that is unreadable, corrupt, or from another model."""


def _serving(source: Any) -> Serving:
    """The Serving a session runs on: `source` itself, or what a loaded model holds as
    `.serving` (Session.load(model, path) with an edgerun.Model)."""
    if isinstance(source, Serving):
        return source
    serving = getattr(source, "serving", None)
    if not isinstance(serving, Serving):
        raise InvalidArgumentError(
            f"a session runs on a loaded model (edgerun.load), got {type(source).__name__}"
        )
    return serving


class Session:
    """A conversation: `send` a user message, get the assistant's answer.

    Made by Model.session(); runs on `serving`'s engine and scheduler. system None takes
    the model's recommended system prompt (if any)."""

    def __init__(
        self, serving: Serving, system: str | None = None, n_ctx: int | None = None
    ) -> None:
        self.serving = serving = _serving(serving)
        self.engine = e = serving.engine
        self.system = system if system is not None else e.settings.system
        n = e.n_ctx if n_ctx is None else min(int(n_ctx), e.spec.context_length)
        self.cache = e.new_cache(n)
        self.messages: list[dict[str, str]] = []
        self.last: Request | None = None

    # -- prompts ----------------------------------------------------------------------
    def _conversation(self) -> list[dict[str, str]]:
        if self.system:
            return [{"role": "system", "content": self.system}, *self.messages]
        return list(self.messages)

    def prompt_ids(self) -> list[int]:
        """The token ids of the conversation so far, ready for the assistant's turn."""
        return self.engine.encode_chat(self._conversation())

    def _prefix_len(self, ids: Sequence[int]) -> int:
        return system_prefix_len(self.engine, self._conversation(), ids)

    @property
    def stats(self) -> ResponseStats | None:
        """The last response's stats (tokens, tok/s, TTFT, peak RSS)."""
        return self.last.stats if self.last is not None else None

    # -- turns ------------------------------------------------------------------------
    def _submit(
        self,
        text: str,
        max_tokens: int,
        on_token: Callable[[str], None] | None,
        stop: Sequence[str],
        seed: int | None,
        sampling: dict[str, Any],
    ) -> Request:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"a message must be a string, got {type(text).__name__}")
        self._check_idle()
        _check_max_tokens(max_tokens)
        sampling = dict(sampling)
        fmt = sampling.pop("response_format", None)
        self.engine.settings.sampling(seed, **sampling)  # bad values fail before the history
        if fmt is not None:  # compiled (or refused) before the history changes
            sampling["constraint"] = response_format_constraint(self.engine.tokenizer, fmt)
        self.messages.append({"role": "user", "content": text})
        try:
            return self._complete(
                self.prompt_ids(), max_tokens, stop, seed, on_token, self._finished, sampling
            )
        except BaseException:
            self.messages.pop()
            raise

    def _check_idle(self) -> None:
        if self.last is not None and not self.last.finished.is_set():
            raise InvalidArgumentError(
                "this session is still answering; wait for it or cancel it first"
            )

    def complete(
        self,
        ids: Sequence[int],
        max_tokens: int = 512,
        stop: Sequence[str] = (),
        seed: int | None = None,
        on_token: Callable[[str], None] | None = None,
        **sampling: Any,
    ) -> Request:
        """Generate after the token ids `ids` on this session's cache, leaving the history
        to the caller (an app that edits and re-renders its own conversation). The cache's
        common prefix with `ids` is reused."""
        self._check_idle()
        return self._complete(ids, max_tokens, stop, seed, on_token, None, sampling)

    def _complete(self, ids, max_tokens, stop, seed, on_token, on_finish, sampling) -> Request:
        _check_max_tokens(max_tokens)
        sampling = dict(sampling)
        constraint = sampling.pop("constraint", None)
        fmt = sampling.pop("response_format", None)
        if fmt is not None:
            constraint = response_format_constraint(self.engine.tokenizer, fmt)
        params = self.engine.settings.sampling(seed, **sampling)
        self.last = self.serving.scheduler.submit(
            ids,
            params,
            max_tokens,
            stop,
            cache=self.cache,
            prefix_len=self._prefix_len(ids),
            on_token=on_token,
            on_finish=on_finish,  # set before the scheduler can finish it
            constraint=constraint,
        )
        return self.last

    def _finished(self, r: Request) -> None:
        if r.stats.finish_reason == "error":
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": r.text})

    def send(
        self,
        text: str,
        stream: bool = False,
        max_tokens: int = 512,
        on_token: Callable[[str], None] | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        **sampling: Any,
    ) -> str | Request:
        """Add a user message and answer it.

        stream False returns the answer's text; True returns the Request: iterate it for
        text pieces, `cancel()` it from any thread, read `.stats`. on_token(piece) is called
        for each piece in the thread that consumes them. Sampling keywords (temperature,
        top_k, top_p, min_p, repeat_penalty) default to the model's recommended settings.
        response_format (OpenAI's shape, as Model.chat takes it) constrains the answer.
        """
        r = self._submit(text, max_tokens, on_token, stop, seed, sampling)
        return r if stream else r.wait()

    async def astream(
        self,
        text: str,
        max_tokens: int = 512,
        on_token: Callable[[str], None] | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
        **sampling: Any,
    ) -> AsyncIterator[str]:
        """`async for piece in session.astream(text)`: never blocks the event loop.
        Leaving the loop early (or the task being cancelled) cancels the request."""
        r = self._submit(text, max_tokens, on_token, stop, seed, sampling)
        async for piece in r:
            yield piece

    def cancel(self) -> None:
        """Cancel the answer in progress, if any (safe from any thread)."""
        if self.last is not None:
            self.last.cancel()

    def reset(self, system: str | None = None) -> None:
        """Forget the conversation (and optionally change the system prompt)."""
        self.cancel()
        if self.last is not None:
            self.last.finished.wait(timeout=30)
        if system is not None:
            self.system = system
        self.messages.clear()
        self.cache.clear()
        self.last = None

    # -- persistence --------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write history and KV cache to `path` (safetensors), atomically.

        The rows go to the file a layer and head at a time, and the file's pages leave
        the page cache once written: saving holds no copy of the KV cache (under a RAM
        budget a 2,048-token chat of the 1.5B is 56 MiB, which the budget does not have
        twice; safetensors' save_file built the whole file in memory from a copy)."""
        if self.last is not None and not self.last.finished.is_set():
            raise InvalidArgumentError("cannot save a session while it is answering")
        c = self.cache
        with c.lock:  # rows and tokens of one moment (a spilled cache is read from disk)
            n = c.length
            tokens = list(c.tokens)
            meta = {
                "format": SESSION_FORMAT,
                "model": self.engine.identity,
                "model_name": self.engine.name,
                "kv_type": c.kv_type,
                "kv_rotation": ROTATION,  # how q8_0 / q4_0 rows are stored (kv_blocks)
                "kv_key_centre": c.key_centre_name,  # what the key rows hold less (kvcache)
                # log2 of what the key rows were divided by (kvcache.key_scale; null: 1)
                "kv_key_scale": json.dumps(c.key_scale_exponents),
                "n_ctx": str(c.n_ctx),
                "tokens": json.dumps(tokens),
                "messages": json.dumps(self.messages, ensure_ascii=False),
                "system": json.dumps(self.system),
            }
            header = {"__metadata__": meta}
            at = 0
            for name, rows, t in (("k", c.k, c.k_type), ("v", c.v, c.v_type)):
                layers, heads, _, width = rows.shape
                nbytes = layers * heads * n * width * rows.itemsize
                header[name] = {
                    "dtype": _SAVED_DTYPES[t],
                    "shape": [layers, heads, n, width],
                    "data_offsets": [at, at + nbytes],
                }
                at += nbytes
            states = c.state.arrays()  # a hybrid model's recurrent states, after the rows
            for key, a in states.items():
                header[f"state.{key}"] = {
                    "dtype": "F32",
                    "shape": list(a.shape),
                    "data_offsets": [at, at + a.nbytes],
                }
                at += a.nbytes
            head = json.dumps(header, separators=(",", ":")).encode()
            head += b" " * (-len(head) % 8)  # the data 8-byte aligned (spec: space padding)

            def write(p: Path) -> None:
                with open(p, "wb") as f:
                    f.write(len(head).to_bytes(8, "little"))
                    f.write(head)
                    kv_spill.write_rows(c, f)
                    for a in states.values():
                        f.write(np.ascontiguousarray(a, np.float32).tobytes())

            out = write_atomic(path, write)
        drop_page_cache([out])
        return out

    @classmethod
    def load(cls, model: Serving | Any, path: str | os.PathLike) -> Session:
        """Resume a saved session on `model` (a loaded edgerun.Model, or its Serving: the
        same model file it was saved from)."""
        serving = _serving(model)
        engine = serving.engine
        path = Path(path)
        meta, tensors = _read_session_header(path)
        where = f"session file {path}"
        if meta.get("format") != SESSION_FORMAT:
            raise SessionFileError(
                f"{where}: field 'format' is {meta.get('format')!r}, expected {SESSION_FORMAT!r}"
            )
        if meta.get("model") != engine.identity:
            raise SessionFileError(
                f"{where} was saved from model {meta.get('model_name')!r} "
                f"(identity {meta.get('model')}), but the loaded model is {engine.name!r} "
                f"(identity {engine.identity}); load it with the model it was saved from"
            )
        tokens = _json_field(meta, "tokens", list, where)
        messages = _json_field(meta, "messages", list, where)
        system = _json_field(meta, "system", (str, type(None)), where)
        try:
            n_ctx = int(meta.get("n_ctx", ""))
        except ValueError:
            raise SessionFileError(f"{where}: field 'n_ctx' is not an integer") from None
        kv_type = meta.get("kv_type")
        try:
            saved_types = dict(zip(("k", "v"), kv_types(kv_type)))
        except InvalidArgumentError:
            raise SessionFileError(
                f"{where}: field 'kv_type' is {kv_type!r}, expected one of "
                f"{', '.join(KV_TYPES)} or 'K/V'"
            ) from None
        # a file without the field holds its q8_0 / q4_0 rows unrotated: they are turned
        # as they are read (_read_rows_into)
        saved_rotation = meta.get("kv_rotation")
        if saved_rotation not in (None, ROTATION):
            raise SessionFileError(
                f"{where}: field 'kv_rotation' is {saved_rotation!r}, expected {ROTATION!r} "
                "(or none: rows stored unrotated); resume it with the edgerun that saved it "
                "and save it as f16, or start it anew"
            )
        # the centre the saved key rows were stored less of; an older file's keys have none
        centre_name = meta.get("kv_key_centre", "none")
        saved_centre = engine.transformer.key_centres if centre_name == KEY_CENTRE else None
        if centre_name not in ("none", KEY_CENTRE) or (
            centre_name == KEY_CENTRE and saved_centre is None
        ):
            raise SessionFileError(
                f"{where}: field 'kv_key_centre' is {centre_name!r}, expected 'none' or "
                f"{KEY_CENTRE!r} (a model with a k bias); resume it with the edgerun and "
                "model that saved it and save it as f16, or start it anew"
            )
        s = engine.spec
        saved_scale = _key_scale_field(meta, where, s)
        n = len(tokens)
        state_tensors = {k: tensors.pop(k) for k in list(tensors) if k.startswith("state.")}
        for name, (dtype, shape, _) in tensors.items():
            t = saved_types[name]
            want = (len(s.attention_layers), s.n_kv_heads, n, row_width(KV_TYPES[t], s.head_dim))
            if shape != want or _SAVED_DTYPES[t] != _DTYPE_NAMES[dtype]:
                raise SessionFileError(
                    f"{where}: tensor '{name}' has shape {shape} and dtype "
                    f"{_DTYPE_NAMES[dtype]}, expected {want} and {_SAVED_DTYPES[t]} "
                    f"({n} tokens of a {t} cache)"
                )
        if not all(isinstance(t, int) and 0 <= t < s.vocab_size for t in tokens):
            raise SessionFileError(f"{where}: field 'tokens' holds ids outside the vocabulary")
        for i, msg in enumerate(messages):
            if not (
                isinstance(msg, dict)
                and isinstance(msg.get("role"), str)
                and isinstance(msg.get("content"), str)
            ):
                raise SessionFileError(f"{where}: messages[{i}] is not a role/content message")
        if n > min(n_ctx, s.context_length) or n_ctx < 1:
            raise SessionFileError(f"{where}: {n} cached tokens do not fit n_ctx {n_ctx}")
        sess = cls(serving, system=system if system is not None else "", n_ctx=n_ctx)
        sess.system = system
        c = sess.cache
        engine.before_kv_write(c, n)
        _read_rows_into(
            path, tensors, saved_types, c, n, saved_centre, saved_scale, saved_rotation is not None
        )
        c.mark_written(n)
        c.tokens[:] = tokens
        if state_tensors or c.state.recurrent:  # a hybrid model's recurrent states
            try:
                c.state.load(_read_states(path, state_tensors), where)
            except ModelFormatError as e:
                raise SessionFileError(str(e)) from None
        sess.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        return sess


def _check_max_tokens(n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise InvalidArgumentError(f"max_tokens must be a positive integer, got {n!r}")


def _json_field(meta: dict, key: str, kind: Any, where: str) -> Any:
    raw = meta.get(key)
    if raw is None:
        raise SessionFileError(f"{where}: field '{key}' is missing")
    try:
        val = json.loads(raw)
    except ValueError as e:
        raise SessionFileError(f"{where}: field '{key}' is not valid JSON ({e})") from None
    if not isinstance(val, kind):
        raise SessionFileError(f"{where}: field '{key}' has type {type(val).__name__}")
    return val


# A cache type's rows in the file: f16 as F16 (its bits), q8_0 / q4_0 blocks as the raw
# bytes of their rows (I8 / U8 [layers, heads, tokens, row bytes]); "kv_type" says which.
_SAVED_DTYPES = {"f32": "F32", "f16": "F16", "q8_0": "I8", "q4_0": "U8"}
_DTYPES = {"F16": np.float16, "F32": np.float32, "I8": np.int8, "U8": np.uint8}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _read_session_header(path: Path) -> tuple[dict, dict[str, tuple[np.dtype, tuple, int]]]:
    """The metadata and the k / v tensors' (dtype, shape, file offset) of a session file,
    read once and checked against the safetensors layout `save` writes; no row is read.
    (safetensors' own reader maps the file, so loading parses its header here.)"""
    where = f"session file {path}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            hlen = int.from_bytes(head, "little")
            if len(head) < 8 or hlen > min(_MAX_META, size - 8):
                raise SessionFileError(
                    f"{where} is truncated or not a session file (header length)"
                )
            header = json.loads(f.read(hlen))
    except OSError as e:
        raise SessionFileError(f"cannot read {where}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SessionFileError(f"{where} is corrupt: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SessionFileError(f"{where} is corrupt: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SessionFileError(f"{where} is corrupt: '__metadata__' is not a string map")
    states = sorted(k for k in header if k.startswith("state."))  # a hybrid's recurrent states
    if set(header) - set(states) != {"k", "v"}:
        raise SessionFileError(
            f"{where}: tensors {sorted(header)}, expected ['k', 'v'] and 'state.*' ones"
        )
    tensors = {}
    for name in ("k", "v", *states):
        info = header[name]
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            begin, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SessionFileError(
                f"{where}: tensor '{name}' has dtype {info.get('dtype')!r} (expected "
                f"{', '.join(_DTYPES)}), or a malformed shape / data_offsets"
            ) from None
        want = int(np.prod(shape)) * dtype.itemsize
        bad_rank = name in ("k", "v") and len(shape) != 4
        if bad_rank or stop - begin != want or begin < 0 or 8 + hlen + stop > size:
            raise SessionFileError(
                f"{where} is truncated or corrupt: tensor '{name}' of shape {shape} spans "
                f"bytes {begin}..{stop} of a {size - 8 - hlen}-byte data section"
            )
        tensors[name] = (dtype, shape, 8 + hlen + begin)
    return meta, tensors


def _read_states(
    path: Path, tensors: dict[str, tuple[np.dtype, tuple, int]]
) -> dict[str, np.ndarray]:
    """The recurrent states of a session file ('state.<layer>.<name>' float32 tensors),
    by StateCache.arrays' names."""
    out = {}
    with open(path, "rb") as f:
        for key, (dtype, shape, at) in tensors.items():
            if dtype != np.float32:
                raise SessionFileError(f"session file {path}: tensor '{key}' is not F32")
            f.seek(at)
            a = np.frombuffer(f.read(int(np.prod(shape)) * 4), np.float32)
            if a.size != int(np.prod(shape)):
                raise SessionFileError(f"session file {path} is truncated (tensor '{key}')")
            out[key.removeprefix("state.")] = a.reshape(shape).copy()
    return out


def _key_scale_field(meta: dict, where: str, spec: Any) -> np.ndarray | None:
    """The key scale a session file's key rows were divided by ('kv_key_scale': log2 of
    each, [attention layers, kv heads, head_dim]; missing or null: none)."""
    raw = meta.get("kv_key_scale")
    if raw is None:
        return None
    want = (len(spec.attention_layers), spec.n_kv_heads, spec.head_dim)
    try:
        exps = json.loads(raw)
        if exps is None:
            return None
        a = np.asarray(exps, np.int64)
    except (ValueError, TypeError):
        a = np.zeros(0, np.int64)
    if a.shape != want or np.abs(a).max(initial=0) > KEY_SCALE_LIMIT:
        raise SessionFileError(
            f"{where}: field 'kv_key_scale' is not null or integers in "
            f"[-{KEY_SCALE_LIMIT}, {KEY_SCALE_LIMIT}] of shape {list(want)}"
        )
    return np.exp2(a).astype(np.float32)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(a, b)


def _read_rows_into(
    path: Path,
    tensors: dict[str, tuple[np.dtype, tuple, int]],
    saved_types: dict[str, str],
    cache: KVCache,
    n: int,
    saved_centre: np.ndarray | None = None,
    saved_scale: np.ndarray | None = None,
    saved_rotated: bool = True,
) -> None:
    """Rows [0, n) of the session file's k and v (`tensors`, _read_session_header's, of
    the KV types `saved_types`; its key rows stored less `saved_centre` and over
    `saved_scale`, None: none; its q8_0 / q4_0 rows rotated, or plain where not
    saved_rotated) into the cache, a layer at a time, converted to the cache's own type,
    key centre and scale where any differs (through float32: a session saved with q8_0
    keys resumes on an f16 cache and back, its values rounded as that type rounds, the
    centre and scale undone and redone as each cache stores its keys), read with
    plain reads (not mapped: mapped pages would count in the process's RSS beside the
    cache) and dropped from the page cache as they are used: loading holds one layer's
    rows beyond the cache."""
    where = f"session file {path}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SessionFileError(f"cannot read {where}: {e.strerror or e}") from None
    try:
        for name, dst, cache_type in (("k", cache.k, cache.k_type), ("v", cache.v, cache.v_type)):
            _, shape, at = tensors[name]
            saved = saved_types[name]
            layer_rows = np.empty(shape[1:], KV_TYPES[saved])  # as a cache of it holds them
            for layer in range(dst.shape[0]):
                got = os.preadv(fd, [memoryview(layer_rows).cast("B")], at)
                if got != layer_rows.nbytes:
                    raise SessionFileError(f"{where} is truncated (tensor '{name}')")
                if hasattr(os, "posix_fadvise"):  # the rows just read, on this descriptor
                    os.posix_fadvise(fd, at, layer_rows.nbytes, os.POSIX_FADV_DONTNEED)
                at += layer_rows.nbytes
                centres = (saved_centre, cache.key_centre) if name == "k" else (None, None)
                scales = (saved_scale, cache.key_scale) if name == "k" else (None, None)
                plain = not saved_rotated and saved in QUANTISED_KV_TYPES
                if saved == cache_type and _same(*centres) and _same(*scales) and not plain:
                    dst[layer, :, :n] = layer_rows
                else:
                    hd = cache.spec.head_dim
                    floats = cache_floats(layer_rows, hd)  # R^T of the blocks' values
                    if plain:  # the blocks held the values themselves: R (R^T x)
                        floats = (floats @ rotation(hd).T).astype(np.float32)
                    if scales[0] is not None:
                        floats *= scales[0][layer][:, None, :]
                    if centres[0] is not None:
                        floats += centres[0][layer][:, None, :]
                    if centres[1] is not None:
                        floats -= centres[1][layer][:, None, :]
                    if scales[1] is not None:
                        floats /= scales[1][layer][:, None, :]
                    dst[layer, :, :n] = cache_values(floats, dst.dtype)
    except OSError as e:
        raise SessionFileError(f"{where} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
