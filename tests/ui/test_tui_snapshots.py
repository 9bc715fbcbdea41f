"""Snapshot tests of the chat app's dialogs (pytest-textual-snapshot) at 80x24.

The main screen shows live timings and memory figures, so it is checked by the
widget-tree tests in test_tui.py; the dialogs below are deterministic.
Update after an intended change: pytest tests/ui/test_tui_snapshots.py --snapshot-update
"""

from textual.app import App

from edgerun.tui.app import CSS_PATH
from edgerun.tui.screens import ContextFullScreen, HelpScreen, SettingsScreen
from edgerun.tui.store import ChatSettings

SIZE = (80, 24)


class _Host(App):
    CSS_PATH = CSS_PATH

    def __init__(self, screen_factory) -> None:
        super().__init__()
        self._factory = screen_factory

    def on_mount(self) -> None:
        self.push_screen(self._factory())


def test_help_screen(snap_compare):
    assert snap_compare(_Host(lambda: HelpScreen("/conversations")), terminal_size=SIZE)


def test_settings_screen(snap_compare):
    models = [("SmolLM2-135M-Instruct", "smollm2-135m"), ("Gemma 3 270M", "gemma3-270m")]
    app = _Host(lambda: SettingsScreen(ChatSettings(), "smollm2-135m", models, 2048))
    assert snap_compare(app, terminal_size=SIZE)


def test_context_full_screen(snap_compare):
    app = _Host(lambda: ContextFullScreen(2100, 2048, False))
    assert snap_compare(app, terminal_size=SIZE)
