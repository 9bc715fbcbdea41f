"""OpenAI-compatible local HTTP server (optional extra: `pip install edgerun[serve]`)."""

from __future__ import annotations

from edgerun.errors import EdgerunError


def require_server_stack() -> None:
    """A clear error naming the extra when Starlette or uvicorn is missing."""
    missing = []
    for mod in ("starlette", "uvicorn"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise EdgerunError(
            f"`edgerun serve` needs {' and '.join(missing)}; install the extra with\n"
            "  pip install 'edgerun[serve]'"
        )
