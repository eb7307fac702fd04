"""The tinyinfer TUI: step through a real inference run, one engine step at a time.

Launch it with `tinyinfer tui` or `python -m tui`. Importing this package is cheap: Textual
is only imported by `tui.app` and the modules it uses, when the interface actually starts.
"""
