"""Progress bars: drawn on a terminal's stderr, absent from pipes; stdout the same either way."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

from rich.console import Console

from tinyinfer.display import progress

BENCH = [sys.executable, "-m", "tinyinfer", "bench", "prefix", "--system-tokens", "16"]


def run_with_terminal_stderr(command: list[str]) -> tuple[str, str]:
    """Run with stderr on a pseudo-terminal and stdout on a pipe; (stdout, terminal output)."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 300  # a hung child fails the test instead of hanging the run
    while True:
        if not select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
            process.kill()
            raise AssertionError("the command wrote nothing for 300 s")
        try:
            data = os.read(master, 4096)
        except OSError:  # the terminal closed: every writer has exited
            break
        if not data:
            break
        chunks.append(data)
    stdout = process.stdout.read().decode()
    process.wait(timeout=120)
    os.close(master)
    assert process.returncode == 0
    return stdout, b"".join(chunks).decode(errors="replace")


def test_bench_draws_progress_on_a_terminal_and_not_in_a_pipe():
    stdout_tty, terminal = run_with_terminal_stderr(BENCH)
    assert "prefix: repeats" in terminal
    assert "━" in terminal  # the bar itself
    piped = subprocess.run(BENCH, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0
    assert "prefix: repeats" not in piped.stderr and "\x1b" not in piped.stderr
    # stdout carries the results alone, the same shape with or without a terminal
    for out in (stdout_tty, piped.stdout):
        assert "\x1b" not in out
        assert [line.split(":")[0] for line in out.splitlines()] == ["threads", "shared prefix 16 tokens"]


def test_nested_tasks_share_one_display_and_hidden_draws_nothing():
    screen = io.StringIO()
    progress.use_console(Console(file=screen, force_terminal=True, width=100))
    try:
        with progress.task("outer", total=2) as outer:
            for _ in progress.track(range(3), "inner"):
                pass
            outer()
        assert "outer" in screen.getvalue() and "inner" in screen.getvalue()
        before = len(screen.getvalue())
        with progress.hidden():
            for _ in progress.track(range(3), "hidden work"):
                pass
        assert "hidden work" not in screen.getvalue()[before:]
    finally:
        progress.use_console(None)
