"""Snapshots of `llmd chat`'s main screen with fixed data, at the smallest supported terminal (80x24, chat
only) and a large one (160x48, chat and dashboard). Regenerate after a deliberate change of the look
with ``pytest tests/test_tui_snapshots.py --snapshot-update`` and review the SVGs under __snapshots__."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_chat_client import FakeClient, request_row, stats_message

from llmd.protocol import BLOCK_CACHED, BLOCK_FIRST_OWNER, BLOCK_SHARED
from llmd.tui.app import ChatApp
from llmd.tui.chat_view import PromptInput
from llmd.tui.conversation import Conversation, ConversationStore
from llmd.tui.dashboard import Dashboard

MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is **Paris**."},
    {"role": "user", "content": "And its population?"},
    {"role": "assistant", "content": "About 2.1 million people live in Paris itself, and over 12 million in the "
                                     "metropolitan area."},
]
# 96 blocks: two requests of other clients, a shared prefix, this chat's request, cached and free blocks
BLOCK_MAP = bytes([BLOCK_FIRST_OWNER] * 10 + [BLOCK_SHARED] * 4 + [BLOCK_FIRST_OWNER + 1] * 7
                  + [BLOCK_FIRST_OWNER + 2] * 12 + [BLOCK_CACHED] * 20) + bytes(43)
ROWS = [request_row("r7", owner=2, generated=54), request_row("r8", owner=3, generated=12),
        request_row("r9", owner=1, generated=33)]


def make_app(tmp_path: Path) -> ChatApp:
    app = ChatApp(FakeClient(), ConversationStore(tmp_path / "chats"), stats_silence_s=3600)
    app.conversation = Conversation(messages=[dict(m) for m in MESSAGES])
    app.own_ids = {"r9"}
    return app


async def show_fixed_data(pilot) -> None:
    app = pilot.app
    # the prompt's cursor drawn steadily: blinking, a loaded machine caught it in either phase
    app.query_one(PromptInput).cursor_blink = False
    app.query_one(Dashboard).redraw_interval_s = 0  # draw each message now: the last one is what is shown
    while not app._have_info:  # the model line is in; then _open resets the status line
        await pilot.pause(0.01)
    await app._open(app.conversation)
    rates = [0.0, 12.0, 40.0, 85.0, 120.0, 96.0, 130.0, 140.0, 138.0, 90.0]
    for decode in rates:
        app.client.stats.put_nowait(stats_message(BLOCK_MAP, ROWS, decode=decode))
    # (until the dashboard has taken the last one: an empty queue alone left it undrawn on a loaded machine)
    dashboard = app.query_one(Dashboard)
    while list(dashboard.decode)[-len(rates):] != rates:
        await pilot.pause(0.01)
    await pilot.pause(0.1)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_main_screen(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=show_fixed_data)


def test_dashboard_on_a_narrow_terminal(snap_compare, tmp_path: Path) -> None:
    async def show_dashboard(pilot) -> None:
        await show_fixed_data(pilot)
        await pilot.press("f2")

    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24), run_before=show_dashboard)
