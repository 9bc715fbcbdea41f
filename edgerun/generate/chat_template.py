"""Chat templates: a model's Jinja template rendered the way transformers renders it.

Templates come from model files, so they are untrusted code. They run in jinja2's
``ImmutableSandboxedEnvironment`` (any unsafe attribute access, ``''.__class__`` and the like,
raises at once instead of quietly rendering as an empty string), with no loader (``include``,
``import`` and ``extends`` are refused when the template is checked) and bounded work: the
sandbox's hooks (every call, attribute and item lookup, intercepted operator, filter and loop
step) check a wall-clock deadline of :data:`TIME_LIMIT_S`, every string, list or output they
see is capped in size, string/list repetition, ``+``, ``%`` and ``**`` are checked *before*
they allocate, and macros may nest only :data:`MAX_MACRO_DEPTH` deep. :func:`check_template`
compiles a template once, at load, and names what is wrong with it.

User text is data, not markup: :func:`encode_chat` renders the conversation and encodes it so
that a special-token string inside a message (``<|im_start|>``, ...) becomes ordinary text
tokens, while the template's own special tokens become control tokens.

There is deliberately no fallback template: a model without one gets a clear error that tells
the user to use raw mode (plain text in, no chat formatting).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from edgerun.errors import EdgerunError

__all__ = [
    "ChatTemplateError",
    "NoChatTemplateError",
    "check_template",
    "encode_chat",
    "render_chat",
]


class ChatTemplateError(EdgerunError):
    """A chat template that does not compile, raises, or does something the sandbox forbids."""


class NoChatTemplateError(ChatTemplateError):
    """The model ships no chat template."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # As transformers does: jinja's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# ------------------------------------------------------------------------------ limits
TIME_LIMIT_S = 1.0  # wall clock for one check or render
MAX_TEMPLATE_CHARS = 256 * 1024  # real chat templates are a few KiB, the largest ~50 KiB
MIN_SIZE_CAP = 1 << 18  # characters (or items) any one value or the output may reach ...
SIZE_CAP_PER_INPUT_CHAR = 8  # ... or this many times the conversation's own text, if more
WORK_PER_SIZE_CAP = 64  # all values the hooks see may add up to this many size caps
MAX_MACRO_DEPTH = 64
MAX_INT_BITS = 1 << 16  # integers a template computes (10 ** 10 ** 10 is refused)
_MAX_JSON_INDENT = 64


class _LimitExceeded(Exception):
    """A template went over a work limit (time, size, recursion)."""


class _Budget:
    """The limits of one check or render; the sandbox hooks consult it."""

    __slots__ = ("deadline", "cap", "work_left", "depth")

    def __init__(self, cap: int = MIN_SIZE_CAP, seconds: float = TIME_LIMIT_S) -> None:
        self.deadline = time.monotonic() + seconds
        self.cap = cap
        self.work_left = cap * WORK_PER_SIZE_CAP
        self.depth = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"it ran longer than the {TIME_LIMIT_S:g} s limit")

    def size(self, n: int, what: str) -> None:
        """Refuse a value of ``n`` characters/items before it is made."""
        if n > self.cap:
            raise _LimitExceeded(f"{what} would be {n} long, over the limit of {self.cap}")

    def account(self, value: Any) -> Any:
        if isinstance(value, str | bytes | list | tuple | dict | set | frozenset):
            n = len(value)
            self.size(n, f"a {type(value).__name__}")
            self.work_left -= n
            if self.work_left < 0:
                raise _LimitExceeded(
                    f"it built more than {self.cap * WORK_PER_SIZE_CAP} characters/items of "
                    "values in all"
                )
        return value


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "edgerun_template_budget", default=None
)


def _current() -> _Budget:
    b = _budget.get()
    if b is None:  # the environment used outside check/render: still bounded in size
        b = _Budget()
    return b


_SIZED = (str, bytes, list, tuple)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?")


