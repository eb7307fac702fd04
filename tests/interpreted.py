"""Run a test's code under Triton's CPU interpreter, in a fresh Python.

TRITON_INTERPRET must be set before Triton is imported, and this test process may have imported
it already (the runners do), so the code runs in a subprocess of its own, with this checkout
first on its path. It passes by printing "ok"; anything else fails the calling test with the
subprocess's stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, timeout: int = 600) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
