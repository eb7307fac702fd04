"""Drive the real `python -m tui` inside tmux and print what the terminal shows.

Used by the tmux test and to make the captures in the docs:

    python -m tui.capture --steps 3 --out docs/tui-capture.txt -- --scenario batching --no-timings
    python -m tui.capture --steps 0 --keys c --wait "same text as off" -- --scenario speculative
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class TmuxTUI:
    """`python -m tui ARGS` running in a detached tmux session of a fixed size."""

    def __init__(self, args: list[str], width: int = 120, height: int = 40) -> None:
        if shutil.which("tmux") is None:
            raise RuntimeError("tmux is not installed: apt-get install tmux")
        self.name = f"tinyinfer-tui-{os.getpid()}-{time.monotonic_ns()}"
        command = " ".join([sys.executable, "-m", "tui", *args])
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width),
                        "-y", str(height), "-c", str(ROOT), command], check=True)

    def screen(self) -> str:
        """The visible pane as text."""
        out = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name],
                             capture_output=True, text=True, check=True)
        return out.stdout

    def wait_for(self, text: str, timeout: float = 60.0, gone: bool = False) -> str:
        """Poll the screen until it shows text (or, with gone, no longer does); return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if (text in screen) != gone:
                return screen
            time.sleep(0.1)
        raise TimeoutError(f"{text!r} never {'went' if gone else 'appeared'}; the screen shows:\n"
                           f"{self.screen()}")

    def press(self, *keys: str) -> None:
        """Send tmux key names (`Space`, `q`, `?`, `Escape`)."""
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "has-session", "-t", self.name],
                              capture_output=True).returncode == 0

    def wait_closed(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self.alive()

    def close(self) -> None:
        if self.alive():
            subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def step(tui: TmuxTUI, steps: int) -> str:
    """Press space `steps` times, each time waiting for the status line to show the step."""
    screen = tui.wait_for("space Step")
    for n in range(1, steps + 1):
        tui.press("Space")
        screen = tui.wait_for(f"step {n} ")
    return screen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tui.capture", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="engine steps before the capture")
    parser.add_argument("--size", default="120x40", help="terminal WIDTHxHEIGHT (default 120x40)")
    parser.add_argument("--keys", nargs="*", default=[], metavar="KEY",
                        help="tmux key names to press after the steps (c opens the comparison)")
    parser.add_argument("--wait", default=None, metavar="TEXT",
                        help="after the keys, wait until the screen shows TEXT")
    parser.add_argument("--out", type=Path, default=None, help="write the capture here")
    parser.add_argument("tui_args", nargs="*", help="arguments for python -m tui (after --)")
    args = parser.parse_args(argv)
    width, height = (int(x) for x in args.size.split("x"))
    tui = TmuxTUI(args.tui_args, width, height)
    try:
        step(tui, args.steps)
        for key in args.keys:
            tui.press(key)
        if args.wait is not None:
            tui.wait_for(args.wait, timeout=180.0)
        time.sleep(0.3)  # let the last redraw land
        screen = tui.screen()
        tui.press("q")
        tui.wait_closed()
    finally:
        tui.close()
    if args.out is not None:
        args.out.write_text(screen, encoding="utf-8")
    print(screen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
