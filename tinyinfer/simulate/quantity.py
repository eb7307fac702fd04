"""Numbers that remember how they were made: every simulator output is a Quantity.

A Quantity's value is computed *from its formula*: ``derive`` evaluates the formula text with
the named inputs, so the formula a learner reads is the one that produced the number.
Inputs may themselves be Quantities, so any output expands into a tree down to the givens
(published specs, config fields, the scenario's knobs).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Union

Number = Union[int, float]

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "max": max, "min": min, "ceil": math.ceil, "floor": math.floor,
}


def evaluate(formula: str, values: dict[str, Number]) -> Number:
    """Evaluate arithmetic over named values: + - * / // **, parentheses, max/min/ceil/floor."""

    def walk(node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _FUNCTIONS and not node.keywords:
            return _FUNCTIONS[node.func.id](*(walk(a) for a in node.args))
        raise ValueError(f"formula {formula!r}: {ast.dump(node)} is not simple arithmetic")

    return walk(ast.parse(formula, mode="eval"))


def formula_names(formula: str) -> set[str]:
    """Names a formula reads, without the functions it calls."""
    return {n.id for n in ast.walk(ast.parse(formula, mode="eval"))
            if isinstance(n, ast.Name) and n.id not in _FUNCTIONS}


@dataclass(frozen=True)
class Quantity:
    """A value with its unit, the formula that produced it and the inputs that formula read."""

    name: str
    value: float
    unit: str
    formula: str = ""  # empty for a given (an input, a spec, a config field)
    inputs: dict[str, "Quantity | Number"] = field(default_factory=dict, compare=False)
    note: str = ""  # where a given comes from, or the assumption behind a formula

    @property
    def is_given(self) -> bool:
        return not self.formula

    def human(self) -> str:
        """The value in readable units, e.g. '10.7 GB' or '25.3 ms'."""
        return format_value(self.value, self.unit)

    def pretty_formula(self) -> str:
        """The formula with × and ÷ for reading."""
        return self.formula.replace(" * ", " × ").replace(" / ", " ÷ ").replace("**", "^")

    def substituted(self) -> str:
        """The formula with every input replaced by its value."""
        tree = ast.parse(self.formula, mode="eval")
        values = {k: (v.human() if isinstance(v, Quantity) else _plain(v)) for k, v in self.inputs.items()}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in values:
                node.id = values[node.id]
        text = ast.unparse(tree)
        return text.replace(" * ", " × ").replace(" / ", " ÷ ").replace("**", "^")

    def explain(self, depth: int = 99, indent: str = "", alias: str = "") -> str:
        """The derivation tree: this value, its formula, its substituted inputs, then each input's.

        An input read under another name than its own shows as ``alias: name = value``.
        """
        label = f"{alias}: {self.name}" if alias and alias != self.name else self.name
        lines = [f"{indent}{label} = {self.human()}" + (f"   ({self.note})" if self.note else "")]
        if self.is_given:
            return lines[0]
        lines.append(f"{indent}  = {self.pretty_formula()}")
        lines.append(f"{indent}  = {self.substituted()}")
        if depth > 0:
            for key, value in self.inputs.items():
                if isinstance(value, Quantity):
                    lines.append(value.explain(depth - 1, indent + "    ", alias=key))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready nested form of the derivation."""
        return {
            "name": self.name, "value": self.value, "unit": self.unit, "formula": self.formula,
            "note": self.note,
            "inputs": {k: (v.to_dict() if isinstance(v, Quantity) else v) for k, v in self.inputs.items()},
        }


def given(name: str, value: Number, unit: str = "", note: str = "") -> Quantity:
    """An input of the model: a spec, a config field or a scenario knob."""
    return Quantity(name, float(value), unit, note=note)


def derive(name: str, unit: str, formula: str, note: str = "", **inputs: "Quantity | Number") -> Quantity:
    """A Quantity whose value is the formula evaluated over the inputs' values."""
    missing = formula_names(formula) - inputs.keys()
    unused = inputs.keys() - formula_names(formula)
    if missing or unused:
        raise ValueError(f"formula {formula!r}: missing inputs {sorted(missing)}, unused {sorted(unused)}")
    values = {k: (v.value if isinstance(v, Quantity) else v) for k, v in inputs.items()}
    return Quantity(name, float(evaluate(formula, values)), unit, formula, dict(inputs), note)


_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
_COUNTS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))  # parameter counts: 7B, 124M
_SI_UNITS = ("B", "B/s", "FLOP", "FLOP/s", "params")
_SINGULAR = {"sequences": "sequence", "devices": "device", "tokens": "token", "experts": "expert"}


def _plain(value: Number) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.4g}"


def _si(value: float, unit: str) -> str:
    prefixes = _COUNTS if unit == "params" else _SI
    for scale, prefix in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g}{prefix} params" if unit == "params" else \
                f"{value / scale:.3g} {prefix}{unit}"
    return f"{_plain(value)} {unit}"


def _seconds(value: float) -> str:
    if value == 0:
        return "0 s"
    if value >= 3600:
        return f"{value / 3600:.3g} h"
    if value >= 60:
        return f"{value / 60:.3g} min"
    if value >= 1:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def format_value(value: float, unit: str) -> str:
    """Readable rendering of a value in its unit (decimal prefixes: 1 GB = 10^9 bytes)."""
    if math.isinf(value):
        return "never"
    if unit in _SI_UNITS:
        return _si(value, unit)
    if unit == "s":
        return _seconds(value)
    if unit.startswith("$"):
        return f"${value:,.2f}" + unit[1:] if value >= 0.1 else f"${value:.3g}" + unit[1:]
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "x":
        return f"{value:.2f}x"
    text = f"{value:,.0f}" if abs(value) >= 100 else _plain(round(value, 3)) if value else "0"
    if value == 1 and unit in _SINGULAR:
        unit = _SINGULAR[unit]
    return f"{text} {unit}".rstrip()
