"""The shape of remat: its modules import one another without a loop, a subpackage's through interfaces."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "remat"


def _modules() -> dict[str, list[pathlib.Path]]:
    """Each module of remat -> its files: a `.py` file, or a subpackage (a directory with an `__init__.py`,
    such as `_torch/`), which is one module named by its directory."""
    modules = {path.stem: [path] for path in PACKAGE.glob("*.py")}
    for init in PACKAGE.glob("*/__init__.py"):
        modules[init.parent.name] = sorted(init.parent.glob("*.py"))
    return modules


def _subpackages() -> list[pathlib.Path]:
    """The subpackages of remat: its directories with an `__init__.py`."""
    return sorted(path.parent for path in PACKAGE.glob("*/__init__.py"))


def _imports() -> dict[str, set[str]]:
    """Each module of remat -> the modules of remat it imports, anywhere in its code.

    A subpackage's imports are the union of its files' imports of other modules of remat: from inside it,
    `from .._x import` (level 2) reaches a module of remat, and `from ._y import` (level 1) one of its own."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, paths in modules.items():
        level = 1 if paths[0].parent == PACKAGE else 2
        imported: set[str] = set()
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == level:
                    names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
                    imported.update(name for name in names if name in modules)
        graph[module] = imported - {module}
    return graph


def test_a_subpackage_is_reached_through_its_init() -> None:
    """A subpackage is one door: the rest of remat imports from it (`from ._torch import X`), never from
    one of its files (`from ._torch._fake import X`, `from ._torch import _fake`)."""
    modules = _modules()
    files = {module: {path.stem for path in paths} for module, paths in modules.items() if paths[0].parent != PACKAGE}
    assert "_torch" in files
    reaching_in = []
    for module, paths in modules.items():
        level = 1 if paths[0].parent == PACKAGE else 2
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == level and node.module):
                    continue
                package, *inside = node.module.split(".")
                from_inside = inside or any(alias.name in files.get(package, ()) for alias in node.names)
                if package in files and package != module and from_inside:
                    reaching_in.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.module}")
    assert not reaching_in, f"imports from inside a subpackage: {reaching_in}"


def test_a_subpackage_is_read_as_one_module() -> None:
    graph = _imports()
    assert "testing" in graph and not {"_catalog", "_strategies", "_equivalence"} & set(graph)
    assert {"_checkpointed", "_checkpoint", "_offload", "policies"} <= graph["testing"]


def test_nothing_in_remat_imports_remat_testing() -> None:
    """`remat.testing` sits on top: it checks remat, and remat works without it (and without hypothesis)."""
    importers = sorted(module for module, imported in _imports().items() if "testing" in imported)
    assert not importers, f"modules of remat that import remat.testing: {importers}"


def test_a_subpackages_modules_use_one_another_through_their_interface() -> None:
    """Inside a subpackage, a module imports no underscore name from a sibling, only what the sibling's
    `__all__` lists; and the siblings import one another without a loop."""
    for package in _subpackages():
        siblings = {path.stem for path in package.glob("*.py")}
        graph: dict[str, set[str]] = {}
        private, unlisted = [], []
        for path in sorted(package.glob("*.py")):
            tree = ast.parse(path.read_text())
            graph[path.stem] = set()
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in siblings):
                    continue
                graph[path.stem].add(node.module)
                listed = _all_of(package / f"{node.module}.py")
                for alias in node.names:
                    where = f"{package.name}/{path.name}:{node.lineno}: {node.module}.{alias.name}"
                    if alias.name.startswith("_"):
                        private.append(where)
                    elif node.module != "__init__" and alias.name not in listed:
                        unlisted.append(where)
        assert not private, f"underscore names imported from a sibling: {private}"
        assert not unlisted, f"names imported from a sibling that its __all__ does not list: {unlisted}"
        for start in graph:
            stack = [start]
            seen: set[str] = set()
            while stack:
                for imported in graph[stack.pop()] - seen:
                    assert imported != start, f"{package.name}: {start} imports itself through its siblings"
                    seen.add(imported)
                    stack.append(imported)


def _all_of(path: pathlib.Path) -> set[str]:
    """The names a module lists in its `__all__`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {ast.literal_eval(element) for element in node.value.elts}  # type: ignore[attr-defined]
    return set()


def test_no_module_imports_itself_through_others() -> None:
    graph = _imports()
    assert len(graph) > 30 and sum(map(len, graph.values())) > 50
    loops = []
    for start in graph:
        stack = [(start, (start,))]
        while stack:
            module, path = stack.pop()
            for imported in graph[module]:
                if imported == start:
                    loops.append(path)
                elif imported not in path:
                    stack.append((imported, (*path, imported)))
    assert not loops, f"import loops: {sorted(set(loops))[:5]}"


def test_the_policies_and_the_public_entry_points_sit_on_top() -> None:
    graph = _imports()
    public = ("__init__", "testing")  # remat.testing (its equivalence check) checkpoints the functions it checks
    assert "_checkpoint" not in set().union(*(graph[m] for m in graph if m not in public))
    assert (
        not {"_checkpointed", "_build", "_inspect"} & graph["_dynamo"]
    )  # the compile integration reaches a checkpoint through a Protocol


def _layers() -> dict[str, int]:
    """Each module -> its layer, from the table of docs/architecture.md."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    layers: dict[str, int] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for module in cells[2].split(","):
                layers[module.strip().strip("`")] = int(cells[0])
    return layers


def test_each_module_imports_only_from_its_layer_or_above() -> None:
    graph, layers = _imports(), _layers()
    assert set(layers) == set(graph), "docs/architecture.md must place every module of remat in one layer"
    upward = sorted(
        (module, imported)
        for module, imported_modules in graph.items()
        for imported in imported_modules
        if layers[imported] > layers[module]
    )
    assert not upward, f"imports from a later layer than the importer's: {upward}"


def test_the_benchmarks_use_only_remats_public_api() -> None:
    """Benchmarks measure what users run: no `remat._module`, by import or by attribute."""
    private = []
    for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "remat":
                names = [f"remat.{node.attr}"]
            private += [
                f"{path.name}:{node.lineno}: {name}"  # type: ignore[attr-defined]
                for name in names
                if name.startswith("remat.")
                and any(part.startswith("_") and part != "__version__" for part in name.split("."))
            ]
    assert not private, private
