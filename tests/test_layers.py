"""The package's import graph: data flows down only (see the module layout in README.md).

Every module of torch_triton_gemm is parsed, not imported: its imports at any nesting level
(lazy ones inside functions, ``TYPE_CHECKING`` blocks) are edges of the graph, relative imports
resolved, ``from package import module`` counted as an import of that module. Importing a module
also runs its packages' ``__init__``; those implicit edges are left out, as Python runs them
first.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "torch_triton_gemm"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE
OPS = tuple(f"{PACKAGE}.ops.{name}" for name in ("mm", "grouped_mm", "grouped_mm_list",
                                                   "scaled_mm", "scaled_grouped_mm"))
# The layers beneath the ops: planning, launching and what both read.
LAYERS = tuple(f"{PACKAGE}.ops.{name}" for name in ("checks", "operands", "launcher",
                                                      "grouped_launch", "planner",
                                                      "compile_pool", "compile_ahead"))


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the modules along it (the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every edge is explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


GRAPH = import_graph()


def test_the_graph_is_read():
    # The parse must see the edges every layer relies on, or the checks below prove nothing.
    assert f"{PACKAGE}.ops.launcher" in GRAPH[f"{PACKAGE}.ops.mm"]
    assert f"{PACKAGE}.tune" in GRAPH[f"{PACKAGE}.ops.planner"]  # lazy, inside a function
    assert f"{PACKAGE}.kernels.tiles" in GRAPH[f"{PACKAGE}.kernels.matmul"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("op", OPS[1:])
def test_ops_do_not_reach_into_mm(op):
    """The other ops launch through the shared layers, not through tgemm::mm's module."""
    assert f"{PACKAGE}.ops.mm" not in GRAPH[op]


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_import_no_op(layer):
    assert not GRAPH[layer] & set(OPS), sorted(GRAPH[layer] & set(OPS))


def test_the_launcher_and_tuning_are_below_the_planner():
    """The planner hands plans down to the launcher; tuning (which the planner may run) times
    explicit plans through the launcher, never asking the planner."""
    planner = f"{PACKAGE}.ops.planner"
    assert planner not in GRAPH[f"{PACKAGE}.ops.launcher"]
    assert planner not in GRAPH[f"{PACKAGE}.tune"]


def test_compiling_ahead_sits_beside_the_ops():
    """compile_ahead plans through the planner and launcher; the launcher only waits on the
    compile pool, beneath both."""
    ahead, pool = f"{PACKAGE}.ops.compile_ahead", f"{PACKAGE}.ops.compile_pool"
    assert {f"{PACKAGE}.ops.planner", f"{PACKAGE}.ops.launcher"} <= GRAPH[ahead]
    for layer in (f"{PACKAGE}.ops.launcher", f"{PACKAGE}.ops.planner", pool):
        assert ahead not in GRAPH[layer]
    assert not GRAPH[pool] & set(LAYERS)


def test_kernels_import_no_torch():
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] == "torch"], (path.name, names)
