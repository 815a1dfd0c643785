"""The top-level packages form layers: no import cycle between them, and gr2/ (the method) imports none of the
others. Read from the source with `ast` (nothing is imported), counting every import, those inside functions too:
a lazy import still ties the two packages together."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gr2", "components", "serving", "deploy", "pipelines", "analysis", "manifests")


def imported_packages(path: Path, package: str) -> set[str]:
    """The top-level packages of PACKAGES that the module at `path` imports (its own included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(package if node.level else (node.module or "").split(".")[0])
    return found & set(PACKAGES)


@cache
def package_graph() -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: [the importing modules]}}, without a package's imports of itself."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for other in imported_packages(path, package) - {package}:
                graph[package].setdefault(other, []).append(path.relative_to(ROOT).as_posix())
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of packages (first == last), or None: a depth-first search for an import back into its path."""
    done: set[str] = set()  # every path from these is searched

    def visit(path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[path[-1]]):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done and (cycle := visit([*path, nxt])):
                return cycle
        done.add(path[-1])
        return None

    for start in graph:
        if start not in done and (cycle := visit([start])):
            return cycle
    return None


def test_no_import_cycle_between_top_level_packages():
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle between packages: "
        + " -> ".join(cycle)
        + "; "
        + "; ".join(f"{a} -> {b} in {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:], strict=False))
    )


def test_gr2_imports_no_other_package():
    assert package_graph()["gr2"] == {}


def test_a_cycle_is_found_and_named():
    """The check itself: a made-up graph with a cycle through three packages, and one without."""
    chain = {"gr2": {}, "components": {"gr2": ["c.py"]}, "pipelines": {"components": ["p.py"]}}
    assert find_cycle(chain) is None
    looped = {**chain, "gr2": {"pipelines": ["g.py"]}}
    cycle = find_cycle(looped)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"gr2", "components", "pipelines"}


def test_the_dataflow_map_shows_these_imports():
    """docs/DATAFLOW.md's "Where the code lives" map: each package's row names exactly the packages it imports."""
    text = (ROOT / "docs" / "DATAFLOW.md").read_text()
    rows = re.findall(r"^(\w+)/ .*─▶ (.*)$", text, flags=re.M)
    drawn = {name: set(re.findall(r"\w+", targets)) - {"none", "of", "ours"} for name, targets in rows}
    graph = package_graph()
    assert drawn == {p: set(graph[p]) for p in drawn}, "docs/DATAFLOW.md's map disagrees with the imports"
    assert set(drawn) == set(PACKAGES) - {"manifests"}, "every package of ours but manifests/ has a row"
