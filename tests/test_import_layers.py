"""No new import loops. Every `import` of every module is read with ast — at the top, inside
functions and under TYPE_CHECKING alike, since a function-level import closes a loop as surely as
a top-level one does, only later — and the loops are looked for twice: between modules, and
between the packages engine, measures, storage, reports, workers, operations, api and cli.

The loops that remain are listed below with every edge that closes them, as debts: an edge added
to one of them, or any other loop, fails here, naming the modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"service": "headatlas.service", "workers": "headatlas.workers", "cli": "headatlas.cli"}
PACKAGES = {
    "headatlas.service.engine": "engine",
    "headatlas.service.measures": "measures",
    "headatlas.service.storage": "storage",
    "headatlas.service.reports": "reports",
    "headatlas.workers": "workers",
    "headatlas.service.operations": "operations",
    "headatlas.service.api": "api",
    "headatlas.cli": "cli",
}
# Loops between modules that remain: the options declared once and the parameters they build
# (analysis_options builds AnalysisParams inside its functions; params reads the declared defaults).
KNOWN_MODULE_LOOPS = [
    {"headatlas.service.analysis_options", "headatlas.service.params"},
]
# Loops between packages that remain, by the edges against the layering (engine below measures,
# reports and storage): none. The jobs that orchestrate storage and measures (the embedded run,
# the effect and prune runs) live in operations; the engine keeps the building blocks and reaches
# the measures through the measure contract (engine/measure_contract.py), which loads the built-in
# measures by name as it loads a plugin's. An edge against the layering fails here.
KNOWN_BACKWARD_EDGES: set[tuple[str, str]] = set()
LOWER = "engine"  # the package the others build on


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    rest = [p for p in parts[1:] if p != "__init__"]
    return ".".join([FOLDERS[parts[0]], *rest])


def imported(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The headatlas modules that ``source`` (module ``name``) imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # a submodule imported by name
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    return {
        name: imported(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", set(files))
        for name, path in files.items()
    }


def module_loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                loops.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def package_of(module: str) -> str | None:
    return next((short for full, short in PACKAGES.items() if module == full or module.startswith(full + ".")), None)


def package_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], set[tuple[str, str]]]:
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a and b and a != b:
                edges.setdefault((a, b), set()).add((module, target))
    return edges


def test_no_new_loop_between_modules():
    loops = module_loops(import_graph())
    new = [sorted(loop) for loop in loops if loop not in KNOWN_MODULE_LOOPS]
    assert not new, f"import loops between modules: {new}; move what they share into a module of its own"


def test_no_new_loop_between_packages():
    edges = package_edges(import_graph())
    problems = []
    for (a, b), forward in sorted(edges.items()):
        back = edges.get((b, a))
        if not back or a > b:
            continue
        against = forward if a == LOWER else back if b == LOWER else forward | back
        unexpected = sorted(against - KNOWN_BACKWARD_EDGES)
        if unexpected:
            problems.append(f"{a} <-> {b} through {unexpected}")
    assert not problems, "import loops between packages: " + "; ".join(problems)


def test_the_known_loops_are_still_there_to_pay_off():
    """A debt paid is struck off the lists above (they never keep an edge that no longer exists)."""
    graph = import_graph()
    edges = {(m, t) for m, targets in graph.items() for t in targets}
    assert KNOWN_BACKWARD_EDGES <= edges, sorted(KNOWN_BACKWARD_EDGES - edges)
    loops = module_loops(graph)
    assert all(loop in loops for loop in KNOWN_MODULE_LOOPS)


def test_the_checker_sees_function_level_and_relative_imports():
    known = {"headatlas.service.engine.model", "headatlas.service.storage.store", "headatlas.service.engine"}
    source = (
        "from __future__ import annotations\n"
        "def later():\n"
        "    from headatlas.service.storage.store import Store\n"
        "    return Store\n"
        "from . import model\n"
    )
    assert imported(source, "headatlas.service.engine.runner", False, known) == {
        "headatlas.service.storage.store",
        "headatlas.service.engine.model",
        "headatlas.service.engine",
    }
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert module_loops(graph) == [{"a", "b", "c"}]
