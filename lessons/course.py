"""Runs the course: find lessons, copy exercises into a workspace, check them, run experiments.

`tinyinfer lesson ...` and `python -m lessons ...` both land here (`add_arguments` and
`run_command`). A student's work lives in a workspace folder, one sub-folder per lesson; the
course never writes over a file that is already there.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from lessons.checking import Report, where_in_student_code
from lessons.support import LessonError, busy_warning
from tinyinfer.cli.common import Parser, add_threads_arg, fail
from tinyinfer.errors import MissingPackageError, missing_package

HERE = Path(__file__).parent
DEFAULT_WORKSPACE = Path("tinyinfer-lessons")
PROGRESS_FILE = ".progress.json"


@dataclass(frozen=True)
class Lesson:
    """One lesson folder: NN-topic with README.md, exercise.py, solution.py, check.py, experiment.py."""

    number: str
    slug: str
    folder: Path
    title: str
    claims: tuple[str, ...]
    minutes: str

    @property
    def name(self) -> str:
        return self.folder.name

    def file(self, name: str) -> Path:
        return self.folder / name


def discover(root: Path = HERE) -> list[Lesson]:
    """Every lesson folder under ``root``, in order."""
    lessons = []
    for folder in sorted(root.glob("[0-9][0-9]-*")):
        if not (folder / "README.md").is_file():
            continue
        readme = (folder / "README.md").read_text(encoding="utf-8")
        title = readme.splitlines()[0].lstrip("# ").strip()
        claims_line = re.search(r"^Claims checked:(.*)$", readme, re.M)
        minutes = re.search(r"^Time:\s*(.*)$", readme, re.M)
        number, slug = folder.name.split("-", 1)
        lessons.append(Lesson(number, slug, folder, title,
                              tuple(re.findall(r"\bC\d+\b", claims_line.group(1))) if claims_line else (),
                              minutes.group(1).strip() if minutes else ""))
    return lessons


def find(ref: str, root: Path = HERE) -> Lesson:
    """A lesson by number ("1", "01"), topic ("tokens") or folder name ("01-tokens")."""
    lessons = discover(root)
    key = ref.strip().lower()
    for lesson in lessons:
        if key in (lesson.name, lesson.slug) or (key.isdigit() and int(key) == int(lesson.number)):
            return lesson
    names = ", ".join(lesson.name for lesson in lessons)
    raise LessonError(f"there is no lesson {ref}; the lessons are: {names}")


# ---------------------------------------------------------------- loading code


class LoadError(Exception):
    """A Python file that does not import, described in one line."""


def load_module(path: Path, name: str) -> ModuleType:
    """Import a file by path (lesson folders are not packages: their names start with digits)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise LoadError(f"SyntaxError at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        del sys.modules[name]
        missing = missing_package(exc) if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None:  # PyTorch for lesson 12, say: an install away, not a bug
            raise missing from None
        where = where_in_student_code(exc, str(path))
        raise LoadError(f"{type(exc).__name__}: {exc}" + (f" ({where[0]})" if where else "")) from None
    return module


def module_name(lesson: Lesson, kind: str) -> str:
    return f"lessons._{lesson.number}_{lesson.slug.replace('-', '_')}_{kind}"


def exercise_path(lesson: Lesson, workspace: Path) -> Path:
    return workspace / lesson.name / "exercise.py"


def implementation_path(lesson: Lesson, workspace: Path, solution: bool) -> Path:
    """The file to check or run: the teacher's solution, or the student's exercise."""
    if solution:
        return lesson.file("solution.py")
    path = exercise_path(lesson, workspace)
    if not path.is_file():
        raise LessonError(f"lesson {lesson.number} is not started in {workspace}/: run "
                          f"`tinyinfer lesson start {lesson.number}` first (or pass --dir to point "
                          "at your workspace, or --solution to use the teacher's version)")
    return path


# ---------------------------------------------------------------- commands


def start(lesson: Lesson, workspace: Path) -> str:
    """Copy the exercise and the lesson text into the workspace; never overwrite anything."""
    target = workspace / lesson.name
    target.mkdir(parents=True, exist_ok=True)
    lines = [f"{lesson.title}"]
    for name in ("exercise.py", "README.md"):
        dest = target / name
        if dest.exists():
            lines.append(f"  kept     {dest} (already there; nothing was overwritten)")
        else:
            shutil.copyfile(lesson.file(name), dest)
            lines.append(f"  created  {dest}")
    lines += ["", f"Next: read {target / 'README.md'}, fill in the functions of "
              f"{target / 'exercise.py'},",
              f"then run `tinyinfer lesson check {lesson.number}{_dir_flag(workspace)}`."]
    return "\n".join(lines)


def check(lesson: Lesson, path: Path) -> Report:
    """Run a lesson's checker against one implementation file."""
    checker = load_module(lesson.file("check.py"), module_name(lesson, "check"))
    title = f"Lesson {lesson.title}"
    try:
        module = load_module(path, module_name(lesson, f"impl_{_digest(path)[:8]}"))
    except LoadError as exc:
        return Report(title, str(path), (), load_error=str(exc))
    return Report(title, str(path), tuple(checker.checks.run(module)))


def run_experiment(lesson: Lesson, path: Path, quick: bool, model: str, threads: int | None = None) -> None:
    """Run a lesson's experiment with the implementation at ``path`` plugged into the engine."""
    from tinyinfer.runners import threads as cpu_threads

    experiment = load_module(lesson.file("experiment.py"), module_name(lesson, "experiment"))
    cpu_threads.use(threads)  # after the import: torch's pool too, for experiments that use it
    try:
        impl = load_module(path, module_name(lesson, f"impl_{_digest(path)[:8]}"))
    except LoadError as exc:
        raise LessonError(f"{path} does not load: {exc}") from None
    warning = busy_warning()
    if warning:
        print(warning)
    try:
        experiment.run(impl, quick=quick, model=model)
    except NotImplementedError:
        raise LessonError(f"part of {path} is still a stub (it raises NotImplementedError): finish "
                          f"it with `tinyinfer lesson check {lesson.number}`, or run the teacher's "
                          "version with --solution") from None


def progress(workspace: Path) -> list[tuple[Lesson, str]]:
    """Each lesson with its state in the workspace: not started, in progress (k/n), passed."""
    cache = _read_progress(workspace)
    rows = []
    for lesson in discover():
        path = exercise_path(lesson, workspace)
        if not path.is_file():
            rows.append((lesson, "not started"))
            continue
        key = _digest(path) + _digest(lesson.file("check.py"))
        entry = cache.get(lesson.name)
        if entry is None or entry.get("key") != key:
            report = check(lesson, path)
            entry = {"key": key, "ok": report.num_ok, "total": len(report.outcomes),
                     "passed": report.passed, "load_error": bool(report.load_error)}
            cache[lesson.name] = entry
        if entry["load_error"]:
            state = "does not load"
        elif entry["passed"]:
            state = f"passed ({entry['ok']}/{entry['total']})"
        else:
            state = f"in progress ({entry['ok']}/{entry['total']})"
        rows.append((lesson, state))
    _write_progress(workspace, cache)
    return rows


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_progress(workspace: Path) -> dict:
    try:
        return json.loads((workspace / PROGRESS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_progress(workspace: Path, cache: dict) -> None:
    if workspace.is_dir():
        (workspace / PROGRESS_FILE).write_text(json.dumps(cache, indent=1), encoding="utf-8")


def _dir_flag(workspace: Path) -> str:
    return "" if workspace == DEFAULT_WORKSPACE else f" --dir {workspace}"


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `lesson` sub-commands: list, start, check, run."""
    sub = parser.add_subparsers(dest="lesson_command", required=True, metavar="ACTION",
                                help="what to do with the lessons")
    workspace_help = "your workspace folder"
    p = sub.add_parser("list", help="the lessons, and your progress in each",
                       description="List the lessons with their claims, time and your progress.")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE, help=workspace_help)
    p = sub.add_parser("start", help="copy a lesson's exercise into your workspace (never overwrites)",
                       description="Copy a lesson's exercise and text into your workspace; files "
                                   "already there are kept.")
    p.add_argument("lesson", help="lesson number or topic, e.g. 01 or tokens")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE, help=workspace_help)
    p = sub.add_parser("check", help="check your exercise against the engine's reference",
                       description="Run a lesson's checks on your exercise; exit status 1 while "
                                   "any fails.")
    p.add_argument("lesson", help="lesson number or topic")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE, help=workspace_help)
    p.add_argument("--solution", action="store_true", help="check the teacher's solution instead")
    p = sub.add_parser("run", help="run the lesson's experiment with your code inside the real engine",
                       description="Check your exercise, then run the lesson's experiment with it "
                                   "plugged into the engine; exit status 1 when it fails.")
    p.add_argument("lesson", help="lesson number or topic")
    p.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE, help=workspace_help)
    p.add_argument("--quick", action="store_true", help="a smaller experiment (under a minute)")
    p.add_argument("--solution", action="store_true", help="use the teacher's solution (for teachers)")
    p.add_argument("--model", default="bundled",
                   help="'bundled', 'smollm2', a Hugging Face Llama-family folder or a .gguf file")
    add_threads_arg(p)


def run_command(args: argparse.Namespace) -> int:
    """Carry out one `lesson` action; 0 on success, 1 when a check or experiment fails, 2 when
    the request itself is wrong (no such lesson, not started)."""
    try:
        if args.lesson_command == "list":
            return _cmd_list(args.dir)
        lesson = find(args.lesson)
        if args.lesson_command == "start":
            print(start(lesson, args.dir))
            return 0
        if args.lesson_command == "check":
            return _cmd_check(lesson, args.dir, args.solution)
        return _cmd_run(lesson, args)
    except (LessonError, MissingPackageError) as exc:
        return fail(str(exc))


def _cmd_list(workspace: Path) -> int:
    rows = progress(workspace)
    print(f"tinyinfer course -- workspace {workspace}/\n")
    for lesson, state in rows:
        claims = " ".join(lesson.claims) or "-"
        print(f"  {lesson.number}  {lesson.title.split('·', 1)[-1].strip():<28}{claims:<16}"
              f"{lesson.minutes:<10}{state}")
    for lesson, state in rows:
        if not state.startswith("passed"):
            verb = "start" if state == "not started" else "check"
            print(f"\nNext: tinyinfer lesson {verb} {lesson.number}{_dir_flag(workspace)}")
            return 0
    print("\nEvery lesson passes. Run the experiments: tinyinfer lesson run NN")
    return 0


def _cmd_check(lesson: Lesson, workspace: Path, solution: bool) -> int:
    path = implementation_path(lesson, workspace, solution)
    report = check(lesson, path)
    flags = _dir_flag(workspace) + (" --solution" if solution else "")
    print(report.render(
        next_step=f"Next: `tinyinfer lesson run {lesson.number}{flags}` puts your code inside the engine.",
        retry=f"Fix the first FAIL or todo above, then run `tinyinfer lesson check {lesson.number}{flags}` again."))
    if not solution:
        progress(workspace)
    return 0 if report.passed else 1


def _cmd_run(lesson: Lesson, args: argparse.Namespace) -> int:
    path = implementation_path(lesson, args.dir, args.solution)
    if not args.solution:
        report = check(lesson, path)
        if not report.passed:
            print(report.render(retry="The experiment would measure code that is not right yet: "
                                      f"finish `tinyinfer lesson check {lesson.number}` first, or "
                                      "run the teacher's version with --solution."))
            return 1
    who = "the teacher's solution" if args.solution else "your code"
    print(f"Lesson {lesson.title} -- experiment with {who} ({path})"
          + (" [quick]" if args.quick else ""))
    try:
        run_experiment(lesson, path, args.quick, args.model, args.threads)
    except (LessonError, MissingPackageError):
        raise
    except Exception as exc:
        where = where_in_student_code(exc, str(path))
        if not where and not _is_user_error(exc):
            traceback.print_exc()
            return 1
        print(f"\nThe experiment stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        for line in where:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def _is_user_error(exc: Exception) -> bool:
    from tinyinfer.errors import TinyInferError

    return isinstance(exc, TinyInferError)


def experiment_main(path: str) -> int:
    """`python lessons/NN-topic/experiment.py [--quick] [--solution]`: `tinyinfer lesson run NN`."""
    return main(["run", Path(path).parent.name, *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    """`python -m lessons ...`: the same actions as `tinyinfer lesson ...`."""
    parser = Parser(prog="python -m lessons",
                                     description="The tinyinfer course: build each stage, check it, measure it.")
    add_arguments(parser)
    return run_command(parser.parse_args(argv))
