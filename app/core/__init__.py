"""Qt-free cores of the app: sessions, conversations, the chat tree, export, race logic; nothing here imports Qt."""
