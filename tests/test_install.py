"""The default install is NumPy-only: what it runs imports no optional package, and a feature
that needs one says which extra to install, in one line, instead of a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tinyinfer.errors import OPTIONAL_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = sorted(OPTIONAL_PACKAGES)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def without(packages: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """Run the CLI in a Python where these packages cannot be imported (None in sys.modules
    makes `import` raise ModuleNotFoundError, exactly as on a machine without them)."""
    code = (f"import sys\nfor name in {packages!r}: sys.modules[name] = None\n"
            f"from tinyinfer.cli.commands import main\nsys.exit(main({argv!r}))")
    return run_python(code)


def test_the_default_path_imports_no_optional_package(tmp_path):
    out = str(tmp_path / "int4")
    code = ("import sys\nfrom tinyinfer.cli.commands import main\n"
            "assert main(['generate', 'ROMEO:', '--max-tokens', '3', '--seed', '1']) == 0\n"
            "assert main(['info']) == 0\n"
            f"assert main(['quantize', 'bundled', '--bits', '4', '-o', {out!r}]) == 0\n"
            f"assert main(['generate', 'ROMEO:', '--max-tokens', '3', '--model', {out!r}]) == 0\n"
            "assert main(['simulate', '--model', 'llama-3-8b']) == 0\n"
            "assert main(['simulate', '--model', 'llama-2-70b', '--hardware', 'h100', '--tensor-parallel', '4']) == 0\n"
            "assert main(['bench', 'latency', '--prompt-tokens', '16', '--max-tokens', '4']) == 0\n"
            "import tui.app, lessons.course\n"
            f"loaded = sorted(m for m in {OPTIONAL!r} if m in sys.modules)\n"
            "print('LOADED', loaded)")
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout


@pytest.mark.parametrize("packages,argv,extra", [
    (["torch"], ["generate", "Hi", "--runner", "torch", "--max-tokens", "1"], "torch"),
    (["torch"], ["bench", "latency", "--runner", "torch"], "torch"),
    (["uvicorn", "starlette"], ["serve", "--port", "0"], "serve"),
    (["torch"], ["lesson", "run", "12", "--quick", "--solution"], "torch"),
    (["torch"], ["lesson", "check", "12", "--solution"], "torch"),
])
def test_a_missing_extra_is_one_clear_line(packages, argv, extra):
    done = without(packages, argv)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("tinyinfer: error: this needs ")
    assert f"pip install -e '.[{extra}]'" in lines[0]


def test_the_python_api_names_the_extra_too():
    code = ("import sys\nsys.modules['torch'] = None\nimport tinyinfer\n"
            "try:\n    tinyinfer.load('bundled', runner='torch')\n"
            "except tinyinfer.TinyInferError as exc:\n    print('ERROR', exc)")
    done = run_python(code)
    assert "ERROR this needs torch" in done.stdout, done.stderr


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("_", "-") for r in requirements}


def test_every_optional_package_is_in_the_extra_the_error_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    default = requirement_names(project["dependencies"])
    for package, extra in OPTIONAL_PACKAGES.items():
        assert package not in default, f"{package} is optional but in the default install"
        assert package in requirement_names(extras[extra]), f"{package} is not in [{extra}]"
    assert "tinyinfer[torch,serve]" in extras["test"]  # the test extra installs everything
