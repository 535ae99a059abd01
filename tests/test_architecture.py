"""The shape of remat: its modules import one another without a loop, a subpackage's through interfaces."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "remat"


def _modules() -> dict[str, list[pathlib.Path]]:
    """Each module of remat's top level -> its files: a `.py` file, or a subpackage (a directory with an
    `__init__.py`: `_tracing/`, `_torch/`, `testing/`, ...), which is one module named by its directory."""
    modules = {path.stem: [path] for path in PACKAGE.glob("*.py")}
    for init in PACKAGE.glob("*/__init__.py"):
        modules[init.parent.name] = sorted(init.parent.glob("*.py"))
    return modules


def _subpackages() -> list[pathlib.Path]:
    """The subpackages of remat: its directories with an `__init__.py`."""
    return sorted(path.parent for path in PACKAGE.glob("*/__init__.py"))


# The subpackages that are one door each, reached through their `__init__` and built of modules that read
# one another through their `__all__`: the door to torch's private names, and the checking library.
DOORS = ("_torch", "testing")


def _imports() -> dict[str, set[str]]:
    """Each module of remat's top level (a subpackage counts as one) -> those it imports, anywhere in its
    code. From a subpackage's file, `from .._x import` (level 2) reaches a module of the top level, and
    `from ._y import` (level 1) one of its own."""
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


def _file_imports() -> dict[str, set[str]]:
    """Each file of remat, as a dotted module path (`_tracing._joint`) -> the files of remat it imports."""
    files = {".".join(path.relative_to(PACKAGE).with_suffix("").parts): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".")[:-1]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package[: len(package) - (node.level - 1)]
            stem = [*base, *node.module.split(".")] if node.module else base
            for alias in node.names:  # `from .pkg import module` names a file; `from .module import name` its module
                for candidate in (".".join([*stem, alias.name]), ".".join(stem)):
                    if candidate in files:
                        imported.add(candidate)
                        break
        graph[name] = imported - {name}
    return graph


def test_a_door_is_reached_through_its_init() -> None:
    """`_torch` and `testing` are one door each: the rest of remat imports from them (`from ._torch import
    X`), never from one of their files (`from ._torch._fake import X`, `from ._torch import _fake`)."""
    modules = _modules()
    files = {door: {path.stem for path in modules[door]} for door in DOORS}
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
    assert not reaching_in, f"imports from inside a door: {reaching_in}"


def test_a_subpackage_is_read_as_one_module() -> None:
    graph = _imports()
    assert "testing" in graph and not {"_catalog", "_strategies", "_equivalence"} & set(graph)
    assert {"_api", "_storing", "policies"} <= graph["testing"]
    assert {"_eager", "_tracing", "_partitioning", "_running"} <= set(graph) and "_joint" not in graph


def test_each_subpackage_says_what_it_owns_and_may_import() -> None:
    for package in _subpackages():
        docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert len(docstring) > 80, f"{package.name}/__init__.py: say what the subpackage owns"
        if package.name not in DOORS:
            assert "May import:" in docstring, f"{package.name}/__init__.py: say what it may import"


def test_nothing_in_remat_imports_remat_testing() -> None:
    """`remat.testing` sits on top: it checks remat, and remat works without it (and without hypothesis)."""
    importers = sorted(module for module, imported in _imports().items() if "testing" in imported)
    assert not importers, f"modules of remat that import remat.testing: {importers}"


def test_a_doors_modules_use_one_another_through_their_interface() -> None:
    """Inside a door, a module imports no underscore name from a sibling, only what the sibling's `__all__`
    lists."""
    for package in (PACKAGE / door for door in DOORS):
        siblings = {path.stem for path in package.glob("*.py")}
        private, unlisted = [], []
        for path in sorted(package.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in siblings):
                    continue
                listed = _all_of(package / f"{node.module}.py")
                for alias in node.names:
                    where = f"{package.name}/{path.name}:{node.lineno}: {node.module}.{alias.name}"
                    if alias.name.startswith("_"):
                        private.append(where)
                    elif node.module != "__init__" and alias.name not in listed:
                        unlisted.append(where)
        assert not private, f"underscore names imported from a sibling: {private}"
        assert not unlisted, f"names imported from a sibling that its __all__ does not list: {unlisted}"


def _all_of(path: pathlib.Path) -> set[str]:
    """The names a module lists in its `__all__`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {ast.literal_eval(element) for element in node.value.elts}  # type: ignore[attr-defined]
    return set()


def test_no_file_imports_itself_through_others() -> None:
    graph = _file_imports()
    assert len(graph) > 80 and sum(map(len, graph.values())) > 300
    loops = []
    for start in graph:
        stack = [(start, (start,))]
        seen: set[str] = set()
        while stack:
            module, path = stack.pop()
            for imported in graph[module]:
                if imported == start:
                    loops.append(path)
                elif imported not in seen:
                    seen.add(imported)
                    stack.append((imported, (*path, imported)))
    assert not loops, f"import loops: {sorted(set(loops))[:5]}"


def test_the_compile_integration_reaches_a_checkpoint_through_a_protocol() -> None:
    graph = _file_imports()
    assert not {name for name in graph["_running._dynamo"] if name.startswith("_api.")}


def _layers() -> dict[str, int]:
    """Each module of the top level (a subpackage counts as one) -> its layer, from the table of
    docs/architecture.md."""
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
    assert set(layers) == set(graph), (
        "docs/architecture.md must place every subpackage and top-level module in one layer"
    )
    upward = sorted(
        (module, imported)
        for module, imported_modules in graph.items()
        for imported in imported_modules
        if layers[imported] > layers[module]
    )
    assert not upward, f"imports from a later layer than the importer's: {upward}"


def test_the_benchmarks_use_only_remats_public_api() -> None:
    """Benchmarks measure what users run: no `remat._api._module`, by import or by attribute."""
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
