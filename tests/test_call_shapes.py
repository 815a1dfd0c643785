"""House style, checked on gr2/'s syntax trees (cheap: no imports): no call passes 9 or more arguments by position,
and no function returns a tuple of 5 or more values (a literal or an annotation). Both hide which value is which;
name them (keyword arguments, a dataclass such as gr2.generative.Bundle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_POSITIONAL = 8
MAX_TUPLE = 4


def tuple_size(node: ast.expr | None) -> int:
    """The number of values a return statement's tuple literal, or a `tuple[...]` annotation, holds (0: neither
    or `tuple[X, ...]`)."""
    if isinstance(node, ast.Tuple):
        return len(node.elts)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "tuple":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return 0 if any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts) else len(elts)
    return 0


def findings(source: str, where: str) -> list[str]:
    """What breaks the two rules in one module's source (a `*args` argument counts as one)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL:
            out.append(
                f"{where}:{node.lineno}: {ast.unparse(node.func)}(...) passes {len(node.args)} by position"
            )
        if isinstance(node, ast.Return) and tuple_size(node.value) > MAX_TUPLE:
            out.append(f"{where}:{node.lineno}: returns a {tuple_size(node.value)}-tuple")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and tuple_size(node.returns) > MAX_TUPLE:
            out.append(f"{where}:{node.lineno}: {node.name} returns a {tuple_size(node.returns)}-tuple")
    return out


def test_the_check_sees_what_it_claims():
    bad = (
        "def f() -> tuple[int, int, int, int, int]:\n    return 1, 2, 3, 4, 5\ng(1, 2, 3, 4, 5, 6, 7, 8, 9)\n"
    )
    assert len(findings(bad, "x")) == 3
    ok = "def f() -> tuple[int, ...]:\n    return 1, 2, 3, 4\ng(1, 2, 3, 4, 5, 6, 7, 8, k=9)\n"
    assert findings(ok, "x") == []


def test_gr2_has_no_long_positional_calls_or_wide_tuples():
    found = [
        f
        for p in sorted((ROOT / "gr2").rglob("*.py"))
        for f in findings(p.read_text(), str(p.relative_to(ROOT)))
    ]
    assert found == [], "\n".join(found)