def _check_percent(fmt: str, budget: _Budget) -> None:
    """``fmt % args``: refuse widths/precisions that would allocate beyond the cap."""
    total = len(fmt)
    for width, prec in _PERCENT_SPEC.findall(fmt):
        if "*" in (width, prec):
            raise _LimitExceeded("'%' formatting with a '*' width is not allowed")
        total += int(width or 0) + int(prec or 0)
    budget.size(total, "a '%'-formatted string")


def _check_braces(fmt: str, budget: _Budget) -> None:
    """``fmt.format(...)``: refuse nested or huge widths before formatting."""
    total = len(fmt)
    try:
        parts = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # format() raises the same error itself
    for _literal, _field, spec, _conv in parts:
        if spec:
            if "{" in spec:
                raise _LimitExceeded("str.format with a nested width is not allowed")
            total += sum(int(d) for d in re.findall(r"\d+", spec))
    budget.size(total, "a formatted string")


def _check_replace(s: str, old: str, new: str, count: int | None, budget: _Budget) -> None:
    if not isinstance(s, str) or not isinstance(old, str) or not isinstance(new, str):
        return
    if len(new) <= len(old):
        return
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    budget.size(len(s) + hits * (len(new) - len(old)), "a replaced string")


def _check_join(items: Any, sep: Any, budget: _Budget) -> None:
    if isinstance(items, list | tuple) and isinstance(sep, str):
        n = len(sep) * max(0, len(items) - 1)
        for x in items:
            n += len(x) if isinstance(x, str) else 16
            if n > budget.cap:
                break
        budget.size(n, "a joined string")


def _check_binop(op: str, a: Any, b: Any, budget: _Budget) -> None:
    """Refuse an intercepted operation whose result would be too big, before computing it."""
    if op == "*":
        if isinstance(a, int) and isinstance(b, _SIZED):
            a, b = b, a
        if isinstance(a, _SIZED) and isinstance(b, int):
            budget.size(len(a) * max(0, b), f"a repeated {type(a).__name__}")
        elif isinstance(a, int) and isinstance(b, int):
            if a.bit_length() + b.bit_length() > MAX_INT_BITS:
                raise _LimitExceeded(f"an integer product over {MAX_INT_BITS} bits")
    elif op == "**":
        if isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 0:
            if b * a.bit_length() > MAX_INT_BITS:
                raise _LimitExceeded(f"an integer power over {MAX_INT_BITS} bits")
    elif op == "+":
        if isinstance(a, _SIZED) and isinstance(b, _SIZED):
            budget.size(len(a) + len(b), f"a concatenated {type(a).__name__}")
    elif op == "%":
        if isinstance(a, str):
            _check_percent(a, budget)


# str methods that can make a string far longer than their inputs, and their width arguments
_WIDENING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _check_method(obj: Any, args: tuple, kwargs: dict, budget: _Budget) -> None:
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str | bytes):
        return
    name = getattr(obj, "__name__", "")
    if name in _WIDENING_METHODS:
        for v in (*args, *kwargs.values()):
            if isinstance(v, int):
                n = v * (owner.count("\t") + 1) if name == "expandtabs" else v
                budget.size(len(owner) + n, f"a str.{name}() result")
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1], args[2] if len(args) > 2 else None, budget)
    elif name == "join" and args:
        _check_join(args[0], owner, budget)


