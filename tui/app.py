"""`llmd chat`: chat with the daemon and watch the engine work.

The app talks to the daemon only through an ``llmd.AsyncClient`` (or anything with its ``chat``,
``info`` and ``subscribe_stats``; the tests pass a scripted fake). Two workers run beside the UI:
one streams the current answer, one follows the published stats and notices a silent daemon.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Static
from textual.worker import Worker

from llmd.client import DaemonNotRunningError, Result, ServerError
from llmd.tui.chat_view import ChatView, PromptInput
from llmd.tui.conversation import Conversation, ConversationStore
from llmd.tui.dashboard import Dashboard
from llmd.tui.screens import ChatsScreen, HelpScreen, SettingsScreen

WIDE = 120  # columns from which the dashboard sits beside the chat; below, F2 swaps them
STATS_SILENCE_S = 3.0  # the daemon publishes stats 4 times a second, busy or idle


class ChatApp(App[None]):
    CSS_PATH = Path(__file__).with_name("llmd.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "llmd chat"
    BINDINGS = [
        Binding("escape", "cancel", "stop answer"),
        Binding("ctrl+n", "new_chat", "new chat"),
        Binding("ctrl+o", "open_chat", "open"),
        Binding("ctrl+s", "settings", "settings"),
        # F2/F3, not Ctrl+D/Ctrl+Y: the prompt (a TextArea) uses those for delete and redo
        Binding("f2", "toggle_dashboard", "dashboard"),
        Binding("f3", "copy_answer", "copy answer"),
        Binding("f1", "help", "help"),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    def __init__(self, client: Any, store: ConversationStore, stats_silence_s: float = STATS_SILENCE_S) -> None:
        super().__init__()
        self.client = client
        self.store = store
        self.conversation = Conversation()
        self.own_ids: set[str] = set()  # public ids of this app's requests (highlighted on the dashboard)
        self.answer_worker: Worker[None] | None = None
        self.stats_silence_s = stats_silence_s
        self.daemon_gone = False
        self.last_stats: dict[str, Any] = {}
        self._last_stats_at = 0.0

    # ---- layout ----------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="banner")
        with Horizontal(id="main"):
            yield ChatView(id="chat")
            yield Dashboard(id="dashboard")
        yield Footer()

    async def on_mount(self) -> None:
        self._apply_width(self.size.width)
        self.query_one(PromptInput).focus()
        self._last_stats_at = time.monotonic()
        self.follow_stats()
        self.set_interval(min(0.5, self.stats_silence_s / 2), self._check_silence)
        try:
            info = await asyncio.wait_for(self.client.info(), timeout=5)
            self.query_one(Dashboard).set_info(info)
            self.sub_title = str(info.get("model", ""))
        except (DaemonNotRunningError, ServerError, asyncio.TimeoutError):
            self._set_daemon_gone(True)

    def on_resize(self, event: Any) -> None:
        self._apply_width(event.size.width)

    def _apply_width(self, width: int) -> None:
        self.set_class(width < WIDE, "-narrow")

    def _set_daemon_gone(self, gone: bool) -> None:
        if gone == self.daemon_gone:
            return
        self.daemon_gone = gone
        banner = self.query_one("#banner", Static)
        # NOTE: a paused or busy daemon comes back on its own; a restarted one has a new signing
        # key, which this window does not pick up (yet): say so rather than promise a reconnect.
        banner.update("The llmd daemon is not responding: it stopped or is stuck. If it stopped, start it with "
                      "`llmd start` and reopen `llmd chat` (your chats are saved)." if gone else "")
        banner.set_class(gone, "-shown")

    # ---- workers ---------------------------------------------------------------------------------

    @work(exclusive=True, group="stats")
    async def follow_stats(self) -> None:
        # NOTE: no timeout around the read: cancelling a pending anext() would close the
        # subscription. A timer (_check_silence) watches for a silent daemon instead.
        async for stats in self.client.subscribe_stats():
            self._last_stats_at = time.monotonic()
            self._set_daemon_gone(False)
            self.last_stats = stats
            self.query_one(Dashboard).update_stats(stats, self.own_ids)

    def _check_silence(self) -> None:
        if time.monotonic() - self._last_stats_at > self.stats_silence_s:
            self._set_daemon_gone(True)

    @work(exclusive=True, group="answer")
    async def answer(self) -> None:
        chat = self.query_one(ChatView)
        message = await chat.add("assistant")
        # NOTE: the Markdown stream starts at the first text: stopping one whose task never ran
        # raises CancelledError into this worker (textual 8).
        stream = None
        text: list[str] = []
        status = ""
        request = self.client.chat(self.conversation.request_messages(), **self.conversation.settings.params(),
                                   on_accepted=lambda reply: self.own_ids.add(str(reply.get("id"))))
        chat.set_status("writing… (Escape stops)")
        try:
            async for item in request:
                if isinstance(item, Result):
                    t = item.timings or {}
                    rate, ttft = t.get("decode_tokens_per_s"), t.get("ttft_s")
                    status = (f"{item.usage.get('completion_tokens', 0)} tokens"
                              + (f" · {rate:.1f} tok/s" if rate else "") + (f" · first token {ttft:.2f}s" if ttft else "")
                              + (f" · {item.usage.get('cached_tokens', 0)} prompt tokens from the cache"
                                 if item.usage.get("cached_tokens") else "")
                              + (" · stopped at max tokens" if item.finish_reason == "length" else ""))
                elif item.text:
                    text.append(item.text)
                    stream = stream or chat.stream_into(message)
                    await stream.write(item.text)
                    chat.messages.scroll_end(animate=False)
        except asyncio.CancelledError:
            status = "stopped"
            raise
        except ServerError as e:
            status = (f"This conversation no longer fits the model's context ({e.message}). Start a new chat "
                      "with Ctrl+N, or lower max tokens in Ctrl+S." if e.code == "too_long" else f"error: {e.message}")
        except DaemonNotRunningError:
            status = "the daemon stopped answering; the partial answer is kept"
            self._set_daemon_gone(True)
        finally:
            await request.aclose()  # cancels the request in the daemon if it is still running
            if stream is not None:
                await stream.stop()
            answer = "".join(text)
            message.text = answer
            if answer:
                self.conversation.messages.append({"role": "assistant", "content": answer})
            elif status and status != "stopped":
                await message.remove()
                await chat.add("note", status)
            self.store.save(self.conversation)
            chat.set_status(status)

    # ---- events and actions ----------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if self.answer_worker is not None and self.answer_worker.is_running:
            self.query_one(ChatView).set_status("an answer is still being written: Escape stops it")
            return
        self.conversation.messages.append({"role": "user", "content": event.text})
        await self.query_one(ChatView).add("user", event.text)
        self.answer_worker = self.answer()

    def action_cancel(self) -> None:
        if self.answer_worker is not None and self.answer_worker.is_running:
            self.answer_worker.cancel()

    async def _open(self, conversation: Conversation) -> None:
        self.action_cancel()
        self.conversation = conversation
        await self.query_one(ChatView).show(conversation.messages)
        self.query_one(ChatView).set_status("")

    async def action_new_chat(self) -> None:
        await self._open(Conversation(settings=self.conversation.settings))

    def action_open_chat(self) -> None:
        async def opened(chat_id: str | None) -> None:
            if chat_id:
                await self._open(self.store.load(chat_id))
        self.push_screen(ChatsScreen(self.store.list()), opened)

    def action_settings(self) -> None:
        def saved(settings: Any) -> None:
            if settings is not None:
                self.conversation.settings = settings
                self.query_one(ChatView).set_status("settings saved for this chat")
        self.push_screen(SettingsScreen(self.conversation.settings), saved)

    def action_copy_answer(self) -> None:
        answer = next((m["content"] for m in reversed(self.conversation.messages) if m["role"] == "assistant"), None)
        if answer is None:
            self.notify("no answer to copy yet")
            return
        self.copy_to_clipboard(answer)
        self.notify("copied the last answer")

    def action_toggle_dashboard(self) -> None:
        self.toggle_class("-dashboard")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def default_store() -> ConversationStore:
    from llmd.paths import data_dir

    return ConversationStore(data_dir() / "chats")


def run_chat(connection: dict[str, Any], store: ConversationStore | None = None) -> None:
    """Run the app against the daemon of ``connection`` (its client lives in the app's event loop)."""
    from llmd.client import AsyncClient

    async def main() -> None:
        async with AsyncClient(connection=connection) as client:
            await ChatApp(client, store or default_store()).run_async()

    asyncio.run(main())
