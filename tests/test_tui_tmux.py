"""The real `python -m tui` in a real terminal (tmux): start, step, open help, quit."""

from __future__ import annotations

import shutil

import pytest

from tui.capture import TmuxTUI, step

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux)")


def test_walkthrough_in_tmux(text_model_folder):
    tui = TmuxTUI(["--model", str(text_model_folder), "--no-timings"], width=100, height=30)
    try:
        first = tui.wait_for("space Step")
        assert "Walkthrough · Tokenize" in first and "Prompt & tokens" in first
        screen = step(tui, 2)
        assert "Decode: one token per step" in screen
        assert "s0 pre 0:" in screen and "s0 dec@" in screen
        assert "KV cache pages" in screen and "0  0  0" in screen
        tui.press("b")
        assert "replaying recorded steps" in tui.wait_for("frame 2/3")
        tui.press("?")
        assert "Step back" in tui.wait_for("Help · escape closes")
        tui.press("Escape")
        tui.wait_for("Help · escape closes", gone=True)
        tui.press("q")
        assert tui.wait_closed(), "q did not end the program"
    finally:
        tui.close()


def test_bad_model_is_reported_on_screen(tmp_path):
    tui = TmuxTUI(["--model", str(tmp_path / "missing")], width=100, height=30)
    try:
        screen = tui.wait_for("Press q to quit")
        assert "failed" in screen and "no such file or folder" in screen
        tui.press("q")
        assert tui.wait_closed()
    finally:
        tui.close()
