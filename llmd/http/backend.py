"""The HTTP front's one connection to the daemon: an :class:`llmd.AsyncClient` like any other local
app's (the dashboard shows the HTTP requests under its own client number), what the daemon says
about its model, and a cache of token texts for logprobs."""

from __future__ import annotations

import re
import time
from typing import Any

from llmd.client import AsyncClient, ServerError
from llmd.http.errors import HTTPError

INFO_TTL_S = 2.0  # the model can be reloaded or switched under the same daemon: look again now and then
MAX_CACHED_PIECES = 1 << 18  # token texts kept (a vocabulary is 32k-256k tokens)


def model_id(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


class Backend:
    """The daemon's default model, and through :meth:`check_model` a view of any model a request names
    (:class:`ModelView`: its ``info``, token texts, and the name to send as ``model``).

    Args:
        connection: the daemon's connection file's fields (endpoints and key).
    """

    def __init__(self, connection: dict[str, Any]) -> None:
        self.connection = connection
        self._client: AsyncClient | None = None
        self._views: dict[str | None, ModelView] = {}

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

    def view(self, model: str | None = None) -> ModelView:
        """The view of ``model`` (None: the default), kept (its caches with it)."""
        if model not in self._views:
            if len(self._views) > MAX_VIEWS:
                self._views = {None: self._views[None]} if None in self._views else {}
            self._views[model] = ModelView(self, model)
        return self._views[model]

    async def info(self) -> dict[str, Any]:
        """The daemon's ``info`` (its default model's name, context length...), at most INFO_TTL_S old."""
        return await self.view().info()

    async def model_id(self) -> str:
        """The default model's name as an id clients can put in a URL or an Ollama tag: the daemon's
        name (``SmolLM2-135M-Instruct (Q4_1)``) with each run of other characters made one ``-``."""
        return model_id((await self.info())["model"])

    async def check_model(self, name: Any, param: str = "model") -> ModelView:
        """The view of the model ``name`` names: the default for its id or the daemon's name for it
        (``:latest`` as Ollama clients add it, any case); any other name is sent to the daemon as it
        is, which loads that model or answers ``model_not_found`` (a 404, as OpenAI answers an
        unknown model)."""
        default = await self.model_id()
        if not isinstance(name, str) or not name:
            raise HTTPError(400, f"{param} must be a string (the default model is {default!r}; GET /v1/models)",
                            "invalid_type", param=param)
        wanted = name.removesuffix(":latest")
        if wanted.lower() in (default.lower(), str((await self.info())["model"]).lower()):
            return self.view()
        return self.view(wanted)

    async def pieces(self, token_ids: list[int]) -> list[str]:
        return await self.view().pieces(token_ids)


MAX_VIEWS = 64


class ModelView:
    """One model as the HTTP APIs see it: ``model`` (None for the default, else the name the
    daemon gets in ``generate``), its ``id`` in responses, its ``info`` and its token texts."""

    def __init__(self, backend: Backend, model: str | None) -> None:
        self.backend, self.model = backend, model
        self._info: dict[str, Any] | None = None
        self._info_at = 0.0
        self._pieces: dict[int, str] = {}

    @property
    def client(self) -> AsyncClient:
        return self.backend.client

    async def id(self) -> str:
        return await self.backend.model_id() if self.model is None else self.model

    async def info(self) -> dict[str, Any]:
        """Its ``info`` at most INFO_TTL_S old. A model the daemon has not loaded yet has none: the
        default's daemon fields then, with ``max_model_len`` unknown (None)."""
        if self._info is None or time.monotonic() - self._info_at > INFO_TTL_S:
            try:
                self._info = await self.client.info(self.model)
            except ServerError as e:
                if e.code != "model_not_found":
                    raise
                return {**await self.backend.info(), "model": self.model, "max_model_len": None,
                        "sampling_defaults": {}, "chat_template": True}
            self._info_at = time.monotonic()
        return self._info

    async def pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's text, from the cache or one ``detokenize`` (by its tokenizer)."""
        missing = sorted({t for t in token_ids if t not in self._pieces})
        fetched: dict[int, str] = {}
        for start in range(0, len(missing), 4096):
            chunk = missing[start:start + 4096]
            fetched.update(zip(chunk, await self.client.detokenize(chunk, model=self.model)))
        found = [fetched[t] if t in fetched else self._pieces[t] for t in token_ids]
        if len(self._pieces) + len(fetched) > MAX_CACHED_PIECES:
            self._pieces.clear()
        self._pieces.update(fetched)
        return found
