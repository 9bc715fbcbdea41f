"""`edgerun chat`: the terminal chat app (Textual). Start it with `edgerun chat`."""

from __future__ import annotations

__all__ = ["ChatApp", "run"]


def __getattr__(name: str):
    if name in __all__:
        from edgerun.tui import app

        return getattr(app, name)
    raise AttributeError(name)
