"""The model side of the chat app: prompts, context checks, and the stats providers.

Everything here runs in worker threads or is cheap; nothing imports Textual.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

RAW_STOPS = ("\nUser:", "\nuser:", "\nUSER:")


def uses_template(model: Any) -> bool:
    return bool(getattr(model, "chat_template", None))


def transcript(messages: list[dict[str, str]]) -> str:
    """Plain-text rendering of a conversation for models without a chat template."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"].strip() + "\n")
        elif m["role"] == "user":
            parts.append(f"User: {m['content'].strip()}")
        else:
            parts.append(f"Assistant: {m['content'].strip()}")
    parts.append("Assistant:")
    return "\n".join(parts)


def prompt_ids(model: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids the model will see for `messages` (chat template, or the raw transcript)."""
    if uses_template(model):
        return model.tokenize(model.render_chat(messages))
    return model.tokenize(transcript(messages))


def reserve(model: Any, max_tokens: int) -> int:
    """Room kept free for the answer when checking whether a prompt still fits."""
    return max(1, min(max_tokens, model.n_ctx // 4))


def fit_by_dropping(
    model: Any, system: list[dict[str, str]], turns: list[dict[str, str]], max_tokens: int
) -> int:
    """How many leading messages of `turns` to drop so the prompt fits; -1 if none works.

    Whole user/assistant pairs go first; the last user message always stays.
    """
    room = model.n_ctx - reserve(model, max_tokens)
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"] or [0]
    for i in starts:
        if len(prompt_ids(model, system + turns[i:])) <= room:
            return i
    return -1


def model_quant(model: Any) -> str:
    """The registry's quant label for the model, else its most common tensor format."""
    try:
        from edgerun import registry

        for m in registry.manifests():
            if m.filename == model.path.name:
                return m.quant
    except Exception:  # noqa: BLE001 - a figure for display only
        pass
    try:
        counts: Counter = Counter()
        for _, fmt, (r, c), _ in model.tensor_summary():
            counts[fmt] += r * c
        return counts.most_common(1)[0][0]
    except Exception:  # noqa: BLE001
        return "?"


def _threads(model) -> str:
    """Threads in use; with automatic threads, out of how many (other load takes cores)."""
    if model is None:
        return "-"
    gov = getattr(model, "governor", None)
    if gov is None or not gov.adaptive:
        return str(model.threads)
    return f"{gov.threads} of {gov.max_threads}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def default_providers(app: Any) -> list[tuple[str, Callable[[], str]]]:
    """The side panel's rows: (label, callable giving the value). Add a row = add a line.

    `app` has .model (Model | None), .model_label, .model_quant, .status_text.
    """
    from edgerun.sysinfo import peak_rss_bytes

    def st():
        return getattr(app, "last_stats", None) if app.model is not None else None

    def ctx() -> str:
        m = app.model
        if m is None:
            return "-"
        used = app.cache_length() if hasattr(app, "cache_length") else m.generator.cache.length
        return f"{used} / {m.n_ctx} ({100 * used / max(1, m.n_ctx):.0f}%)"

    def prompt() -> str:
        s = st()
        if s is None or not s.prompt_tokens:
            return "-"
        return f"{s.prompt_tps:.1f} tok/s ({s.prompt_tokens - s.cached_tokens} new)"

    def gen() -> str:
        s = st()
        if s is None or not s.generated_tokens:
            return "-"
        return f"{s.generate_tps:.1f} tok/s ({s.generated_tokens} tok)"

    def finish() -> str:
        if getattr(app, "generating", False):
            return "running"
        s = st()
        return (s.finish_reason or "-") if s is not None else "-"

    return [
        ("Model", lambda: app.model_label or "-"),
        ("Quant", lambda: app.model_quant or "-"),
        ("Arch", lambda: app.model.spec.arch if app.model else "-"),
        ("Context", ctx),
        ("Prompt", prompt),
        ("Generation", gen),
        ("Finish", finish),
        ("Threads", lambda: _threads(app.model)),
        ("Load", lambda: f"{app.model.load_seconds:.2f} s" if app.model else "-"),
        ("Peak RSS", lambda: _mib(peak_rss_bytes())),
        ("Status", lambda: app.status_text),
    ]
