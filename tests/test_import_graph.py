"""The import graph of dcr_format: no cycles, no upward imports, the core never imports the
test support, and nothing in the package imports the benchmarks (``benchmarks/``).

Every module's imports are read with ``ast`` (nothing is imported): top-level ones, ones
inside functions and ones under ``if TYPE_CHECKING:`` alike, relative ones resolved. The
layers are those of docs/design.md, lowest first; a module may import its own layer and the
layers below it. The few imports that break these rules today are listed in ``KNOWN_*`` with
the file that must change; an entry that no longer exists fails the test, so it is removed.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "dcr_format"

# Lowest first (docs/design.md, "Layers"). Exact names win over patterns; a module that
# matches nothing fails test_every_module_has_a_layer: put it in the layer of its job.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors and system", ("errors", "system", "system.*")),
    ("format", ("format", "format.*")),
    ("kernels", ("kernels", "kernels.*")),
    ("codings", ("codings", "codings.*")),
    ("delta", ("delta", "delta.*")),
    ("store", ("store", "store.*")),
    ("chain", ("chain", "chain.*")),
    ("targets", ("targets", "targets.*")),
    ("sync", ("sync", "sync.*")),
    ("publish", ("publish", "publish.*")),
    ("tools", ("tools", "tools.*")),
    ("public API", ("",)),  # dcr_format/__init__.py re-exports layers below
    (
        "commands, test support, integrations",
        (
            "cli",
            "cli.*",
            "testing",
            "testing.*",
            "integrations",
            "integrations.*",
        ),
    ),
)

# Modules that may import dcr_format.testing; nothing else may.
OUTSIDE_CORE = ("testing", "testing.*", "integrations.*")
NOT_FOR_CORE = ("testing", "testing.*")

# (importer, imported) pairs allowed for now, each with the file that must change.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def module_files(package_dir: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the package in ``package_dir``, by dotted name: (file, is package)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Importer -> the package's modules it imports anywhere in its file (names relative to
    the package: ``""`` is its ``__init__``)."""
    root = package_dir.name
    modules = module_files(package_dir)

    def owner(name: str) -> str | None:  # the longest prefix of ``name`` that is a module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in modules else owner(source))
        graph[_short(name, root)] = {
            _short(t, root) for t in targets if t is not None and t != name and _inside(t, root)
        }
    return graph


def _inside(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def _short(name: str, root: str) -> str:
    return "" if name == root else name.removeprefix(root + ".")


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def layer_of(name: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int | None:
    """The index of ``name``'s layer (an exact name first, then the first pattern), or None."""
    for index, (_, members) in enumerate(layers):
        if name in members:
            return index
    for index, (_, members) in enumerate(layers):
        if any("*" in m and fnmatch.fnmatchcase(name, m) for m in members):
            return index
    return None


def upward_imports(
    graph: Mapping[str, Iterable[str]], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as text."""
    found = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        low, high = layer_of(importer, layers), layer_of(imported, layers)
        if low is not None and high is not None and high > low:
            found.append(
                f"{importer or '__init__'} ({layers[low][0]}) imports "
                f"{imported or '__init__'} ({layers[high][0]})"
            )
    return found


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _without(
    graph: Mapping[str, set[str]], edges: Iterable[tuple[str, str]]
) -> dict[str, set[str]]:
    drop = set(edges)
    return {a: {b for b in targets if (a, b) not in drop} for a, targets in graph.items()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE_DIR)


def test_the_graph_sees_the_package(graph) -> None:
    assert "sync.reader" in graph and "" in graph and len(graph) > 40
    assert "sync.reader" in graph[""] and "errors" in graph["sync.reader"]


def test_every_module_has_a_layer(graph) -> None:
    missing = sorted(name for name in graph if layer_of(name) is None)
    assert missing == [], f"add these modules to LAYERS in {__file__}: {missing}"


def test_no_import_cycle(graph) -> None:
    cycle = find_cycle(_without(graph, KNOWN_CYCLE_EDGES))
    assert cycle is None, "import cycle: " + " -> ".join(name or "__init__" for name in cycle)


def test_no_upward_import(graph) -> None:
    found = upward_imports(_without(graph, KNOWN_UPWARD))
    assert found == [], "imports of a higher layer:\n" + "\n".join(found)


def test_the_core_never_imports_benchmarks_or_test_support(graph) -> None:
    found = sorted(
        f"{a or '__init__'} imports {b}"
        for a, targets in graph.items()
        if not _matches(a, OUTSIDE_CORE)
        for b in targets
        if _matches(b, NOT_FOR_CORE)
    )
    # the benchmark harnesses live in benchmarks/, outside the installed package
    harnesses = {path.stem for path in (PACKAGE_DIR.parent / "benchmarks").glob("*.py")}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name} imports {n}" for n in names if n.split(".")[0] in harnesses]
    assert found == []


def _reaches(graph: Mapping[str, Iterable[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_known_exceptions_are_still_needed(graph) -> None:
    stale = [
        f"{a} -> {b} ({where})"
        for (a, b), where in KNOWN_CYCLE_EDGES.items()
        if b not in graph.get(a, set()) or not _reaches(graph, b, a)
    ] + [
        f"{a} -> {b} ({where})"
        for (a, b), where in KNOWN_UPWARD.items()
        if b not in graph.get(a, set()) or not upward_imports({a: {b}})
    ]
    assert stale == [], f"fixed: remove from KNOWN_* in {__file__}: {stale}"


# --- the checker itself, on a fake package ----------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fake"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FAKE_LAYERS = (("low", ("low", "sub", "sub.*")), ("high", ("high",)), ("api", ("",)))


def test_a_cycle_through_a_function_level_relative_import_is_found(tmp_path) -> None:
    root = _package(
        tmp_path,
        {
            "low.py": "from fake.sub import leaf\n",
            "sub/__init__.py": "",
            "sub/leaf.py": "def f():\n    from .. import high\n",
            "high.py": "import fake.low as low\n",
        },
    )
    graph = import_graph(root)
    assert graph == {"": set(), "low": {"sub.leaf"}, "sub": set(), "sub.leaf": {"high"},
                     "high": {"low"}}  # fmt: skip
    assert find_cycle(graph) == ["high", "low", "sub.leaf", "high"]
    assert upward_imports(graph, FAKE_LAYERS) == ["sub.leaf (low) imports high (high)"]


def test_a_clean_package_passes_and_from_package_import_name_is_the_package(tmp_path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from fake.high import thing\n",
            "low.py": "import os\n",
            "high.py": "from . import low\nfrom fake import low as again\n"
            "if False:\n    from fake.low import missing_name\n",
            "sub/__init__.py": "from .leaf import x\n",
            "sub/leaf.py": "from ..low import y\n",
        },
    )
    graph = import_graph(root)
    assert graph == {"": {"high"}, "low": set(), "high": {"low"}, "sub": {"sub.leaf"},
                     "sub.leaf": {"low"}}  # fmt: skip
    assert find_cycle(graph) is None
    assert upward_imports(graph, FAKE_LAYERS) == []
    graph["low"].add("")  # a low module importing the package's __init__ is both
    assert find_cycle(graph) == ["", "high", "low", ""]
    assert upward_imports(graph, FAKE_LAYERS) == ["low (low) imports __init__ (api)"]
