"""CPU threads: the default rule, and --threads reaching torch's and the BLAS's pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tinyinfer.runners import threads

READ_BACK = """
import json, sys
import torch
from threadpoolctl import threadpool_info
from tinyinfer.cli.commands import main
code = main(sys.argv[1:])
print(json.dumps({"torch": torch.get_num_threads(),
                  "blas": [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]}))
sys.exit(code)
"""


def run_cli(args: list[str], env_threads: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": env_threads}
    return subprocess.run([sys.executable, "-c", READ_BACK, *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("flag, env_threads", [("1", "3"), ("3", "1")])
def test_threads_flag_sets_torch_and_blas_and_beats_the_environment(tmp_path, flag, env_threads):
    out = tmp_path / "prefix.json"
    done = run_cli(["bench", "prefix", "--runner", "torch", "--threads", flag, "--system-tokens", "16",
                    "--json", str(out)], env_threads)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    read_back = json.loads(lines[-1])
    assert read_back["torch"] == int(flag)
    assert read_back["blas"] and set(read_back["blas"]) == {int(flag)}
    # the benchmark reports the counts it ran with, in its header and in its JSON
    assert lines[0] == f"threads: BLAS {flag}, torch {flag}"
    assert json.loads(out.read_text())["threads"] == {"blas": int(flag), "torch": int(flag)}


def test_numpy_commands_leave_torch_unimported():
    code = ("import sys; from tinyinfer.cli.commands import main; main(['info', '--threads', '2']); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"


def test_default_respects_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.default_threads() == 5


def test_default_without_environment_is_physical_cores_capped(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    count = threads.default_threads()
    assert count == min(threads.physical_cores(), threads.DEFAULT_CAP)
    assert 1 <= count <= len(threads.usable_cpus())
    monkeypatch.setattr(threads, "physical_cores", lambda: 20)  # a big machine: capped
    assert threads.default_threads() == threads.DEFAULT_CAP


def test_hyperthread_siblings_count_once(tmp_path):
    # Four logical CPUs on two cores, as Linux describes them: cpu0 and cpu2 share a core.
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert threads.physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert threads.physical_cores({0, 2}, tmp_path) == 1
    assert threads.physical_cores({0, 1, 2, 3}, tmp_path / "missing") == 4  # unknown: logical CPUs


@pytest.mark.parametrize("bad", ["0", "two"])
def test_bad_threads_flag_is_one_line_exit_2(bad):
    done = subprocess.run([sys.executable, "-m", "tinyinfer", "generate", "hi", "--threads", bad],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--threads" in done.stderr.splitlines()[-1]
