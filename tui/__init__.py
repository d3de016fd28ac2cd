"""`llmd chat`: the Textual terminal UI. Arrives with the chat UI issue."""
