"""`llmd chat`: the Textual terminal UI, a client of the daemon through ``llmd.AsyncClient``.

app.py (the App: layout, keys, workers), chat_view.py (messages and the prompt), dashboard.py (what the
engine is doing), kv_map.py (the KV block map), screens.py (help, settings, saved chats), conversation.py
(chats and their settings, saved as JSON under the XDG data dir), llmd.tcss (all styles).
"""