def _filter_checks(name: str, args: tuple, kwargs: dict, budget: _Budget) -> None:
    """Pre-checks for the built-in filters that can amplify their input."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    value = arg(0, "value")
    if name == "center":
        w = arg(1, "width", 80)
        if isinstance(w, int):
            budget.size(w, "a centered string")
    elif name == "indent":
        w = arg(1, "width", 4)
        n = w if isinstance(w, int) else len(w) if isinstance(w, str) else 0
        lines = value.count("\n") + 1 if isinstance(value, str) else 1
        budget.size((len(value) if isinstance(value, str) else 0) + n * lines, "an indented string")
    elif name == "wordwrap":
        wrap = arg(3, "wrapstring") or "\n"
        if isinstance(value, str) and isinstance(wrap, str):
            budget.size(len(value) * (len(wrap) + 1), "a wrapped string")
    elif name in ("batch", "slice"):
        n = arg(1, "linecount" if name == "batch" else "slices", 0)
        if isinstance(n, int):
            budget.size(n, f"a '{name}' count")
    elif name == "format" and isinstance(value, str):
        _check_percent(value, budget)
    elif name == "replace":
        _check_replace(value, arg(1, "old"), arg(2, "new"), arg(3, "count"), budget)
    elif name == "join":
        _check_join(value, arg(1, "d", ""), budget)
    elif name == "tojson":
        indent = arg(2, "indent")
        if isinstance(indent, int | str) and not isinstance(indent, bool):
            n = indent if isinstance(indent, int) else len(indent)
            if n > _MAX_JSON_INDENT:
                raise _LimitExceeded(f"tojson indent {n} is over {_MAX_JSON_INDENT}")


def _bounded(name: str, func: Any) -> Any:
    """A filter or global that checks the budget before and accounts its result after."""

    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(func) is None else 1  # context/environment comes first

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _current()
        budget.tick()
        _filter_checks(name, args[skip:], kwargs, budget)
        return budget.account(func(*args, **kwargs))

    return wrapper


def _ticking(iterable: Any) -> Any:
    """What every ``{% for %}`` loop iterates: the template's iterable, one clock check per
    item (a loop with an empty body has no other hook)."""
    budget = _current()
    for item in iterable:
        budget.tick()
        yield item


_TICKING_NAME = "_edgerun_loop_guard"
_LOADER_NODES = ("Include", "Import", "FromImport", "Extends")


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.runtime import Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker).

        It only marks text for training masks; for inference it renders its body unchanged.
        """

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class _BoundedCodeGenerator(CodeGenerator):
        """Compiles ``a ~ b`` to a size-checked join (jinja's own ``str_join`` has no hook)."""

        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class _StrictSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
            raise SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object "
                "is not allowed"
            )

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _current()
            budget.tick()
            _check_binop(operator, left, right, budget)
            return budget.account(super().call_binop(context, operator, left, right))

        def getattr(self, obj: Any, attribute: str) -> Any:
            _current().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            budget = _current()
            budget.tick()
            value = super().getitem(obj, argument)
            return budget.account(value) if isinstance(argument, slice) else value

        def wrap_str_format(self, value: Any) -> Any:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            @functools.wraps(wrapped)
            def checked(*args: Any, **kwargs: Any) -> Any:
                budget = _current()
                _check_braces(fmt, budget)
                return budget.account(wrapped(*args, **kwargs))

            return checked

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            budget = _current()
            budget.tick()
            _check_method(__obj, args, kwargs, budget)
            if isinstance(__obj, Macro):
                budget.depth += 1
                try:
                    if budget.depth > MAX_MACRO_DEPTH:
                        raise _LimitExceeded(f"macros nested deeper than {MAX_MACRO_DEPTH}")
                    return budget.account(super().call(__context, __obj, *args, **kwargs))
                finally:
                    budget.depth -= 1
            return budget.account(super().call(__context, __obj, *args, **kwargs))

        def bounded_concat(self, parts: Any) -> str:
            budget = _current()
            budget.tick()
            pieces = [p if isinstance(p, str) else str(p) for p in parts]
            budget.size(sum(len(p) for p in pieces), "a '~' concatenation")
            return budget.account("".join(pieces))

    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals.pop("lipsum", None)  # generates text of any size on request
    for table in (env.filters, env.globals):
        for name, func in list(table.items()):
            if callable(func) and not isinstance(func, type):
                table[name] = _bounded(name, func)
    env.globals[_TICKING_NAME] = _ticking
    return env


