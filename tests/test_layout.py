"""The house plan, checked: no import cycle in tinyinfer/, tui/ or lessons/ (counting imports
inside functions too), and only the arrows docs/engine.md allows between the rooms."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tinyinfer", "tui", "lessons")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")
           if "data" not in p.relative_to(ROOT).parts}


def imported(path: Path) -> set[str]:
    """The project modules a file imports, anywhere in it (a lazy import is still an arrow)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


GRAPH = {name: imported(path) - {name} for name, path in MODULES.items()}


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles() == []


def test_the_walk_sees_real_imports():
    assert "tinyinfer.engine" in GRAPH["tinyinfer.serve.loop"]
    assert "tinyinfer.runners.tp.launch" in GRAPH["tinyinfer.model"]  # a lazy import counts


# Rooms that must not depend on others: (importer prefix, forbidden prefixes, why).
WALLS = [
    ("tinyinfer.simulate", ("tinyinfer.engine", "tinyinfer.runners", "tinyinfer.model",
                            "tinyinfer.bench", "tinyinfer.serve", "tinyinfer.cli"),
     "the simulator depends on configs and presets only; measuring is bench's job"),
    ("tinyinfer.runners", ("tinyinfer.engine", "tinyinfer.scheduler", "tinyinfer.bench",
                         "tinyinfer.serve", "tinyinfer.cli", "tui", "lessons"),
     "runners compute a forward pass; they know nothing of scheduling or front ends"),
    ("tinyinfer.serve", ("tinyinfer.cli", "tinyinfer.bench", "tui", "lessons"),
     "the server is a front end of the engine, beside the others"),
    ("tinyinfer.bench", ("tinyinfer.cli", "tinyinfer.serve", "tui", "lessons"),
     "benchmarks drive the engine; the CLI drives them"),
    ("tinyinfer.display", ("tinyinfer.engine", "tinyinfer.runners", "tinyinfer.cli"),
     "terminal output knows nothing of what it shows"),
]
CORE = ("config", "tokenizer", "chat", "weights", "model", "kv", "scheduler", "sampling",
        "speculative", "quant", "engine", "engine_config", "trace", "errors")


def test_the_walls_between_the_rooms_hold():
    broken = [f"{importer} imports {target}: {why}"
              for room, forbidden, why in WALLS
              for importer, targets in GRAPH.items() if importer.startswith(room)
              for target in targets if target.startswith(forbidden)]
    assert broken == []


def test_the_core_imports_no_front_end():
    front_ends = ("tinyinfer.cli", "tinyinfer.serve", "tinyinfer.bench", "tinyinfer.simulate",
                  "tui", "lessons")
    broken = [f"{m} imports {t}" for m in GRAPH if m.split(".")[-1] in CORE and m.count(".") == 1
              for t in GRAPH[m] if t.startswith(front_ends)]
    assert broken == []


def test_the_top_of_tinyinfer_is_the_stage_list():
    """A learner opening tinyinfer/ sees the stages (a stage may be a package) and the rooms."""
    modules = {p.stem for p in (ROOT / "tinyinfer").glob("*.py")} - {"__init__", "__main__"}
    packages = {p.name for p in (ROOT / "tinyinfer").iterdir() if (p / "__init__.py").is_file()}
    rooms = {"bench", "cli", "display", "runners", "serve", "simulate"}
    assert modules | packages == set(CORE) | rooms and not modules & packages
