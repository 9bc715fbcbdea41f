"""Chat settings and conversations saved on disk as JSON (one file per conversation)."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from edgerun.generate.settings import SAMPLING_FIELDS, ModelSettings

FORMAT_VERSION = 1


@dataclass
class ChatSettings:
    """Sampling settings and the system prompt; saved with each conversation.

    A sampling field left None (and an empty system prompt) follows the loaded model's
    recommended settings, so switching models switches them too.
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    max_tokens: int = 512
    seed: int | None = None
    system: str = ""
    # speculative decoding's drafter: "ngram", a model name or path, "" for none; None
    # keeps what the model was loaded with (`edgerun chat --draft-model`)
    draft: str | None = None
    # thinking models: "on", "off", or "" for the chat template's default
    reasoning: str = ""

    def sampling(self, recommended: ModelSettings | None = None) -> dict[str, Any]:
        """Keyword arguments for Model.chat / Model.generate, None fields filled in."""
        base = recommended if recommended is not None else ModelSettings()
        out: dict[str, Any] = {"max_tokens": self.max_tokens}
        for k in SAMPLING_FIELDS:
            mine = getattr(self, k)
            out[k] = getattr(base, k) if mine is None else mine
        out["seed"] = self.seed
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})


def _new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass
class Conversation:
    """A chat: its messages ({"role", "content"} plus optional "stats") and settings."""

    id: str = field(default_factory=_new_id)
    title: str = ""
    model: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    settings: ChatSettings = field(default_factory=ChatSettings)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def chat_messages(self, default_system: str = "") -> list[dict[str, str]]:
        """The messages as the model sees them: system prompt first, no extra keys.

        default_system (the model's recommended one) stands in for an empty system prompt.
        """
        out = []
        system = self.settings.system if self.settings.system.strip() else default_system
        if system.strip():
            out.append({"role": "system", "content": system})
        out.extend({"role": m["role"], "content": m["content"]} for m in self.messages)
        return out

    def auto_title(self) -> str:
        for m in self.messages:
            if m["role"] == "user" and m["content"].strip():
                line = m["content"].strip().splitlines()[0]
                return line[:60] + ("…" if len(line) > 60 else "")
        return "New chat"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        msgs = [
            m
            for m in data.get("messages", [])
            if isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
        ]
        return cls(
            id=str(data.get("id") or _new_id()),
            title=str(data.get("title") or ""),
            model=str(data.get("model") or ""),
            created=float(data.get("created") or time.time()),
            updated=float(data.get("updated") or time.time()),
            settings=ChatSettings.from_dict(data.get("settings")),
            messages=msgs,
        )

    def to_markdown(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created))
        lines = [f"# {self.title or self.auto_title()}", "", f"*{self.model} · {when}*", ""]
        if self.settings.system.strip():
            lines += ["**System:**", "", self.settings.system.strip(), ""]
        for m in self.messages:
            who = {"user": "You", "assistant": "Assistant"}.get(m["role"], m["role"])
            lines += [f"## {who}", "", m["content"].strip(), ""]
        return "\n".join(lines)


def default_dir() -> Path:
    """Where conversations live: the platform's user data dir, .../edgerun/conversations."""
    try:
        import platformdirs

        base = Path(platformdirs.user_data_dir("edgerun", appauthor=False))
    except ImportError:  # pragma: no cover - platformdirs comes with textual
        xdg = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        base = Path(xdg) / "edgerun"
    return base / "conversations"


class ConversationStore:
    """A folder of <id>.json conversations (and <id>.md exports beside them)."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.dir = Path(directory) if directory is not None else default_dir()
        self.broken: list[tuple[Path, str]] = []  # files the last list() could not read

    def path(self, conv: Conversation) -> Path:
        return self.dir / f"{conv.id}.json"

    def kv_path(self, conv: Conversation) -> Path:
        """The conversation's saved KV cache (edgerun.Session.save), beside its JSON."""
        return self.dir / f"{conv.id}.kv.safetensors"

    def save(self, conv: Conversation) -> Path:
        """Atomically (temp file, fsync, rename, fsync of the folder)."""
        from edgerun.runtime.atomic import write_bytes_atomic

        conv.updated = time.time()
        conv.title = conv.auto_title()
        data = json.dumps(conv.to_dict(), indent=2, ensure_ascii=False).encode("utf-8")
        return write_bytes_atomic(self.path(conv), data)

    def delete(self, conv: Conversation) -> None:
        self.path(conv).unlink(missing_ok=True)
        self.kv_path(conv).unlink(missing_ok=True)

    def load(self, path_or_id: str | os.PathLike) -> Conversation:
        p = Path(path_or_id)
        if not p.suffix:
            p = self.dir / f"{p.name}.json"
        return Conversation.from_dict(json.loads(p.read_text("utf-8")))

    def list(self) -> list[Conversation]:
        """Saved conversations, most recently updated first. A file that cannot be read is
        skipped and recorded in `self.broken` (path, why), never hiding the others."""
        self.broken = []
        if not self.dir.is_dir():
            return []
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(self.load(p))
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
                self.broken.append((p, f"{type(e).__name__}: {e}"))
                continue
        out.sort(key=lambda c: c.updated, reverse=True)
        return out

    def latest(self) -> Conversation | None:
        convs = self.list()
        return convs[0] if convs else None

    def export_markdown(self, conv: Conversation) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{conv.id}.md"
        path.write_text(conv.to_markdown(), "utf-8")
        return path
