"""The package's layering, read from the source with `ast` (nothing is imported): no import circles, and
imports point down only: ground <- parts <- stages <- sweeps <- entry. A stage never imports another stage.

Every import counts, also one inside a function: it is a dependency all the same, only resolved later.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "eaglet"

# The layers, lowest first: a module may import its own layer and the layers before it. Names are the first
# component under eaglet (a package or a module); "eaglet" is the package root itself (only __version__).
LAYERS: dict[str, set[str]] = {
    "ground": {"eaglet", "config", "errors", "fsutil"},
    "parts": {"data", "target_model", "shards", "model", "generation", "formats", "run_dir", "tracking"},
    "stages": {"extract", "train", "evaluate", "export", "plan"},
    "sweeps": {"sweeps"},
    "entry": {"cli"},
}
# Within this layer a package imports only itself: every stage stands on the parts alone.
ISOLATED_LAYER = "stages"
RANK = {name: rank for rank, names in enumerate(LAYERS.values()) for name in names}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


@dataclass(frozen=True)
class Import:
    """One eaglet module named by one import statement."""

    importer: str  # dotted module name
    imported: str
    where: str  # path:line of the statement, from the repository root

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} imports {self.imported}"


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(src: Path) -> dict[str, Path]:
    return {_module_name(path, src): path for path in sorted((src / PACKAGE).rglob("*.py"))}


def _top(module: str) -> str:
    """The first component under eaglet: eaglet.evaluate.stage -> evaluate; the root itself -> eaglet."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest known module that `name` starts with (an attribute of a module resolves to the module)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports_of(module: str, path: Path, modules: dict[str, Path], src: Path) -> list[Import]:
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b` names module a.b when there is one, else a name inside a.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        where = f"{path.relative_to(src.parent)}:{node.lineno}"
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                imported = _resolve(name, modules)
                if imported != module:
                    found.append(Import(module, imported, where))
    return list(dict.fromkeys(found))


def _all_imports(src: Path) -> list[Import]:
    modules = _modules(src)
    return [imp for module, path in modules.items() for imp in _imports_of(module, path, modules, src)]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return _all_imports(SRC)


def _cycles(imports: list[Import]) -> list[list[Import]]:
    """One shortest circle through each group of modules that import each other (Tarjan's components)."""
    graph: dict[str, list[Import]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, []).append(imp)
        graph.setdefault(imp.imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for imp in graph[node]:
            if imp.imported not in index:
                visit(imp.imported)
                low[node] = min(low[node], low[imp.imported])
            elif imp.imported in stack:
                low[node] = min(low[node], index[imp.imported])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)

    circles = []
    for component in components:
        start = min(component)
        # Breadth first from start, inside the component, back to start.
        came_by: dict[str, Import] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            step = next((imp for imp in graph[node] if imp.imported == start), None)
            if step is not None:
                path = [step]
                while path[0].importer != start:
                    path.insert(0, came_by[path[0].importer])
                circles.append(path)
                break
            for imp in graph[node]:
                if imp.imported in component and imp.imported not in came_by and imp.imported != start:
                    came_by[imp.imported] = imp
                    queue.append(imp.imported)
    return sorted(circles, key=lambda path: path[0].importer)


def _describe(circle: list[Import]) -> str:
    chain = " -> ".join([circle[0].importer, *(imp.imported for imp in circle)])
    return chain + "".join(f"\n      {imp}" for imp in circle)


def _fail_if(offending: list[str], why: str) -> None:
    """Fail naming every offending import, one a line (no traceback: the list is the message)."""
    if offending:
        pytest.fail(f"{why}:\n  " + "\n  ".join(offending), pytrace=False)


def test_every_package_has_a_layer() -> None:
    unplaced = sorted({_top(module) for module in _modules(SRC)} - set(RANK))
    _fail_if(
        [f"{PACKAGE}.{name}" for name in unplaced], "add each to a layer in LAYERS (tests/test_layering.py)"
    )


def test_no_import_circles(imports) -> None:
    _fail_if([_describe(circle) for circle in _cycles(imports)], "modules that import each other")


def test_no_stage_imports_another_stage(imports) -> None:
    offending = [
        f"{imp}  (stage {_top(imp.importer)} -> stage {_top(imp.imported)})"
        for imp in imports
        if LAYER_OF.get(_top(imp.importer)) == ISOLATED_LAYER
        and LAYER_OF.get(_top(imp.imported)) == ISOLATED_LAYER
        and _top(imp.importer) != _top(imp.imported)
    ]
    _fail_if(offending, "a stage imports another stage; move what they share into a part")


def test_imports_point_down_only(imports) -> None:
    offending = [
        f"{imp}  ({LAYER_OF[_top(imp.importer)]} -> {LAYER_OF[_top(imp.imported)]})"
        for imp in imports
        # A package missing from LAYERS is test_every_package_has_a_layer's failure, not this one's.
        if RANK.get(_top(imp.imported), -1) > RANK.get(_top(imp.importer), len(LAYERS))
    ]
    _fail_if(offending, f"an import points up the layers ({' <- '.join(LAYERS)})")


def test_only_sweeps_import_sweeps(imports) -> None:
    allowed = {"sweeps", *LAYERS["entry"]}
    offending = [
        str(imp) for imp in imports if _top(imp.imported) == "sweeps" and _top(imp.importer) not in allowed
    ]
    _fail_if(offending, "sweeps sit above every stage; only the entry points import them")


def test_the_reader_sees_relative_and_deferred_imports(tmp_path: Path) -> None:
    """The checker itself: a circle closed by a relative import inside a function is found."""
    files = {
        "__init__.py": "",
        "a/__init__.py": "from eaglet.a.b import thing\n",
        "a/b.py": "import eaglet.errors\n\ndef later():\n    from . import c\n",
        "a/c.py": "from eaglet.a.b import thing\nfrom ..errors import Oops\n",
        "errors.py": "",
    }
    for name, text in files.items():
        path = tmp_path / "src" / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = _all_imports(tmp_path / "src")
    assert {(imp.importer, imp.imported) for imp in found} == {
        ("eaglet.a", "eaglet.a.b"),
        ("eaglet.a.b", "eaglet.errors"),
        ("eaglet.a.b", "eaglet.a.c"),
        ("eaglet.a.c", "eaglet.a.b"),
        ("eaglet.a.c", "eaglet.errors"),
    }
    (circle,) = _cycles(found)
    assert [imp.where for imp in circle] == ["src/eaglet/a/b.py:4", "src/eaglet/a/c.py:1"]
