"""Chat templates: a model's Jinja template rendered the way transformers renders it.

Templates come from model files, so they are untrusted input. They run in jinja2's
``ImmutableSandboxedEnvironment``; any unsafe attribute access (``''.__class__`` and the like)
raises at once instead of quietly rendering as an empty string.

There is deliberately no fallback template: a model without one gets a clear error that tells
the user to use raw mode (plain text in, no chat formatting).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from edgerun.errors import EdgerunError

__all__ = ["ChatTemplateError", "NoChatTemplateError", "render_chat"]


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


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
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

    class _StrictSandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
            raise SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object "
                "is not allowed"
            )

    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the model's chat template does not compile (line {e.lineno}): {e.message}"
        ) from None
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None


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
    for any failure inside the template.
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
    try:
        return compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except SecurityError as e:
        raise ChatTemplateError(
            f"the chat template tried something unsafe and was stopped: {e}"
        ) from None
    except TemplateError as e:
        # raise_exception() in a template lands here with the template's own message.
        raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except Exception as e:  # the template is untrusted code; any failure is its (or the input's)
        raise ChatTemplateError(
            f"the chat template failed while rendering: {type(e).__name__}: {e}"
        ) from None
