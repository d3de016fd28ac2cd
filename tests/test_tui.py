"""`llmd chat` driven by Textual's pilot against a scripted fake client: sending, streaming, cancel,
new chat, reopening a saved chat, settings reaching the request, context overflow, a daemon that
goes silent, and the dashboard's block map and request table."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_chat_client import FakeClient, request_row, stats_message

from llmd.client import ServerError
from llmd.protocol import BLOCK_CACHED, BLOCK_FIRST_OWNER
from llmd.tui.app import INTERACTIVE_PRIORITY, ChatApp
from llmd.tui.chat_view import ChatMessage, PromptInput
from llmd.tui.conversation import ChatSettings, Conversation, ConversationStore
from llmd.tui.kv_map import OWN, KVMap, cell_style
from llmd.tui.screens import ChatsScreen, SettingsScreen


def make_app(tmp_path: Path, client: FakeClient, **kwargs) -> ChatApp:
    return ChatApp(client, ConversationStore(tmp_path / "chats"), **kwargs)


async def send(pilot, text: str) -> None:
    prompt = pilot.app.query_one(PromptInput)
    prompt.focus()
    prompt.insert(text)
    await pilot.press("enter")


async def wait_until(pilot, predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await pilot.pause(0.02)


def shown(app: ChatApp) -> list[tuple[str, str]]:
    return [(m.role, m.text if m.role != "assistant" or m.text else m.source) for m in app.query(ChatMessage)]


@pytest.mark.asyncio
async def test_send_streams_the_answer_and_saves(tmp_path: Path) -> None:
    client = FakeClient(["Paris is the **capital** of France."], word_delay=0.01)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "What is the capital of France?")
        await wait_until(pilot, lambda: client.finished)
        await wait_until(pilot, lambda: not app.answer_worker.is_running)
        assert shown(app) == [("user", "What is the capital of France?"),
                              ("assistant", "Paris is the **capital** of France.")]
        sent = client.requests[0]
        assert sent["messages"] == [{"role": "user", "content": "What is the capital of France?"}]  # no system prompt
        assert sent["params"] == ChatSettings().params() and sent["model"] is None  # the daemon's default
        assert sent["priority"] == INTERACTIVE_PRIORITY > 0  # a person waits: ahead of batch clients
        saved = ConversationStore(tmp_path / "chats").list()
        assert len(saved) == 1 and saved[0].messages[-1]["content"] == "Paris is the **capital** of France."
        await pilot.press("f3")  # copy the last answer
        assert app.clipboard == "Paris is the **capital** of France."


@pytest.mark.asyncio
async def test_escape_cancels_the_answer(tmp_path: Path) -> None:
    client = FakeClient(["one two three four five six seven eight nine ten " * 20], word_delay=0.02)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "count")
        await wait_until(pilot, lambda: len(app.query(ChatMessage)) == 2 and app.query(ChatMessage).last().source)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.answer_worker.is_running)
        assert client.cancelled == ["r1"] and client.finished == []
        partial = app.conversation.messages[-1]
        assert partial["role"] == "assistant" and 0 < len(partial["content"]) < len(client.answers[0])
        # the next message is answered normally
        client.answers = ["ok"]
        await send(pilot, "again")
        await wait_until(pilot, lambda: client.finished == ["r2"])


@pytest.mark.asyncio
async def test_typing_while_answering_keeps_the_text(tmp_path: Path) -> None:
    client = FakeClient(["slow " * 50], word_delay=0.05)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "first")
        await wait_until(pilot, lambda: client.requests)
        await send(pilot, "second, too early")
        assert app.query_one(PromptInput).text == "second, too early" and len(client.requests) == 1, (
            app.answer_worker.state, client.requests, str(app.query_one("#chat-status").render()))
        await wait_until(pilot, lambda: not app.answer_worker.is_running)


@pytest.mark.asyncio
async def test_escape_before_any_text_takes_the_question_back(tmp_path: Path) -> None:
    client = FakeClient(["late"], word_delay=2.0)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "never answered")
        await wait_until(pilot, lambda: client.requests)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.answer_worker.is_running)
        assert client.cancelled == ["r1"] and app.conversation.messages == [] and shown(app) == []
        assert app.query_one(PromptInput).text == "never answered"


@pytest.mark.asyncio
async def test_new_chat_while_answering(tmp_path: Path) -> None:
    client = FakeClient(["one two three four five six seven eight " * 10], word_delay=0.02)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "long one")
        await wait_until(pilot, lambda: app.query(ChatMessage).last().source)
        old = app.conversation
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.answer_worker.is_running)
        await pilot.pause()
        # the stopped answer stays with its own chat (saved), the new chat is empty
        assert app.conversation is not old and app.conversation.messages == [] and shown(app) == []
        saved = {c.id: c for c in ConversationStore(tmp_path / "chats").list()}
        assert [m["role"] for m in saved[old.id].messages] == ["user", "assistant"]


@pytest.mark.asyncio
async def test_new_chat_and_reopen(tmp_path: Path) -> None:
    client = FakeClient(["first answer", "second answer"])
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "first question")
        await wait_until(pilot, lambda: client.finished == ["r1"])
        await wait_until(pilot, lambda: not app.answer_worker.is_running)
        first_id = app.conversation.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert shown(app) == [] and app.conversation.messages == [] and app.conversation.id != first_id
        await send(pilot, "second question")
        await wait_until(pilot, lambda: client.finished == ["r1", "r2"])
        await wait_until(pilot, lambda: not app.answer_worker.is_running)
        assert client.requests[1]["messages"] == [{"role": "user", "content": "second question"}]
        await pilot.press("ctrl+o")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ChatsScreen) and len(screen.chats) == 2
        # newest first: the second chat is on top; go down to the first and open it
        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.conversation.id == first_id
        assert shown(app) == [("user", "first question"), ("assistant", "first answer")]
        # a reopened chat goes on with its history
        client.answers = ["third answer"]
        await send(pilot, "follow-up")
        await wait_until(pilot, lambda: len(client.requests) == 3)
        assert [m["content"] for m in client.requests[2]["messages"]] == ["first question", "first answer",
                                                                           "follow-up"]


@pytest.mark.asyncio
async def test_settings_reach_the_request(tmp_path: Path) -> None:
    client = FakeClient(["fine"])
    app = make_app(tmp_path, client)
    async with app.run_test(size=(80, 24)) as pilot:  # the dialog fits the smallest terminal
        await pilot.press("ctrl+s")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#system-prompt").text = "Answer in French."
        screen.query_one("#temperature").value = "5"  # out of range: refused, the dialog stays
        await pilot.click("#save")
        await pilot.pause()
        assert app.screen is screen and "temperature" in str(screen.query_one("#settings-error").render())
        screen.query_one("#temperature").value = "0.2"
        screen.query_one("#top-p").value = "0.5"
        screen.query_one("#max-tokens").value = "64"
        screen.query_one("#model").value = " org/other-GGUF:Q4_K_M "
        await pilot.pause(0.3)  # a button ignores a second press while it shows the first
        await pilot.click("#save")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen), str(screen.query_one("#settings-error").render())
        await send(pilot, "Bonjour")
        await wait_until(pilot, lambda: client.finished)
        sent = client.requests[0]
        assert sent["params"] == {"temperature": 0.2, "top_p": 0.5, "max_tokens": 64}
        assert sent["messages"][0] == {"role": "system", "content": "Answer in French."}
        assert sent["model"] == "org/other-GGUF:Q4_K_M"  # the chat's model


@pytest.mark.asyncio
async def test_context_overflow_is_said_plainly(tmp_path: Path) -> None:
    client = FakeClient(error=ServerError("too_long", "prompt (9000 tokens) plus max_tokens (512) is 9512 tokens "
                                                      "but the context holds 8192"))
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "a very long conversation")
        await wait_until(pilot, lambda: app.answer_worker is not None and not app.answer_worker.is_running)
        assert shown(app)[-1][0] == "note"
        note = shown(app)[-1][1]
        assert "This conversation no longer fits" in note and "Ctrl+N" in note and "9512 tokens" in note
        # nothing silently dropped or invented: the question is back in the prompt, not an unanswered turn
        assert app.conversation.messages == [] and app.query_one(PromptInput).text == "a very long conversation"


@pytest.mark.asyncio
async def test_daemon_gone_and_back(tmp_path: Path) -> None:
    client = FakeClient()
    app = make_app(tmp_path, client, stats_silence_s=0.5)
    async with app.run_test(size=(100, 30)) as pilot:
        client.stats.put_nowait(stats_message(bytes(64), []))
        await wait_until(pilot, lambda: app.last_stats)
        assert not app.daemon_gone
        await wait_until(pilot, lambda: app.daemon_gone)  # no stats for 0.5 s
        banner = app.query_one("#banner")
        assert banner.has_class("-shown") and "No word from the llmd daemon for 0.5s" in str(banner.render())
        client.stats.put_nowait(stats_message(bytes(64), []))
        await wait_until(pilot, lambda: not app.daemon_gone)
        assert not banner.has_class("-shown")


@pytest.mark.asyncio
async def test_dashboard_shows_blocks_and_requests(tmp_path: Path) -> None:
    client = FakeClient(["a b c d e f g h"], word_delay=0.05)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(160, 48)) as pilot:
        await send(pilot, "hi")
        await wait_until(pilot, lambda: "r1" in app.own_ids)
        # another client's request r7 holds blocks 0-3, ours (row 1) 4-9, 10-11 are cached
        blocks = bytes([BLOCK_FIRST_OWNER] * 4 + [BLOCK_FIRST_OWNER + 1] * 6 + [BLOCK_CACHED] * 2) + bytes(52)
        rows = [request_row("r7", owner=2), request_row("r1"), {**request_row("r9", owner=3), "format": "json_schema"}]
        client.stats.put_nowait(stats_message(blocks, rows, decode=42.0))
        await wait_until(pilot, lambda: app.last_stats)
        kv = app.query_one(KVMap)
        assert kv.own == frozenset({BLOCK_FIRST_OWNER + 1})
        rendered = kv.render()
        assert "10 used · 2 cached · 52 free · 15.6% in use" in rendered.plain
        kv.set_capacity("int8", 5648 * 16)  # what the daemon's info says of its cache (Dashboard.set_info)
        assert "15.6% in use · int8 · 90,368 tokens" in kv.render().plain
        own_cells = [span for span in rendered.spans if str(span.style) == OWN]
        assert sum(span.end - span.start for span in own_cells) >= 6  # our 6 blocks (plus the legend's cell)
        assert cell_style(BLOCK_FIRST_OWNER, kv.own) != OWN
        table = app.query_one("#requests").render().plain.splitlines()
        assert table[0].split() == ["id", "owner", "state", "prompt", "cached", "out", "tok/s", "TTFT"]
        assert table[1].split() == ["r7", "2", "running", "20", "16", "3", "31.5", "0.12s"]
        assert table[2].split()[:3] == ["r1*", "1", "running"] and table[3].split()[:2] == ["r9{}", "3"]
        assert table[4] == "* this chat  {} structured output"
        assert "decode    42.0 tok/s  ·  prefill    84.0 tok/s" in str(app.query_one("#throughput-line").render())
        assert list(app.query_one("#decode-spark").data)[-1] == 42.0


def test_conversation_files_round_trip_and_bad_files(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    chat = Conversation(messages=[{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}],
                        settings=ChatSettings(system_prompt="", temperature=0.0, top_p=1.0, max_tokens=10))
    store.save(chat)
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"messages": [{"role": "root", "content": 1}]}')
    loaded = store.list()
    assert len(loaded) == 1 and loaded[0].messages == chat.messages and loaded[0].settings == chat.settings
    assert loaded[0].request_messages() == chat.messages  # no system prompt: none sent
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(temperature=float("nan"))):
        with pytest.raises(ValueError):
            ChatSettings(**bad)


@pytest.mark.asyncio
async def test_odd_chat_files_do_not_break_the_list(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "chats")
    chat = Conversation(messages=[{"role": "user", "content": "kept"}, {"role": "assistant", "content": "yes"}])
    store.save(chat)
    original = (tmp_path / "chats" / f"{chat.id}.json").read_text()
    (tmp_path / "chats" / "my copy.json").write_text(original)  # a copy: same id inside, a space in the name
    app = make_app(tmp_path, FakeClient())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert isinstance(app.screen, ChatsScreen) and len(app.screen.chats) == 2
        (tmp_path / "chats" / "my copy.json").unlink()
        (tmp_path / "chats" / f"{chat.id}.json").write_text("{spoiled")
        await pilot.press("enter")  # whichever it is, it is gone or spoiled now: a notice, no crash
        await pilot.pause()
        assert app.conversation.messages == [] and app.is_running


def test_the_dashboard_names_the_daemons_other_models() -> None:
    from llmd.tui.dashboard import models_part

    models = [{"name": "a", "state": "loaded", "default": True}, {"name": "b", "state": "unloaded"}]
    assert models_part(models) == " · also b (unloaded)" and models_part(models[:1]) == ""


@pytest.mark.asyncio
@pytest.mark.parametrize("delay", [0.0, 0.03])
async def test_closing_mid_answer_keeps_the_partial_answer(tmp_path: Path, delay: float) -> None:
    """The app closing while an answer streams (its widgets go before its worker is cancelled)
    raises nothing, and the chat is saved with what had arrived."""
    client = FakeClient(["a b c d e f g h i j k l m n o p"], word_delay=0.05)
    app = make_app(tmp_path, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await send(pilot, "hi")
        await wait_until(pilot, lambda: len(app.query(ChatMessage)) == 2 and app.query(ChatMessage).last().source)
        await asyncio.sleep(delay)
    saved = ConversationStore(tmp_path / "chats").list()
    assert len(saved) == 1 and saved[0].messages[0] == {"role": "user", "content": "hi"}
    partial = saved[0].messages[-1]
    assert partial["role"] == "assistant" and 0 < len(partial["content"]) < len(client.answers[0])