def _guard_loops(tree: Any) -> None:
    """Make each ``{% for %}`` iterate through :func:`_ticking` (a clock check per item)."""
    from jinja2 import nodes

    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(
            nodes.Name(_TICKING_NAME, "load", lineno=loop.lineno),
            [loop.iter],
            [],
            None,
            None,
            lineno=loop.lineno,
        )


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"the model's chat template is {len(template)} characters long, over the limit of "
            f"{MAX_TEMPLATE_CHARS}"
        )
    env = _environment()
    token = _budget.set(_Budget())
    try:
        tree = env.parse(template)
        for kind in _LOADER_NODES:
            node = next(tree.find_all(getattr(nodes, kind)), None)
            if node is not None:
                tag = {"FromImport": "from ... import", "Extends": "extends"}.get(kind, kind)
                raise ChatTemplateError(
                    f"the model's chat template uses {{% {tag.lower()} %}} (line {node.lineno}), "
                    "which is not allowed: templates must be self-contained (no loader)"
                )
        _guard_loops(tree)
        return env.from_string(tree)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the model's chat template does not compile (line {e.lineno}): {e.message}"
        ) from None
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
    except _LimitExceeded as e:
        raise ChatTemplateError(f"the model's chat template is refused: {e}") from None
    except (RecursionError, MemoryError):
        raise ChatTemplateError("the model's chat template is nested too deeply") from None
    finally:
        _budget.reset(token)


def check_template(template: str) -> None:
    """Compile a model's chat template once, at load, so that a bad one is reported then.

    Raises :class:`ChatTemplateError` naming the problem: not a string, too long, a syntax
    error, or ``include``/``import``/``extends`` (templates get no loader). Compiled templates
    are cached, so rendering later does not compile again.
    """
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a str, got {type(template).__name__}")
    _compile(template)


