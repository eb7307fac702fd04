"""The course: every checker passes the reference solutions and fails the untouched stubs with
clear messages; the workspace commands keep students' work; every experiment's quick mode runs."""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lessons import checking, course
from lessons.support import CLAIMS
from tinyinfer.cli import lesson as cli_lesson
from tinyinfer.model import BUNDLED

LESSONS = course.discover()
IDS = [lesson.name for lesson in LESSONS]
ROOT = Path(__file__).resolve().parent.parent
BUNDLED_MISSING = not (BUNDLED["bundled"] / "config.json").is_file()


def stub_functions(lesson: course.Lesson) -> set[str]:
    """Top-level functions and classes of the exercise whose bodies the student writes (they raise
    NotImplementedError); given helpers are left out."""
    tree = ast.parse(lesson.file("exercise.py").read_text(encoding="utf-8"))
    def is_stub(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Raise) and isinstance(n.exc, ast.Name) and n.exc.id == "NotImplementedError"
                   for n in ast.walk(node))
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and is_stub(node)}


def test_there_are_lessons_for_every_stage():
    assert [lesson.slug for lesson in LESSONS] == [
        "tokens", "forward-pass", "prefill-decode", "kv-cache", "sampling", "paged-attention",
        "continuous-batching", "prefix-caching", "speculative-decoding", "quantization", "cost-capacity",
        "tensor-parallelism", "chunked-prefill"]


@pytest.mark.parametrize("lesson", LESSONS, ids=IDS)
def test_lesson_folder_is_complete(lesson):
    for name in ("README.md", "exercise.py", "solution.py", "check.py", "experiment.py"):
        assert lesson.file(name).is_file(), f"{lesson.name} lacks {name}"
    assert lesson.minutes, f"{lesson.name}/README.md needs a 'Time:' line"
    assert all(c in CLAIMS for c in lesson.claims), f"{lesson.name} names unknown claims {lesson.claims}"
    assert stub_functions(lesson), f"{lesson.name}/exercise.py has nothing to fill in"


@pytest.mark.parametrize("lesson", LESSONS, ids=IDS)
def test_checker_passes_the_solution(lesson):
    report = course.check(lesson, lesson.file("solution.py"))
    failures = "\n".join(report.render().splitlines()[-30:])
    assert report.passed, failures
    assert {o.case.function for o in report.outcomes} == stub_functions(lesson)


@pytest.mark.parametrize("lesson", LESSONS, ids=IDS)
def test_checker_fails_the_stub_with_clear_messages(lesson):
    report = course.check(lesson, lesson.file("exercise.py"))
    text = report.render(retry="check again")
    assert not report.passed
    assert all(o.status == "todo" for o in report.outcomes)
    for function in {o.case.function for o in report.outcomes}:
        assert f"todo  {function}: not written yet" in text
    assert "Traceback" not in text and "0 of" in text


def wrong_copy(tmp_path: Path, lesson: str, old: str, new: str) -> Path:
    """The solution of a lesson with one line changed, as a student's mistake."""
    source = course.find(lesson).file("solution.py").read_text(encoding="utf-8")
    assert old in source
    path = tmp_path / "exercise.py"
    path.write_text(source.replace(old, new), encoding="utf-8")
    return path


def test_a_wrong_answer_shows_the_case_expected_got_and_a_hint(tmp_path):
    path = wrong_copy(tmp_path, "02", "np.mean(x * x, axis=-1, keepdims=True) + eps", "np.mean(x * x) + eps")
    text = course.check(course.find("02"), path).render()
    block = text.split("FAIL  rms_norm · a fixed 2x4 input")[1].split("\n  ok")[0]
    assert "does not match the engine" in block
    assert "expected [[" in block and "got      [[" in block and "largest difference" in block
    assert "hint: rms = sqrt(mean(x * x, axis=-1, keepdims=True) + eps)" in block
    assert "Traceback" not in text


def test_an_exception_in_student_code_names_its_line(tmp_path):
    path = wrong_copy(tmp_path, "06", "return len(self.free_pages)", "return len(self.free_pages) + self.missing")
    text = course.check(course.find("06"), path).render()
    assert "raised AttributeError" in text
    assert re.search(r"at line \d+ of your exercise, in num_free: return len\(self.free_pages\) \+ self.missing", text)
    assert "Traceback" not in text


def test_an_endless_loop_is_stopped_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(checking, "CASE_TIME_LIMIT", 1)
    path = wrong_copy(tmp_path, "07", "    while waiting or running:", "    while True:")
    text = course.check(course.find("07"), path).render()
    assert "simulate_batching ran for more than 1 s: is there a loop that never ends?" in text
    assert "not run: simulate_batching did not finish above" in text
    assert "Traceback" not in text


def test_an_exercise_that_does_not_load_says_where(tmp_path):
    path = tmp_path / "exercise.py"
    path.write_text("def chars_per_token(text, ids)\n    return 1\n", encoding="utf-8")
    report = course.check(course.find("01"), path)
    assert not report.passed
    assert "does not load: SyntaxError at line 1" in report.render()


def test_start_copies_the_exercise_and_never_overwrites(tmp_path):
    lesson = course.find("tokens")
    first = course.start(lesson, tmp_path)
    exercise = tmp_path / lesson.name / "exercise.py"
    assert "created" in first and exercise.read_text() == lesson.file("exercise.py").read_text()
    exercise.write_text("# my work\n")
    again = course.start(lesson, tmp_path)
    assert exercise.read_text() == "# my work\n"
    assert "kept" in again and "nothing was overwritten" in again


