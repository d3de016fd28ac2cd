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
from textual.css.query import NoMatches
from textual.widgets import Footer, Static
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from llmd.client import DaemonNotRunningError, Result, ServerError
from llmd.tui.chat_view import ChatMessage, ChatView, PromptInput
from llmd.tui.conversation import ChatSettings, Conversation, ConversationStore
from llmd.tui.dashboard import Dashboard
from llmd.tui.screens import ChatsScreen, HelpScreen, SettingsScreen

INTERACTIVE_PRIORITY = 5  # the chat UI's requests: a person is waiting (protocol `priority`)
WIDE = 120  # columns from which the dashboard sits beside the chat; below, F2 swaps them
STATS_SILENCE_S = 3.0  # the daemon publishes stats 4 times a second, busy or idle


class ChatApp(App[None]):
    CSS_PATH = Path(__file__).with_name("llmd.tcss")  # absolute: subclasses elsewhere find it too
    TITLE = "llmd chat"
    # The footer lists these in order and an 80-column one shows the first six: help comes early.
    BINDINGS = [
        Binding("escape", "cancel", "stop"),
        Binding("f1", "help", "help"),
        # F2/F3, not Ctrl+D/Ctrl+Y: the prompt (a TextArea) uses those for delete and redo
        Binding("f2", "toggle_dashboard", "engine"),
        Binding("ctrl+n", "new_chat", "new"),
        Binding("ctrl+o", "open_chat", "open"),
        Binding("ctrl+s", "settings", "settings"),
        Binding("f3", "copy_answer", "copy"),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    def __init__(self, client: Any, store: ConversationStore, stats_silence_s: float = STATS_SILENCE_S,
                 model: str | None = None) -> None:
        """``model``: the model new chats' requests name (None: the daemon's default)."""
        super().__init__()
        self.client = client
        self.store = store
        self.conversation = Conversation(settings=ChatSettings(model=model or ""))
        self.own_ids: set[str] = set()  # public ids of this app's requests (highlighted on the dashboard)
        self.answer_worker: Worker[None] | None = None
        self.stats_silence_s = stats_silence_s
        self.daemon_gone = False
        self.last_stats: dict[str, Any] = {}
        self._last_stats_at = 0.0
        self._have_info = False

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
        self.fetch_info()
        self.set_interval(min(0.5, self.stats_silence_s / 2), self._check_silence)

    def on_resize(self, event: Any) -> None:
        self._apply_width(event.size.width)

    def _apply_width(self, width: int) -> None:
        self.set_class(width < WIDE, "-narrow")

    def _set_daemon_gone(self, gone: bool) -> None:
        if gone == self.daemon_gone:
            return
        try:
            banner = self.query_one("#banner", Static)
        except NoMatches:  # the app is tearing down: the silence timer outlived the widgets
            return
        self.daemon_gone = gone
        # NOTE: a busy daemon (one long step) comes back on its own; a restarted one has a new
        # signing key, which this window does not pick up (yet): say so rather than promise a reconnect.
        banner.update(f"No word from the llmd daemon for {self.stats_silence_s:g}s: busy with a long step, stopped "
                      "or stuck. If it stopped, start it (`llmd start`) and reopen `llmd chat`; chats are saved."
                      if gone else "")
        banner.set_class(gone, "-shown")

    # ---- workers ---------------------------------------------------------------------------------

    @work(exclusive=True, group="info")
    async def fetch_info(self) -> None:
        """The model line; in a worker, as a daemon that does not answer must not freeze the UI."""
        try:
            info = await asyncio.wait_for(self.client.info(), timeout=5)
        except (DaemonNotRunningError, ServerError, asyncio.TimeoutError):
            return  # tried again when stats arrive
        self._have_info = True
        self.query_one(Dashboard).set_info(info)
        self.sub_title = str(info.get("model", ""))
        chat = self.query_one(ChatView)
        if not chat.status:  # the model's name, also where the dashboard is hidden (80 columns)
            chosen = self.conversation.settings.model  # (a model other than the daemon's default: --model)
            chat.set_status(f"connected to {chosen or info.get('model', 'llmd')} · F1 keys · F2 engine")

    @work(exclusive=True, group="stats")
    async def follow_stats(self) -> None:
        # NOTE: no timeout around the read: cancelling a pending anext() would close the
        # subscription. A timer (_check_silence) watches for a silent daemon instead.
        async for stats in self.client.subscribe_stats(timeout=None):
            self._last_stats_at = time.monotonic()
            self._set_daemon_gone(False)
            self.last_stats = stats
            try:
                self.query_one(Dashboard).update_stats(stats, self.own_ids)
            except NoMatches:  # tearing down
                return
            if not self._have_info and not any(w.group == "info" and w.is_running for w in self.workers):
                self.fetch_info()

    def _check_silence(self) -> None:
        if time.monotonic() - self._last_stats_at > self.stats_silence_s:
            self._set_daemon_gone(True)

    @work(exclusive=True, group="answer")
    async def answer(self, conversation: Conversation, question: str) -> None:
        """Stream the answer to ``question`` (the last turn of ``conversation``). Everything here uses
        these two and its own message widget, never ``self.conversation``: the user may open another
        chat while this one is being cancelled."""
        chat = self.query_one(ChatView)
        message = await chat.add("assistant")
        # NOTE: the Markdown stream starts at the first text: stopping one whose task never ran
        # raises CancelledError into this worker (textual 8).
        stream = None
        text: list[str] = []
        status = ""
        # NOTE: someone is watching this one: ahead of batch work from other clients (INTERACTIVE_PRIORITY).
        request = self.client.chat(conversation.request_messages(), **conversation.settings.params(),
                                   model=conversation.settings.model or None, priority=INTERACTIVE_PRIORITY,
                                   on_accepted=lambda reply: self.own_ids.add(str(reply.get("id"))))
        chat.set_status("writing… (Escape stops)")
        try:
            async for item in request:
                if isinstance(item, Result):
                    status = describe_result(item)
                elif item.text:
                    text.append(item.text)
                    stream = stream or chat.stream_into(message)
                    await stream.write(item.text)
                    chat.messages.scroll_end(animate=False)
        except asyncio.CancelledError:
            status = "stopped"
            raise
        except ServerError as e:
            status = (f"This conversation no longer fits ({e.message}). Start a new chat with Ctrl+N, or lower "
                      "max tokens in Ctrl+S." if e.code == "too_long" else f"the daemon refused: {e.message}")
        except DaemonNotRunningError:
            status = "the daemon stopped answering" + ("; the partial answer is kept" if text else "")
            self._set_daemon_gone(True)
        except NoMatches:  # the app is closing: its widgets went before this worker was cancelled
            status = "stopped"
        finally:
            await request.aclose()  # cancels the request in the daemon if it is still running
            answer = "".join(text)
            # The chat first, saved: the widgets below may be gone already (the app closing mid-answer).
            if answer:
                conversation.messages.append({"role": "assistant", "content": answer})
            else:
                # No answer: take the question back (into the prompt, if this chat is still shown),
                # so the chat keeps alternating user/assistant turns, as chat templates require.
                conversation.messages.pop()
            self.store.save(conversation)
            try:
                await self._show_answer_end(chat, message, stream, conversation, question, answer, status)
            except NoMatches:
                pass

    async def _show_answer_end(self, chat: ChatView, message: ChatMessage, stream: Any, conversation: Conversation,
                               question: str, answer: str, status: str) -> None:
        """The view when an answer ends: its message final, or gone with the question back in the prompt."""
        if stream is not None:
            await stream.stop()
        message.text = answer
        if not answer:
            await message.remove()
            if conversation is self.conversation:
                await chat.drop_last("user")
                if not chat.prompt.text.strip():
                    chat.prompt.text = question
                if status != "stopped":
                    await chat.add("note", status)
        if conversation is self.conversation:
            chat.set_status(status)

    # ---- events and actions ----------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        chat = self.query_one(ChatView)
        if self.answer_worker is not None and self.answer_worker.is_running:
            chat.set_status("an answer is still being written: Escape stops it")
            return
        if chat.prompt.text == event.text:  # (not if the user has typed on since)
            chat.prompt.clear()
        self.conversation.messages.append({"role": "user", "content": event.text})
        await chat.add("user", event.text)
        self.answer_worker = self.answer(self.conversation, event.text)

    def action_cancel(self) -> None:
        if self.answer_worker is not None and self.answer_worker.is_running:
            self.answer_worker.cancel()

    async def _open(self, conversation: Conversation) -> None:
        worker = self.answer_worker
        if worker is not None and worker.is_running:
            worker.cancel()
            try:  # let its cleanup (save, take back an unanswered question) finish first
                await worker.wait()
            except (WorkerCancelled, WorkerFailed):
                pass
        self.conversation = conversation
        await self.query_one(ChatView).show(conversation.messages)
        self.query_one(ChatView).set_status("")

    async def action_new_chat(self) -> None:
        await self._open(Conversation(settings=self.conversation.settings))

    def action_open_chat(self) -> None:
        async def opened(chat_id: str | None) -> None:
            if chat_id:
                try:
                    conversation = self.store.load(chat_id)
                except ValueError as e:  # removed or spoiled since the list was read
                    self.notify(str(e), severity="error")
                    return
                await self._open(conversation)
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
        if not (self.has_class("-narrow") and self.has_class("-dashboard")):
            self.query_one(PromptInput).focus()  # the chat is visible (again): type into it

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def describe_result(result: Result) -> str:
    """The status line after an answer: tokens, speed, first-token time, prefix-cache use."""
    t, usage = result.timings or {}, result.usage or {}
    rate, ttft, cached = t.get("decode_tokens_per_s"), t.get("ttft_s"), usage.get("cached_tokens")
    return (f"{usage.get('completion_tokens', 0)} tokens" + (f" · {rate:.1f} tok/s" if rate else "")
            + (f" · first token {ttft:.2f}s" if ttft else "")
            + (f" · {cached} prompt tokens from the cache" if cached else "")
            + (f" · {t['accepted_draft_tokens']}/{t['draft_tokens']} drafts accepted" if t.get("draft_tokens") else "")
            + (" · stopped at max tokens" if result.finish_reason == "length" else ""))


def default_store() -> ConversationStore:
    from llmd.paths import data_dir

    return ConversationStore(data_dir() / "chats")


def run_chat(connection: dict[str, Any], store: ConversationStore | None = None, model: str | None = None) -> int:
    """Run the app against the daemon of ``connection`` (its client lives in the app's event
    loop), its chats with ``model`` (None: the daemon's default); returns the app's exit code."""
    from llmd.client import AsyncClient

    async def main() -> int:
        async with AsyncClient(connection=connection) as client:
            app = ChatApp(client, store or default_store(), model=model)
            await app.run_async()
            return app.return_code or 0

    return asyncio.run(main())
