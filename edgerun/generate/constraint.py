"""Constrained decoding: a grammar (JSON Schema, any JSON object, a regex, a Lark or GBNF
grammar) decides which tokens may come next, and the sampler only sees those.

The grammar engine is llguidance (Microsoft's, Rust, MIT; the optional extra
`pip install 'edgerun[structured]'`). Measured on this project's CPU against xgrammar
and outlines-core (docs/structured_output.md, `python benchmarks/structured_libs.py`):

    library        install                       schema compile    mask / token
                                                 SmolLM2  Qwen2.5  (median)
    llguidance     7.6 MB, no dependencies       1.3 ms   1.4 ms   23-29 us
    xgrammar       3.9 MB + torch, transformers, 42 ms    121 ms   3-4 us
                   tvm-ffi (~2 GB with CUDA)
    outlines-core  5.3 MB                        1.9 s    10.9 s   0.3 us (its index
                                                                   is precomputed)

llguidance builds a grammar lazily (a schema costs nothing up front, so a request never
waits seconds on its schema the way outlines-core's index makes it), needs no torch,
takes JSON Schema with $ref/anyOf/formats, Lark (with %json embedding) and llama.cpp's
GBNF, and has resource limits (ParserLimits) for hostile input; a 25 us mask is well
under one decode step. Linux aarch64 wheels on PyPI stop at 1.6.1 (manylinux_2_28;
macOS arm64 has 1.9.1), which this module's calls work with, hence `llguidance>=1.6`.

What lives here:
- `Constraint`: one compiled grammar for one tokenizer; immutable, shared by the
  requests that ask for the same thing. Built by `Constraint.json_schema(...)`,
  `.json_object(...)`, `.regex(...)`, `.grammar(...)`, or `constraint_from(...)`.
- `GrammarMatcher`: one sequence's position in the grammar. After each sampled token it
  advances; with OVERLAP_MASKS (a CPU to spare) it starts the next mask on a worker
  thread (llguidance releases the GIL) so the mask is ready when the model's next logits
  are, otherwise it computes it when they arrive (0.15-0.25 ms a token on SmolLM2: on
  2 vCPUs, where the forward pass's threads hold both, a worker waited 1-4 ms a token to
  be scheduled). `compute_seconds` vs `wait_seconds` say how much was overlapped.
- `allows(tokens)`: how many of a drafted token list the grammar accepts, so a
  speculative loop can cut a draft at the first token the grammar refuses.

Sequence.step (sequence.py) applies the mask before the sampler, so every driver (the
single-stream generator, the batching scheduler, a per-position speculative verify) is
constrained the same way.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from edgerun.errors import EdgerunError, InvalidArgumentError
from edgerun.tokenizer import Tokenizer

__all__ = [
    "COMPILE_SECONDS",
    "Constraint",
    "GrammarMatcher",
    "INSTALL_HINT",
    "MAX_GRAMMAR_CHARS",
    "constraint_from",
    "response_format_constraint",
]

INSTALL_HINT = "pip install 'edgerun[structured]'"
# A grammar must compile, and give its first mask, within this many seconds; past it the
# request is refused (llguidance's fuel limits bound each step as well).
COMPILE_SECONDS = 10.0
# The longest schema / grammar / regex text accepted (a 10^5-member enum is ~1 MB).
MAX_GRAMMAR_CHARS = 1 << 20
# JSON whitespace the grammar allows between tokens: bounded, so a small model cannot
# loop on newlines forever inside an object (enough for pretty-printing 9 levels deep).
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"

# Whether a matcher computes its next mask on a worker thread while the forward pass runs
# (True) or when the logits arrive (False). With no core to spare (the forward pass's
# threads on every CPU) the worker waits for the OS to schedule it, which on 2 vCPUs cost
# more per token (1-4 ms) than the mask itself (0.15 ms, SmolLM2), so it overlaps only
# where a CPU is left over; GrammarMatcher(overlap=...) chooses per matcher.
OVERLAP_MASKS = (os.cpu_count() or 1) > 2

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edgerun-mask")
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise EdgerunError(
            "constrained output (json_schema, response_format, regex, grammar) needs the "
            f"llguidance library: {INSTALL_HINT}"
        ) from None
    return llguidance


def _limits(llg):
    """llguidance's resource limits, set so a hostile grammar is refused, not run: each
    mask step's lexer fuel and Earley items, the lexer's states (memory) and the grammar's
    size."""
    return llg.LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=100_000,
        max_grammar_size=500_000,
        verbose_errors=False,  # a message, not the parser's state dump
    )


class _TokenizerView:
    """What llguidance's LLTokenizer reads from a tokenizer: each token's bytes (control
    tokens marked with a leading 0xFF so no grammar can spell them as text), EOS, BOS, and
    an encoder for the strings a grammar forces."""

    def __init__(self, tok: Tokenizer) -> None:
        special = tok.special_ids
        self.tokens = [
            (b"\xff" + tok.token_bytes(i)) if i in special else tok.token_bytes(i)
            for i in range(tok.vocab_size)
        ]
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eos_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = sorted(special)
        self.is_tokenizer_wrapper = True
        self._tok = tok

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_bos=False, parse_special=False)


def llg_tokenizer(tok: Tokenizer) -> Any:
    """The llguidance tokenizer of `tok`, built once per tokenizer (Qwen2.5's 151k tokens:
    ~1.4 s, SmolLM2's 49k: ~0.3 s on this project's CPU) and kept while `tok` lives."""
    llg = _llguidance()
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(tok)
        if found is None:
            found = _TOKENIZERS[tok] = llg.LLTokenizer(_TokenizerView(tok))
        return found


def _text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} must be a string, found {type(value).__name__}")
    if not value.strip():
        raise InvalidArgumentError(f"{what} is empty")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidArgumentError(
            f"{what} has {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are accepted"
        )
    return value


# The most values (objects, arrays, scalars) a schema given as a Python object may hold,
# and its deepest nesting: a dict that shares sub-dicts can stand for a JSON text
# exponentially larger than itself, which is measured before it is written out.
MAX_SCHEMA_NODES = 200_000
MAX_SCHEMA_DEPTH = 200


def _check_size(schema: Any) -> None:
    count = 0
    todo = [(schema, 0)]
    while todo:
        node, depth = todo.pop()
        count += 1
        if count > MAX_SCHEMA_NODES or depth > MAX_SCHEMA_DEPTH:
            what = "values" if count > MAX_SCHEMA_NODES else "levels of nesting"
            most = MAX_SCHEMA_NODES if count > MAX_SCHEMA_NODES else MAX_SCHEMA_DEPTH
            raise InvalidArgumentError(f"json_schema has more than {most} {what}")
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list | tuple):
            todo.extend((v, depth + 1) for v in node)


# Bounds a value gets where its schema sets none, each the standard's own limit: an
# integer JSON's safe range (RFC 7493), an email address 254 characters (RFC 5321).
# Unbounded, a small model can write digits or an address's local part until max_tokens
# (SmolLM2 did, greedy, on a {"minimum": 1000} zip code and on a format "email").
SAFE_INTEGER = 2**53 - 1
MAX_EMAIL_CHARS = 254


def _bounded(schema: Any) -> Any:
    """A copy of `schema` with those bounds added (nothing else changes)."""
    if isinstance(schema, list):
        return [_bounded(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v) for k, v in schema.items()}
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "integer" in kinds:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    if schema.get("format") in ("email", "idn-email") and "maxLength" not in out:
        out["maxLength"] = MAX_EMAIL_CHARS
    return out


def _schema_text(schema: Any) -> str:
    """A JSON Schema (dict or JSON text) as JSON text, checked to be an object."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if isinstance(schema, dict):
        _check_size(schema)
        try:
            text = json.dumps(_bounded(schema))
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidArgumentError(f"json_schema cannot be written as JSON: {e}") from None
    else:
        text = _text(schema, "json_schema")
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise InvalidArgumentError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(parsed, dict | bool):
            raise InvalidArgumentError(
                f"json_schema must be a JSON object, found {type(parsed).__name__}"
            )
        if isinstance(parsed, dict):
            return _schema_text(parsed)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidArgumentError(
            f"json_schema has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted"
        )
    return text


