"""The daemon side of llmd: model loading, our own model implementations and (later) the engine
and server."""
