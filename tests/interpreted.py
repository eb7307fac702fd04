"""Run a test's code under Triton's CPU interpreter, in a fresh Python.

TRITON_INTERPRET must be set before Triton is imported, and this test process may have imported
it already (the runners do), so the code runs in a subprocess of its own, with this checkout
first on its path. It passes by printing "ok"; anything else fails the calling test with the
subprocess's stderr.

Triton 3.6's interpreter turns a loaded scalar into a loop bound with int() on its 1-element
array, which NumPy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6); RANGE_FIX gives it
the upstream fix first (on Triton 3.6 and older only), so a kernel's ``tl.range`` may run up to a loaded position, as on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANGE_FIX = """
import triton
import triton.runtime.interpreter as _interpreter
if tuple(int(p) for p in triton.__version__.split(".")[:2]) <= (3, 6):  # fixed upstream after 3.6
    _patch_tensor = _interpreter._patch_lang_tensor
    def _range_fix(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    _interpreter._patch_lang_tensor = _range_fix
"""


# A guard against a hung subprocess, not a bound on speed: the interpreter runs a kernel's every
# program in Python, and on a shared 2-core machine one model's decode through it took more
# than 600 s while other test runs shared the cores.
HANG_GUARD_S = 3600


def run_interpreted(code: str, timeout: int = HANG_GUARD_S) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", RANGE_FIX + code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
