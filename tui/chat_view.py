"""The chat column: the conversation as Markdown, the answer streaming into the last message, and the
prompt (Enter sends, Ctrl+J adds a line)."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream


class ChatMessage(Markdown):
    """One turn; the role is a CSS class (``user``, ``assistant``, ``note``)."""

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(text, classes=role)
        self.role = role
        self.text = text


class PromptInput(TextArea):
    """A multi-line prompt where Enter sends and Ctrl+J inserts a newline. It does not clear
    itself: the app clears it once it takes the message (a refused send keeps the text)."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
        elif event.key == "ctrl+j":
            event.stop()
            event.prevent_default()
            self.insert("\n")
        else:
            await super()._on_key(event)


class ChatView(Vertical):
    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="messages")
        yield Static("", id="chat-status")
        yield PromptInput(id="prompt", placeholder="Ask something · Enter sends · Ctrl+J new line · F1 help")

    @property
    def messages(self) -> VerticalScroll:
        return self.query_one("#messages", VerticalScroll)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    async def drop_last(self, role: str) -> None:
        """Remove the last message if it has this role."""
        shown = self.query(ChatMessage)
        if shown and shown.last().role == role:
            await shown.last().remove()

    status: str = ""

    def set_status(self, text: str) -> None:
        self.status = text
        self.query_one("#chat-status", Static).update(text)

    async def show(self, turns: list[dict[str, str]]) -> None:
        """Replace the view with these turns."""
        await self.messages.remove_children()
        await self.messages.mount_all([ChatMessage(t["role"], t["content"]) for t in turns])
        self.messages.scroll_end(animate=False)

    async def add(self, role: str, text: str = "") -> ChatMessage:
        message = ChatMessage(role, text)
        await self.messages.mount(message)
        self.messages.scroll_end(animate=False)
        return message

    def stream_into(self, message: ChatMessage) -> MarkdownStream:
        return Markdown.get_stream(message)
