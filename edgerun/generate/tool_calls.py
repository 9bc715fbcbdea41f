"""OpenAI tool calls on a model's own markup: checking a request's ``tools`` and
``tool_choice``, the messages a chat template reads, a streaming parser of the calls a model
writes, and the grammar that forces a valid call.

Each family writes its calls in its own markup (:class:`ToolMarkup`), picked from the
tokenizer's special tokens and the chat template's text (:func:`markup_for`), never from a
file name:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call
  (Qwen2.5, Qwen3, SmolLM3, Hermes);
- ``llama3``: ``<|python_tag|>`` or a bare ``{"name": ..., "parameters": {...}}`` answer,
  several separated by ``;`` (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Nemo) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (Small 3.2 and later);
- ``phi4``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`` (Phi-4-mini).

:class:`ToolCallParser` turns the model's text, piece by piece, into content and finished
calls. A call is handed out only once its markup closed and its JSON parsed (a valid call or
none): markup that does not parse comes back as content, so a model's broken output is never
an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from edgerun.errors import InvalidArgumentError

__all__ = [
    "MARKUPS",
    "ToolCall",
    "ToolCallParser",
    "ToolMarkup",
    "check_tool_choice",
    "check_tools",
    "markup_for",
    "parse_tool_calls",
    "template_messages",
    "tool_call_grammar",
]

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # as OpenAI's function names


@dataclass(frozen=True)
class ToolMarkup:
    """How one family writes tool calls.

    ``open``/``close`` surround the calls (``close`` None: they run to the end of the
    answer); ``bare_json``: an answer that starts with ``{`` is a call too (Llama 3, and
    small Hermes models that leave out the tags);
    ``args_key``: the key the family writes arguments under."""

    name: str
    open: str
    close: str | None
    args_key: str = "arguments"
    bare_json: bool = False
    # the grammar's text between the markers and one call's JSON, and between calls
    call_prefix: str = ""
    call_suffix: str = ""
    separator: str = ""
    list_form: bool = False  # the calls are a JSON array inside one open/close pair
    # other (opening, closing) pairs a call is read from: small models fence a call as
    # ```json ...``` instead of writing the markup (llama.cpp's Hermes parser reads these too)
    fences: tuple[tuple[str, str], ...] = ()


MARKUPS: dict[str, ToolMarkup] = {
    "hermes": ToolMarkup(
        "hermes",
        "<tool_call>",
        "</tool_call>",
        call_prefix="\n",
        call_suffix="\n",
        separator="\n",
        bare_json=True,
        fences=(("```", "```"),),
    ),
    "llama3": ToolMarkup(
        "llama3",
        "<|python_tag|>",
        None,
        args_key="parameters",
        bare_json=True,
        separator="; ",
    ),
    "mistral": ToolMarkup("mistral", "[TOOL_CALLS]", None, list_form=True),
    "phi4": ToolMarkup("phi4", "<|tool_call|>", "<|/tool_call|>", list_form=True),
}


def markup_for(special_tokens: Iterable[str], template: str | None) -> ToolMarkup | None:
    """The tool-call markup a model writes, from its special tokens and chat template
    (None: the template has no tool calls this module knows)."""
    specials = set(special_tokens)
    text = template or ""
    if "[TOOL_CALLS]" in specials or "[TOOL_CALLS]" in text:
        return MARKUPS["mistral"]
    if "<|tool_call|>" in specials or "<|tool_call|>" in text:
        return MARKUPS["phi4"]
    if "<tool_call>" in specials or "<tool_call>" in text:
        return MARKUPS["hermes"]
    if "<|python_tag|>" in specials or "<|python_tag|>" in text or "ipython" in text:
        return MARKUPS["llama3"]
    return None


# -- requests ----------------------------------------------------------------------------
def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message)


def check_tools(tools: Any) -> list[dict]:
    """``tools`` as OpenAI defines it, checked: a list of ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}``. Raises InvalidArgumentError naming the field;
    returns the list with ``parameters`` defaulted to an empty object schema."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad(f"'tools' must be a list, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' has {len(tools)} entries, over the limit of {MAX_TOOLS}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(f"{where} must be an object, got {type(t).__name__}")
        if t.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function', got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                f"got {json.dumps(name)[:80]}"
            )
        if name in seen:
            raise _bad(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object")
        _check_schema(params, f"{where}.function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _check_schema(schema: dict, where: str) -> None:
    try:
        import jsonschema
    except ImportError:  # jsonschema is optional: the shape checks above still ran
        return
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise _bad(f"{where} is not a valid JSON schema: {e.message}") from None


def check_tool_choice(choice: Any, tools: list[dict]) -> str | dict:
    """``tool_choice`` checked against ``tools``: "auto" (the default with tools), "none",
    "required", or ``{"type": "function", "function": {"name": ...}}`` naming one of them."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad(
                f"'tool_choice' must be 'auto', 'none', 'required' or an object, got {choice!r}"
            )
        if choice == "required" and not tools:
            raise _bad("'tool_choice' is 'required' but no 'tools' are given")
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad(
                '\'tool_choice\' as an object must be {"type": "function", "function": '
                '{"name": ...}}'
            )
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise _bad(
                f"'tool_choice' names {name!r}, which is not in 'tools' ({', '.join(names)})"
            )
        return {"type": "function", "function": {"name": name}}
    raise _bad(f"'tool_choice' must be a string or an object, got {type(choice).__name__}")


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's ``tool_calls`` keep OpenAI's
    shape but with ``arguments`` as an object (templates write ``arguments | tojson``, as
    transformers passes them), a tool result keeps its ``tool_call_id`` and ``name``."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        fixed = []
        for c in calls:
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except ValueError:
                    pass  # kept as the model wrote it
            fixed.append({**c, "function": fn})
        out.append({**m, "tool_calls": fixed})
    return out


# -- parsing -----------------------------------------------------------------------------
@dataclass
class ToolCall:
    """One call, in OpenAI's shape once :meth:`openai` is asked."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in ``text``, one after another (separated by whitespace, ``,`` or
    ``;``); None when anything else is there."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _call_of(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


_FENCE_LANGUAGE = re.compile(r"^\s*(?:json|JSON)\s")  # ```json, the fence's language


def _calls_in(payload: str, markup: ToolMarkup) -> list[ToolCall] | None:
    """The calls one markup region holds; None when it does not parse."""
    if markup.name == "mistral" and "[ARGS]" in payload:  # name[ARGS]{...}
        name, _, args = payload.partition("[ARGS]")
        values = _json_values(args)
        if not name.strip() or not values or len(values) != 1:
            return None
        return (
            [c]
            if (c := _call_of({"name": name.strip(), "arguments": values[0]}, "arguments"))
            else None
        )
    values = _json_values(_FENCE_LANGUAGE.sub("", payload, count=1))
    if not values:
        return None
    flat: list[Any] = []
    for v in values:
        flat.extend(v if isinstance(v, list) else [v])
    calls = [_call_of(v, markup.args_key) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolCallParser:
    """Splits a model's streamed text into content and tool calls.

    ``feed(piece)`` returns a list of events, each either a ``str`` (content to show) or a
    :class:`ToolCall` (a finished, parsed call); ``finish()`` returns the last ones. Text that
    might be the start of the opening markup is held back until it is decided. ``names``, if
    given, are the tools offered: a call to any other name is not a call (it stays content).
    """

    def __init__(self, markup: ToolMarkup, names: Iterable[str] | None = None) -> None:
        self.markup = markup
        self.names = set(names) if names is not None else None
        self.calls: list[ToolCall] = []
        self.broken = False  # the family's own markup did not parse: returned as content
        self._buf = ""
        self._in_call = False
        self._started = False  # any non-space text seen (Llama's bare JSON must come first)
        self._call_text = ""  # the markup of the call being read, for returning it as text
        self._blank = ""  # blank text after a call, held back
        self._openers = [(markup.open, markup.close), *markup.fences]
        self._close: str | None = markup.close
        self._marked = False  # the call being read opened with the family's own markup

    def feed(self, piece: str) -> list[str | ToolCall]:
        self._buf += piece
        return self._tidy(self._drain(final=False), final=False)

    def finish(self) -> list[str | ToolCall]:
        return self._tidy(self._drain(final=True), final=True)

    def _tidy(self, events: list[str | ToolCall], final: bool) -> list[str | ToolCall]:
        """Drop the blank text around calls (the newlines between ``</tool_call>`` and the
        next ``<tool_call>``): after a call, blank text waits for real text to lead."""
        out: list[str | ToolCall] = []
        for e in events:
            if isinstance(e, ToolCall):
                self._blank = ""
                if out and isinstance(out[-1], str) and not out[-1].strip():
                    out.pop()
                out.append(e)
            elif self.calls and not e.strip():
                self._blank += e
            else:
                out.append(self._blank + e if self.calls else e)
                self._blank = ""
        return out

    def _accept(self, calls: list[ToolCall] | None) -> bool:
        if calls is None:
            return False
        if self.names is not None and any(c.name not in self.names for c in calls):
            return False
        return True

    def _find_opening(self) -> tuple[int, str, str | None] | None:
        """The first opening markup in the buffer: (where, opening, its closing)."""
        best = None
        for opening, closing in self._openers:
            at = self._buf.find(opening)
            if at >= 0 and (
                best is None or at < best[0] or (at == best[0] and len(opening) > len(best[1]))
            ):
                best = (at, opening, closing)
        return best

    def _drain(self, final: bool) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        m = self.markup
        while self._buf:
            if not self._in_call:
                if not self._started and m.bare_json:
                    stripped = self._buf.lstrip()
                    if not stripped:
                        if final:
                            out.append(self._buf)
                            self._buf = ""
                        break
                    if stripped.startswith("{"):
                        self._in_call, self._started, self._close = True, True, None
                        self._marked = False
                        self._call_text = ""
                        continue
                self._started = self._started or bool(self._buf.strip())
                found = self._find_opening()
                if found is None:
                    keep = 0
                    if not final:
                        keep = max(_partial_suffix(self._buf, o) for o, _ in self._openers)
                    cut = len(self._buf) - keep
                    text, self._buf = self._buf[:cut], self._buf[cut:]
                    if text:
                        out.append(text)
                    break
                at, opening, self._close = found
                self._marked = opening == m.open
                if at:
                    out.append(self._buf[:at])
                self._in_call = True
                self._call_text = opening
                self._buf = self._buf[at + len(opening) :]
                continue
            # inside a call
            close = self._close
            if close is not None:
                end = self._buf.find(close)
                if end < 0:
                    if final:
                        out += self._end_call(self._buf, self._call_text + self._buf)
                        self._buf = ""
                    break
                payload = self._buf[:end]
                self._buf = self._buf[end + len(close) :]
                out += self._end_call(payload, self._call_text + payload + close)
                continue
            # no closing markup: the calls run to the end (mistral: until the next opening)
            nxt = self._buf.find(m.open) if m.name == "mistral" else -1
            if nxt >= 0:
                payload, self._buf = self._buf[:nxt], self._buf[nxt:]
                out += self._end_call(payload, self._call_text + payload)
                continue
            if final:
                payload, self._buf = self._buf, ""
                out += self._end_call(payload, self._call_text + payload)
            break
        if final and self._in_call:  # opened, nothing after it
            out += self._end_call("", self._call_text)
        return _merge(out)

    def _end_call(self, payload: str, raw: str) -> list[str | ToolCall]:
        self._in_call = False
        self._call_text = ""
        calls = _calls_in(payload, self.markup)
        if not self._accept(calls):
            self.broken = self.broken or self._marked
            return [raw]
        self.calls += calls  # type: ignore[arg-type]
        return list(calls)  # type: ignore[arg-type]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _merge(events: list[str | ToolCall]) -> list[str | ToolCall]:
    out: list[str | ToolCall] = []
    for e in events:
        if isinstance(e, str):
            if not e:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e
                continue
        out.append(e)
    return out


def parse_tool_calls(
    text: str, markup: ToolMarkup, names: Iterable[str] | None = None
) -> tuple[str, list[ToolCall]]:
    """A whole answer split into its content and its calls."""
    p = ToolCallParser(markup, names)
    events = p.feed(text) + p.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, p.calls


# -- forcing a call ----------------------------------------------------------------------
def _nested_schema(schema: Any, at: str) -> Any:
    """A function's parameter schema to sit at JSON pointer ``at`` of a larger schema: its
    local references (``#/$defs/X``, ``#/definitions/X``, ``#`` itself, as pydantic and
    instructor write them) point into it there, where they would otherwise resolve
    against the larger schema's root."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = at + v[1:]
            else:
                out[k] = _nested_schema(v, at)
        return out
    if isinstance(schema, list):
        return [_nested_schema(v, at) for v in schema]
    return schema


def tool_call_grammar(
    tools: list[dict],
    choice: str | dict,
    markup: ToolMarkup,
    special_tokens: Iterable[str] = (),
    parallel: bool = True,
) -> str:
    """An llguidance Lark grammar for an answer that is one or more calls in ``markup``
    (``choice`` "required": to any of ``tools``, one or more; a named function: one call to
    it), each call's JSON ``{"name": <const>, "arguments": <the function's schema>}``;
    ``parallel`` False allows one call only.

    A marker in ``special_tokens`` (the strings the constraint's tokenizer treats as special
    tokens) is written as a token reference (``<|tool_call|>``), which is the only way a
    grammar matches a special token; any other marker is matched as text."""
    specials = set(special_tokens)

    def lit(s: str) -> str:
        return s if s in specials else json.dumps(s)

    if isinstance(choice, dict):
        wanted = [choice["function"]["name"]]
        many = False
    elif choice == "required":
        wanted = [t["function"]["name"] for t in tools]
        many = parallel
    else:
        raise InvalidArgumentError(f"no grammar for tool_choice {choice!r}")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    rules = []
    alts = []
    for i, name in enumerate(wanted):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": name},
                markup.args_key: _nested_schema(
                    by_name[name].get("parameters") or {"type": "object"},
                    f"#/properties/{markup.args_key}",
                ),
            },
            "required": ["name", markup.args_key],
            "additionalProperties": False,
        }
        rules.append(f"call_{i}: %json{json.dumps(schema, separators=(',', ':'))}")
        alts.append(f"call_{i}")
    rules.append("call: " + " | ".join(alts))
    pre, suf, sep = markup.call_prefix, markup.call_suffix, markup.separator
    if markup.list_form:
        body = '"[" call ("," " "? call)* "]"' if many else '"[" call "]"'
        top = f"{lit(markup.open)} {body}"
        if markup.close:
            top += f" {lit(markup.close)}"
    else:
        parts = [lit(markup.open), json.dumps(pre) if pre else "", "call"]
        parts += [json.dumps(suf) if suf else "", lit(markup.close) if markup.close else ""]
        item = " ".join(x for x in parts if x)
        if markup.name == "llama3":
            item = "call"  # bare JSON, the form the Llama 3 templates ask for
        top = f"item ({json.dumps(sep)} item)*" if many else "item"
        rules.append(f"item: {item}")
    return "\n".join([f"start: {top}", *rules]) + "\n"
