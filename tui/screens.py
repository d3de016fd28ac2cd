"""Modal screens: the keys, the chat's settings, and the saved chats."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, ListItem, ListView, Static, TextArea

from llmd.tui.conversation import ChatSettings, Conversation

KEYS = [
    ("Enter", "send the message"),
    ("Ctrl+J", "new line in the message"),
    ("Escape", "stop the answer being written"),
    ("Ctrl+N", "new chat"),
    ("Ctrl+O", "open a saved chat"),
    ("Ctrl+S", "settings: system prompt, temperature, top-p, max tokens"),
    ("F2", "dashboard: beside the chat when the terminal is 120+ wide, else swap with the chat"),
    ("F3", "copy the last answer"),
    ("F1", "this help"),
    ("Ctrl+Q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "app.pop_screen", "close")]

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"[b]{key:>8}[/b]  {what}" for key, what in KEYS)
        with Vertical(classes="dialog"):
            yield Static("[b]llmd chat[/b]: keys", classes="dialog-title")
            yield Static(lines)
            yield Static("Chats are saved as you go. The dashboard shows the daemon's KV blocks "
                         "(yours highlighted), throughput and requests, live.", classes="dim")


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Edit the chat's settings; dismisses with the new settings, or None if cancelled."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(classes="dialog"):
            yield Static("[b]Settings[/b] for this chat", classes="dialog-title")
            yield Label("System prompt")
            yield TextArea(s.system_prompt, id="system-prompt", compact=True)
            with Grid(id="settings-grid"):
                yield Label("Temperature (0-2)")
                yield Input(str(s.temperature), id="temperature", compact=True)
                yield Label("Top-p (0-1]")
                yield Input(str(s.top_p), id="top-p", compact=True)
                yield Label("Max tokens")
                yield Input(str(s.max_tokens), id="max-tokens", compact=True)
                yield Label("Model (empty: default)")
                yield Input(s.model, id="model", placeholder="a name from `llmd models`", compact=True)
            yield Static("", id="settings-error")
            with Grid(classes="buttons"):
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        try:
            settings = ChatSettings(
                system_prompt=self.query_one("#system-prompt", TextArea).text,
                temperature=float(self.query_one("#temperature", Input).value),
                top_p=float(self.query_one("#top-p", Input).value),
                max_tokens=int(self.query_one("#max-tokens", Input).value),
                model=self.query_one("#model", Input).value,
            )
        except ValueError as e:
            self.query_one("#settings-error", Static).update(f"[red]{e}[/red]")
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ChatsScreen(ModalScreen[str | None]):
    """Pick a saved chat; dismisses with its id, or None."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, chats: list[Conversation]) -> None:
        super().__init__()
        self.chats = chats

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("[b]Saved chats[/b] · Enter opens · Escape closes", classes="dialog-title")
            if not self.chats:
                yield Static("No saved chats yet.", classes="dim")
            # widget ids by position: chat ids are file names, which need not be valid widget ids
            items = [ListItem(Label(f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(c.updated))}  {c.title}"),
                              id=f"chat-{i}") for i, c in enumerate(self.chats)]
            yield ListView(*items, id="chat-list")

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        index = int(event.item.id.removeprefix("chat-")) if event.item.id else -1
        self.dismiss(self.chats[index].id if 0 <= index < len(self.chats) else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