def test_list_shows_progress_per_lesson(tmp_path):
    course.start(course.find("01"), tmp_path)
    course.start(course.find("02"), tmp_path)
    (tmp_path / "01-tokens" / "exercise.py").write_text(course.find("01").file("solution.py").read_text())
    states = {lesson.number: state for lesson, state in course.progress(tmp_path)}
    assert states["01"].startswith("passed (")
    assert states["02"].startswith("in progress (0/")
    assert states["03"] == "not started"
    assert (tmp_path / course.PROGRESS_FILE).is_file()


def cli(argv: list[str]) -> int:
    """Run `tinyinfer lesson ...` through the parser the main CLI registers."""
    parser = argparse.ArgumentParser(prog="tinyinfer")
    cli_lesson.add_parser(parser.add_subparsers(dest="command"))
    return cli_lesson.run(parser.parse_args(argv))


def test_cli_check_and_errors(tmp_path, capsys):
    assert cli(["lesson", "check", "8", "--solution"]) == 0
    assert "All 6 cases pass" in capsys.readouterr().out
    assert cli(["lesson", "check", "01", "--dir", str(tmp_path)]) == 2
    assert "is not started" in capsys.readouterr().err
    assert cli(["lesson", "run", "nope"]) == 2
    assert "there is no lesson nope;" in capsys.readouterr().err


def test_run_refuses_an_unfinished_exercise(tmp_path, capsys):
    assert cli(["lesson", "start", "05", "--dir", str(tmp_path)]) == 0
    assert cli(["lesson", "run", "05", "--quick", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "todo  sample: not written yet" in out and "--solution" in out and "Traceback" not in out


@pytest.mark.skipif(BUNDLED_MISSING, reason="the bundled model (tinyinfer/data/shakespeare) is not installed; "
                                            "experiments measure it")
@pytest.mark.parametrize("lesson", LESSONS, ids=IDS)
def test_experiment_quick_mode_reports_its_claims(lesson):
    # A fresh interpreter with one BLAS thread: on a busy machine, BLAS threads waiting for a
    # free core make small matrix products many times slower.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "lessons", "run", lesson.number, "--quick", "--solution"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for claim_id in lesson.claims:
        assert f"[{claim_id}] claim:" in done.stdout
    assert done.stdout.count("verdict:") == len(lesson.claims)


def test_the_engine_reaches_every_plug_point():
    """A lesson puts student code in the engine at a stage's declared plug points; a refactor
    that stops calling one would leave the student's code silently unused. Plug a counting
    stand-in into every point and run the engine through all of them."""
    from collections import Counter
    from contextlib import ExitStack

    import tinyinfer
    from lessons.support import LessonError, plugged
    from tinyinfer import engine, kv, sampling
    from tinyinfer.runners import numpy_ref
    from tinyinfer.speculative import DraftModelDrafter

    calls: Counter[str] = Counter()

    def counting(label: str, original):
        def stand_in(*args, **kwargs):
            calls[label] += 1
            return original(*args, **kwargs)
        return stand_in

    targets = (numpy_ref, numpy_ref.NumpyRunner, sampling, kv, engine)
    points = [f"{t.__name__}.{name}" for t in targets for name in t.PLUG_POINTS]
    model = tinyinfer.load("bundled")
    sampled = tinyinfer.SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    prompt = "To be, or not to be, that is the question: whether 'tis nobler in the mind"
    with ExitStack() as stack:
        for target in targets:
            for name in target.PLUG_POINTS:
                label = f"{target.__name__}.{name}"
                stack.enter_context(plugged(target, name, counting(label, getattr(target, name))))
        tinyinfer.Engine(model).generate([prompt, prompt], sampled)  # the second hits the cache
        drafter = DraftModelDrafter(tinyinfer.load("bundled-draft"))
        tinyinfer.Engine(model, drafter=drafter).generate(prompt, sampled)
        greedy = tinyinfer.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        tinyinfer.Engine(model, drafter=drafter).generate(prompt, greedy)
    assert {p: calls[p] for p in points if not calls[p]} == {}
    with pytest.raises(LessonError, match="not a plug point"):  # a name the engine never calls
        with plugged(kv, "hash_pages", len):
            pass


def test_lesson_01_catches_a_decode_that_works_token_by_token(tmp_path):
    # Decoding each token's bytes on its own turns a character split over two tokens into two
    # replacement characters: the case named for it must fail, with its hint.
    from importlib import import_module

    path = wrong_copy(tmp_path, "01", 'return b"".join(token_bytes[i] for i in ids).decode("utf-8", errors="replace")',
                      'return "".join(token_bytes[i].decode("utf-8", errors="replace") for i in ids)')
    text = course.check(course.find("01"), path).render()
    assert "FAIL  decode · ids that cut a character in half" in text
    assert "decode once" in text
    check = import_module(course.module_name(course.find("01"), "check"))
    assert len(check.split_characters()) >= 4, "the case must really split characters"


@pytest.mark.parametrize("lesson", LESSONS, ids=IDS)
def test_see_it_commands_parse_as_written(lesson):
    # A lesson's "See it" line sends students to the TUI or the CLI: the commands must exist.
    from tinyinfer.cli.commands import build_parser

    readme = lesson.file("README.md").read_text(encoding="utf-8")
    line = re.search(r"^See it:(.*)$", readme, re.M)
    assert line, f"{lesson.name}/README.md has no 'See it:' line"
    commands = re.findall(r"`tinyinfer ([^`]+)`", line.group(1))
    assert commands
    for command in commands:
        if command.split()[0] in ("quantize", "info") and "--help" in command:
            continue  # prints help and exits, by design
        build_parser().parse_args(shlex.split(command))
