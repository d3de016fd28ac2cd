"""`llmd chat` against a real daemon on a tiny model: the answer streams in, and the dashboard's KV map
shows this chat's blocks in use while it generates and cached blocks after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from daemon_helpers import daemon_env, fault_env, start_daemon, stop_daemon
from tiny_models import make_hf_model, save_hf_model

from llmd.client import AsyncClient
from llmd.protocol import BLOCK_CACHED
from llmd.tui.app import ChatApp
from llmd.tui.chat_view import ChatMessage, PromptInput
from llmd.tui.conversation import ChatSettings, ConversationStore
from llmd.tui.dashboard import Dashboard
from llmd.tui.kv_map import KVMap


class NoEosClient(AsyncClient):
    """The random tiny model may sample its end-of-text token at once: generate a fixed length."""

    def chat(self, messages, **kwargs):
        return super().chat(messages, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tui-daemon")
    model_dir = save_hf_model(make_hf_model("qwen2"), tmp / "model", with_tokenizer=True)
    # NOTE: 10 ms a step: this tiny model's 200 tokens otherwise take a fraction of a second, between
    # two of the 4-a-second stats messages, which then never catch the chat's blocks in use.
    socket_dir, env = tmp / "run", fault_env(daemon_env(tmp), LLMD_TEST_STEP_DELAY_S="0.01")
    connection = start_daemon(model_dir, socket_dir, "--block-size", "4", "--kv-cache-mb", "1", env=env)
    yield connection
    stop_daemon(socket_dir, env)


@pytest.mark.asyncio
async def test_chat_with_a_real_daemon(daemon, tmp_path: Path) -> None:
    async with NoEosClient(connection=daemon) as client:
        app = ChatApp(client, ConversationStore(tmp_path / "chats"))
        async with app.run_test(size=(160, 48)) as pilot:
            app.query_one(Dashboard).redraw_interval_s = 0  # record every stats message, not twice a second
            kv_map = app.query_one(KVMap)
            shown: list[tuple[int, int]] = []  # per update of the map: (this chat's blocks, cached blocks)
            update = kv_map.update_map

            def record(block_map: bytes, own: frozenset[int]) -> None:
                shown.append((sum(block_map.count(v) for v in own), block_map.count(BLOCK_CACHED)))
                update(block_map, own)

            kv_map.update_map = record
            await wait_until(pilot, lambda: shown)  # subscribed (PUB/SUB drops what is sent before)
            app.conversation.settings = ChatSettings(temperature=0.0, max_tokens=200)
            app.query_one(PromptInput).insert("What is the capital of France?")
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.answer_worker is not None and not app.answer_worker.is_running)
            # a prompt of ~20 tokens plus up to 200 generated, 4 tokens per block
            assert max(own for own, _ in shown) >= 5, "the KV map never showed this chat's blocks in use"
            answer = app.conversation.messages[-1]
            assert answer["role"] == "assistant" and len(answer["content"]) > 0
            assert app.query(ChatMessage).last().source == answer["content"]  # streamed into the view
            # after the answer: none held, its full blocks cached for the next turn
            await wait_until(pilot, lambda: shown[-1][0] == 0 and shown[-1][1] >= 5)
            assert app.last_stats["num_running"] == 0


async def wait_until(pilot, predicate, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await pilot.pause(0.02)
