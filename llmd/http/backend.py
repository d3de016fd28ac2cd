"""The HTTP front's one connection to the daemon: an :class:`llmd.AsyncClient` like any other local
app's (the dashboard shows the HTTP requests under its own client number), what the daemon says
about its model, and a cache of token texts for logprobs."""

from __future__ import annotations

import re
import time
from typing import Any

from llmd.client import AsyncClient
from llmd.http.errors import HTTPError

INFO_TTL_S = 2.0  # the model can be reloaded or switched under the same daemon: look again now and then
MAX_CACHED_PIECES = 1 << 18  # token texts kept (a vocabulary is 32k-256k tokens)


def model_id(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


class Backend:
    """Args:
        connection: the daemon's connection file's fields (endpoints and key).
    """

    def __init__(self, connection: dict[str, Any]) -> None:
        self.connection = connection
        self._client: AsyncClient | None = None
        self._info: dict[str, Any] | None = None
        self._info_at = 0.0
        self._pieces: dict[int, str] = {}

    @property
    def client(self) -> AsyncClient:
        # NOTE: made on first use, inside the server's event loop: its sockets belong to that loop.
        if self._client is None:
            self._client = AsyncClient(connection=self.connection)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def info(self) -> dict[str, Any]:
        """The daemon's ``info`` (model name, context length...), at most INFO_TTL_S old."""
        if self._info is None or time.monotonic() - self._info_at > INFO_TTL_S:
            self._info = await self.client.info()
            self._info_at = time.monotonic()
        return self._info

    async def model_id(self) -> str:
        """The served model's name as an id clients can put in a URL or an Ollama tag: the daemon's
        name (``SmolLM2-135M-Instruct (Q4_1)``) with each run of other characters made one ``-``."""
        return model_id((await self.info())["model"])

    async def check_model(self, name: Any, param: str = "model") -> str:
        """The served model's id, if ``name`` names it (the id or the daemon's name, ``:latest`` as
        Ollama clients add it, any case); else 404, as OpenAI answers an unknown model."""
        model = await self.model_id()
        if not isinstance(name, str):
            raise HTTPError(400, f"{param} must be a string (the served model is {model!r})", "invalid_type",
                            param=param)
        if name.lower().removesuffix(":latest") not in (model.lower(), str((await self.info())["model"]).lower()):
            raise HTTPError(404, f"model {name!r} is not served here; this daemon serves {model!r} "
                                 "(GET /v1/models)", "model_not_found", param=param)
        return model

    async def pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's text, from the cache or one ``detokenize``."""
        missing = sorted({t for t in token_ids if t not in self._pieces})
        fetched: dict[int, str] = {}
        for start in range(0, len(missing), 4096):
            chunk = missing[start:start + 4096]
            fetched.update(zip(chunk, await self.client.detokenize(chunk)))
        found = [fetched[t] if t in fetched else self._pieces[t] for t in token_ids]
        if len(self._pieces) + len(fetched) > MAX_CACHED_PIECES:
            self._pieces.clear()
        self._pieces.update(fetched)
        return found