class Constraint:
    """One grammar compiled for one tokenizer. `matcher()` gives a sequence its own
    position in it; the Constraint itself is never changed, so requests share it."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, kind: str) -> None:
        """grammar: llguidance's grammar text (from one of the class methods). Compiles it
        and computes its first mask within COMPILE_SECONDS, or raises InvalidArgumentError
        naming what is wrong with it."""
        llg = _llguidance()
        self.tokenizer = tokenizer
        self.kind = kind  # "json_schema", "json_object", "regex", "grammar"
        self.grammar = grammar
        self._llg = llg
        self._lltok = llg_tokenizer(tokenizer)
        self._limits = _limits(llg)
        self.vocab_size = tokenizer.vocab_size
        # Compile once here (with its first mask) so a bad grammar fails the request,
        # not the sequence; a matcher copies this one's compiled state.
        # On its own thread, not the mask pool: a compile past the time limit is left to
        # run out its fuel there without holding up other sequences' masks.
        future: Future = Future()
        threading.Thread(
            target=_run_into, args=(future, self._compile), name="edgerun-grammar", daemon=True
        ).start()
        try:
            self._root = future.result(timeout=COMPILE_SECONDS)
        except FutureTimeout:
            raise InvalidArgumentError(
                f"the {kind} took over {COMPILE_SECONDS:.0f} s to compile; simplify it"
            ) from None

    def _compile(self) -> Any:
        m = self._llg.LLMatcher(self._lltok, self.grammar, log_level=0, limits=self._limits)
        if not m.is_error():
            bits = np.empty((self.vocab_size + 31) // 32, np.int32)
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if m.is_error():
            raise InvalidArgumentError(f"invalid {self.kind}: {_first_line(m.get_error())}")
        m.reset()
        return m

    # -- building -------------------------------------------------------------------
    @classmethod
    def json_schema(cls, tokenizer: Tokenizer, schema: dict | str) -> Constraint:
        """Output that parses as JSON and validates against `schema` (a dict or JSON text)."""
        llg = _llguidance()
        text = _schema_text(schema)
        opts = {"whitespace_pattern": _JSON_WHITESPACE}
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=opts)
        except (ValueError, RecursionError) as e:
            raise InvalidArgumentError(f"invalid json_schema: {_first_line(str(e))}") from None
        return cls(tokenizer, grammar, "json_schema")

    @classmethod
    def json_object(cls, tokenizer: Tokenizer) -> Constraint:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema(tokenizer, {"type": "object"})

    @classmethod
    def regex(cls, tokenizer: Tokenizer, pattern: str) -> Constraint:
        """Output that matches `pattern` (Rust regex syntax) whole."""
        llg = _llguidance()
        return cls(tokenizer, llg.LLMatcher.grammar_from_regex(_text(pattern, "regex")), "regex")

    @classmethod
    def grammar(cls, tokenizer: Tokenizer, text: str) -> Constraint:
        """Output in the language of a Lark grammar (llguidance's dialect, with %json) or a
        llama.cpp GBNF grammar (told apart by its `::=` rules)."""
        llg = _llguidance()
        text = _text(text, "grammar")
        try:
            grammar = llg.grammar_from("grammar", text)
        except (ValueError, RecursionError) as e:
            raise InvalidArgumentError(f"invalid grammar: {_first_line(str(e))}") from None
        return cls(tokenizer, grammar, "grammar")

    def matcher(self, overlap: bool | None = None) -> GrammarMatcher:
        return GrammarMatcher(self, overlap)

    def allows(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the grammar's start, it accepts."""
        m = self._root.deep_copy()
        return int(m.validate_tokens([int(t) for t in tokens]))

    def __repr__(self) -> str:
        return f"Constraint({self.kind}, vocab={self.vocab_size})"


def _run_into(future: Future, fn: Any) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
        future.set_exception(e)


def _first_line(msg: str) -> str:
    """llguidance's error message, short and without its internal markers."""
    msg = msg.replace("<non-verbose/>", "").strip()
    if msg.startswith("NoExtensionBias"):  # its Earley parser's word for it
        msg = "it can match no text at all (a $ref or rule cycle with nothing in it)"
    return msg if len(msg) <= 400 else msg[:400] + "..."


class GrammarMatcher:
    """One sequence's position in a Constraint's grammar: the next token's mask (computed
    on a worker thread as soon as the previous token is consumed), `advance(token)`,
    `allows(draft)`, whether the grammar may end here (`accepting`) and whether it must
    (`finished`)."""

    def __init__(self, constraint: Constraint, overlap: bool | None = None) -> None:
        """overlap: compute each next mask on a worker thread (None: OVERLAP_MASKS)."""
        self.constraint = constraint
        self.overlap = OVERLAP_MASKS if overlap is None else overlap
        self._m = constraint._root.deep_copy()
        self._words = (constraint.vocab_size + 31) // 32
        self._pending: Future | None = None
        self.compute_seconds = 0.0  # mask computation, on the worker thread
        self.wait_seconds = 0.0  # what the sequence waited for masks after the first one
        self.masks = 0
        self.error = ""
        self._start_mask()

    def _start_mask(self) -> None:
        if self.overlap:
            self._pending = _POOL.submit(self._compute_mask)

    def _compute_mask(self) -> tuple[np.ndarray, bool]:
        t0 = time.perf_counter()
        bits = np.empty(self._words, np.int32)
        self._m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")
        allowed = allowed[: self.constraint.vocab_size].view(np.bool_)
        accepting = bool(self._m.is_accepting())
        self.compute_seconds += time.perf_counter() - t0
        return allowed, accepting

    def _settle(self) -> tuple[np.ndarray, bool] | None:
        """Wait for the mask in flight (if any) and return it."""
        f, self._pending = self._pending, None
        if f is None:
            return None
        t0 = time.perf_counter()
        # Not started yet (every core busy with the forward pass's threads): computing it
        # here is sooner than waiting for the worker to be scheduled.
        out = self._compute_mask() if f.cancel() else f.result()
        if self.masks:  # the first mask has no forward pass to hide behind
            self.wait_seconds += time.perf_counter() - t0
        self.masks += 1
        return out

    def mask_logits(self, logits: np.ndarray, eos_ids: Any = ()) -> np.ndarray | None:
        """`logits` with every token the grammar forbids here set to -inf (a new array);
        the ids in `eos_ids` are allowed exactly where the grammar may end. None when the
        grammar allows nothing (its error is in `self.error`)."""
        got = self._settle()
        if got is None:  # not overlapped: computed now
            got = self._compute_mask()
            self.masks += 1
        allowed, accepting = got
        n = logits.shape[0]
        for e in eos_ids:
            if 0 <= e < allowed.shape[0]:
                allowed[e] = accepting
        if n != allowed.shape[0]:  # the model's rows beyond the tokenizer's: never allowed
            full = np.zeros(n, np.bool_)
            k = min(n, allowed.shape[0])
            full[:k] = allowed[:k]
            allowed = full
        if not allowed.any():
            self.error = self._m.get_error() or "the grammar allows no next token"
            return None
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; start the next mask unless the grammar is finished.
        False (and `error` set) when the grammar refuses the token."""
        self._settle()
        if not self._m.consume_token(int(token)):
            self.error = self._m.get_error() or f"the grammar refuses token {token}"
            return False
        if not self._m.is_stopped():
            self._start_mask()
        return True

    def allows(self, tokens: list[int]) -> int:
        """How many of `tokens`, from here, the grammar accepts (a draft is cut there);
        the matcher does not move."""
        self._settle_keep()
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def _settle_keep(self) -> None:
        """Wait for the mask in flight without taking it (mask_logits still gets it)."""
        f = self._pending
        if f is not None:
            t0 = time.perf_counter()
            f.result()
            self.wait_seconds += time.perf_counter() - t0

    @property
    def accepting(self) -> bool:
        """The output so far is complete: the grammar may end here."""
        self._settle_keep()
        return bool(self._m.is_accepting())

    @property
    def finished(self) -> bool:
        """The grammar can take no more tokens: the sequence ends here."""
        self._settle_keep()
        return bool(self._m.is_stopped())

    def close(self) -> None:
        """Wait out a mask in flight (a sequence that ended mid-computation)."""
        self._settle_keep()


def constraint_from(
    tokenizer: Tokenizer,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    json_object: bool = False,
) -> Constraint | None:
    """The Constraint the arguments ask for (at most one of them), None for none."""
    given = [
        k
        for k, v in (
            ("json_schema", json_schema),
            ("regex", regex),
            ("grammar", grammar),
            ("json_object", json_object or None),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise InvalidArgumentError(f"give at most one of {', '.join(given)}, not all of them")
    if json_schema is not None:
        return Constraint.json_schema(tokenizer, json_schema)
    if regex is not None:
        return Constraint.regex(tokenizer, regex)
    if grammar is not None:
        return Constraint.grammar(tokenizer, grammar)
    if json_object:
        return Constraint.json_object(tokenizer)
    return None


def response_format_constraint(tokenizer: Tokenizer, response_format: Any) -> Constraint | None:
    """The Constraint of an OpenAI `response_format`: {"type": "text"} (none),
    {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}. Anything else is an InvalidArgumentError naming the
    field."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidArgumentError(
            f"response_format must be an object, found {type(response_format).__name__}"
        )
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(tokenizer)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgumentError(
                "response_format.json_schema must be an object with a 'schema' field"
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise InvalidArgumentError(
                "response_format.json_schema.schema must be a JSON Schema object, found "
                f"{type(schema).__name__}"
            )
        return Constraint.json_schema(tokenizer, schema)
    raise InvalidArgumentError(
        "response_format.type must be 'text', 'json_object' or 'json_schema', found "
        f"{json.dumps(kind)[:60]}"
    )
