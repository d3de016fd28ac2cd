"""The HTTP APIs existing local apps speak, served beside the daemon (``llmd start --http``): OpenAI's
(``/v1``) and the part of Ollama's its clients use (``/api``), ``/health`` and ``/metrics``. A client
of the daemon like any other: it imports the client side only, never the runtime."""