def _text_size(value: Any, depth: int = 0) -> int:
    """Characters of text in a conversation (strings in nested dicts/lists), to scale caps."""
    if isinstance(value, str):
        return len(value)
    if depth > 32:
        return 0
    if isinstance(value, dict):
        return sum(_text_size(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_size(v, depth + 1) for v in value)
    return 0


def render_chat(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``).

    ``template`` is the model's Jinja chat template (``Tokenizer.chat_template``). ``extra``
    variables (``tools``, ``documents``, ...) are passed to the template as they are.
    Raises :class:`NoChatTemplateError` when ``template`` is empty and :class:`ChatTemplateError`
    for any failure inside the template, including going over its time or size limits.
    The text is for display or raw use; to feed a model, use :func:`encode_chat`, which keeps
    special-token strings in user text from becoming control tokens.
    """
    if not template:
        raise NoChatTemplateError(
            "this model has no chat template, so chat messages cannot be formatted for it; "
            "use raw mode (give the prompt text exactly as the model should see it) instead"
        )
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a str, got {type(template).__name__}")
    if not isinstance(messages, list | tuple) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError(
            "messages must be a list of dicts like {'role': ..., 'content': ...}"
        )

    from jinja2.exceptions import SecurityError, TemplateError

    compiled = _compile(template)
    size = _text_size(list(messages)) + _text_size(extra)
    budget = _Budget(cap=max(MIN_SIZE_CAP, SIZE_CAP_PER_INPUT_CHAR * size))
    token = _budget.set(budget)
    try:
        out: list[str] = []
        n = 0
        for chunk in compiled.generate(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        ):
            budget.tick()
            n += len(chunk)
            budget.size(n, "the rendered prompt")
            out.append(chunk)
        return "".join(out)
    except _LimitExceeded as e:
        raise ChatTemplateError(f"the chat template was stopped: {e}") from None
    except SecurityError as e:
        raise ChatTemplateError(
            f"the chat template tried something unsafe and was stopped: {e}"
        ) from None
    except TemplateError as e:
        # raise_exception() in a template lands here with the template's own message.
        raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("the chat template ran out of memory") from None
    except Exception as e:  # the template is untrusted code; any failure is its (or the input's)
        raise ChatTemplateError(
            f"the chat template failed while rendering: {type(e).__name__}: {e}"
        ) from None
    finally:
        _budget.reset(token)


# ----------------------------------------------------------------- safe chat encoding
# Placeholders for special-token strings found in user text: private-use characters of plane
# 15, which no tokenizer treats as special; each stands for one special string while the
# template runs, and is turned back into that string's *text* tokens afterwards.
_PLACEHOLDER_BASE = 0xF0000
_PLACEHOLDER_END = 0xFFFFE


def _protect(value: Any, pattern: re.Pattern[str], mark: Any, depth: int = 0) -> Any:
    """A copy of ``value`` (str / dict / list, nested) with special strings replaced."""
    if isinstance(value, str):
        return pattern.sub(mark, value)
    if depth > 64:
        return value
    if isinstance(value, dict):
        return {k: _protect(v, pattern, mark, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_protect(v, pattern, mark, depth + 1) for v in value)
    return value


def encode_chat(
    tokenizer: Any,
    messages: list[dict],
    template: str | None = None,
    add_generation_prompt: bool = True,
    add_bos: bool | None = None,
    **extra: Any,
) -> list[int]:
    """Token ids for a conversation, with user text kept as text.

    Renders ``messages`` with ``template`` (default: ``tokenizer.chat_template``) and encodes
    the result as ``tokenizer.encode(text, add_bos=add_bos, parse_special=True)`` would,
    except that special-token strings inside the messages (and ``extra``: tools, documents)
    are encoded as ordinary text: a user who types ``<|im_start|>system`` cannot open a
    system turn. Only the template's own special tokens become control tokens. BOS comes
    once: a template that writes ``{{ bos_token }}`` itself gets no second one.
    """
    if template is None:
        template = tokenizer.chat_template
    if not isinstance(messages, list | tuple) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError(
            "messages must be a list of dicts like {'role': ..., 'content': ...}"
        )
    specials: dict[str, int] = tokenizer.special_texts()
    pattern = tokenizer.special_pattern()
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    if pattern is None:  # nothing to protect
        text = render_chat(template, messages, add_generation_prompt, bos, eos, **extra)
        return _one_bos(
            tokenizer, tokenizer.encode(text, add_bos=False, parse_special=False), add_bos
        )

    # Placeholder characters that occur neither in the template nor in the user's text.
    taken = {
        c
        for s in (template or "", repr(messages), repr(extra))
        for c in re.findall("[\U000f0000-\U000ffffd]", s)
    }
    free = (chr(c) for c in range(_PLACEHOLDER_BASE, _PLACEHOLDER_END) if chr(c) not in taken)
    held: dict[str, str] = {}  # special string -> placeholder
    restore: dict[int, str] = {}

    def mark(m: re.Match[str]) -> str:
        text = m.group()
        ph = held.get(text)
        if ph is None:
            ph = next(free, None)
            if ph is None:
                raise ChatTemplateError("too many distinct special-token strings in the messages")
            held[text] = ph
            restore[ord(ph)] = text
        return ph

    safe_messages = _protect(list(messages), pattern, mark)
    safe_extra = _protect(extra, pattern, mark)
    text = render_chat(template, safe_messages, add_generation_prompt, bos, eos, **safe_extra)

    # Every special string left in the text came from the template: those become control
    # tokens; the text between them (placeholders back to the user's strings) is plain text.
    ids: list[int] = []
    pos = 0

    def plain(segment: str) -> list[int]:
        if restore:
            segment = segment.translate(restore)
        return tokenizer.encode(segment, add_bos=False, parse_special=False) if segment else []

    for m in pattern.finditer(text):
        ids += plain(text[pos : m.start()])
        ids.append(specials[m.group()])
        pos = m.end()
    ids += plain(text[pos:])
    return _one_bos(tokenizer, ids, add_bos)


def _one_bos(tokenizer: Any, ids: list[int], add_bos: bool | None) -> list[int]:
    """``ids`` with BOS put first as ``add_bos`` says (None: the model's rule), unless the
    template already wrote it: Llama 3, Gemma, Mistral and Cohere templates start with
    ``{{ bos_token }}``, and a second BOS is input the model never saw in training (llama.cpp
    likewise drops the template's BOS when its tokenizer adds one). A BOS string in the
    messages is text by now (protected above), so a leading BOS id is the template's."""
    if tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id]:
        return ids
    return tokenizer._with_bos(ids, add_bos)
