"""The TUI's screens: loading, the run itself, and the dialogs over it."""
