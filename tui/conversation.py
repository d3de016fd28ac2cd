"""A chat and its settings, saved as one JSON file per chat under ``$XDG_DATA_HOME/llmd/chats``."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("user", "assistant")


@dataclass(slots=True)
class ChatSettings:
    """What every request of a chat is sent with. Raises ``ValueError`` with the fix in the message."""

    # Empty: the model's chat template supplies its own default (small models are tuned to it).
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.9
    max_tokens: int = 512
    model: str = ""  # the model to answer (a name from `llmd models`); empty: the daemon's default

    def __post_init__(self) -> None:
        if not isinstance(self.system_prompt, str):
            raise ValueError("the system prompt must be text")
        if not isinstance(self.model, str) or len(self.model) > 1024:
            raise ValueError("the model must be a name from `llmd models` (empty: the daemon's default)")
        self.model = self.model.strip()
        for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not low <= value <= high or (name == "top_p" and value == 0):
                raise ValueError(f"{name} must be a number in {'(' if name == 'top_p' else '['}{low:g}, {high:g}], "
                                 f"got {value!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens:
            raise ValueError(f"max tokens must be a whole number >= 1, got {self.max_tokens!r}")

    def params(self) -> dict[str, Any]:
        """The sampling parameters of a ``generate`` request."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}


@dataclass(slots=True)
class Conversation:
    messages: list[dict[str, str]] = field(default_factory=list)  # user/assistant turns, no system message
    settings: ChatSettings = field(default_factory=ChatSettings)
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    updated: float = field(default_factory=time.time)

    @property
    def title(self) -> str:
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        line = " ".join(first.split())
        return (line[:60] + "…") if len(line) > 60 else (line or "(empty chat)")

    def request_messages(self) -> list[dict[str, str]]:
        """The messages a request sends: the system prompt (if any), then the turns."""
        system = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return system + self.messages

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "updated": self.updated, "settings": asdict(self.settings),
                           "messages": self.messages}, ensure_ascii=False, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Conversation:
        """Raises ``ValueError`` if the text is not a saved chat."""
        try:
            data = json.loads(text)
            messages = data["messages"]
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                    for m in messages):
                raise ValueError("messages must be a list of user/assistant turns")
            updated = float(data["updated"])
            if not 0 <= updated < 1e11:
                raise ValueError(f"updated is not a time: {updated}")
            return cls(messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                       settings=ChatSettings(**data["settings"]), id=str(data["id"]), updated=updated)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a saved chat: {e}") from None


class ConversationStore:
    """One ``<id>.json`` per chat in ``directory``, written atomically (a crash never leaves half a file)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def save(self, conversation: Conversation) -> None:
        conversation.updated = time.time()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.directory / f"{conversation.id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(conversation.to_json(), encoding="utf-8")
        os.replace(tmp, path)

    def load(self, chat_id: str) -> Conversation:
        """Raises ``ValueError`` if the file is gone or not a chat."""
        return self._read(self.directory / f"{chat_id}.json")

    @staticmethod
    def _read(path: Path) -> Conversation:
        try:
            chat = Conversation.from_json(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"cannot read {path.name}: {e.strerror}") from None
        chat.id = path.stem  # the file name wins: a copied or renamed file is its own chat
        return chat

    def list(self) -> list[Conversation]:
        """Saved chats, newest first; files that are not chats are skipped."""
        chats = []
        for path in self.directory.glob("*.json"):
            try:
                chats.append(self._read(path))
            except ValueError:
                continue
        return sorted(chats, key=lambda c: c.updated, reverse=True)
