"""The house rules, checked on the source: packages depend only on the layers below them (data
flows one way: inputs -> scenario -> ledger and program -> engine -> report -> outputs), no
module imports in a circle, the simulator core needs no torch and reads no files, and no module
or function outgrows the house (~400 and ~60 lines; tests and benchmarks included)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "zsim"

# lowest first: a module may import its own layer and those before it
LAYERS = (
    "errors",
    "workload",
    "cluster",
    "network",
    "step",
    "memory",
    "simulation",
    "inputs",
    "outputs",
    "testbed",
    "calibrate",
    "validate",
    "plan",
    "cli",
    "__main__",  # python -m zsim: the command line
)
CORE = ("workload", "cluster", "network", "step", "memory", "simulation")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> Iterator[str]:
    """Every module `path` imports, at module level or inside a function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def zsim_deps(path: Path, known: dict[str, Path]) -> set[str]:
    return {m for m in imports(path) if m in known and m != "zsim"} - {module_name(path)}


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_package_is_a_known_layer():
    assert {layer(m) for m in modules() if layer(m)} <= set(LAYERS)


def test_layers_import_only_themselves_and_the_layers_below():
    known = modules()
    wrong = []
    for name, path in known.items():
        if not layer(name):
            continue  # zsim/__init__.py: the public names, from every layer
        rank = LAYERS.index(layer(name))
        for dep in zsim_deps(path, known):
            if LAYERS.index(layer(dep)) > rank:
                wrong.append(f"{name} imports {dep}")
    assert not wrong


def test_no_import_circle():
    known = modules()
    graph = {name: zsim_deps(path, known) for name, path in known.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep] if dep in stack else [node, dep]
            if dep not in state and (cycle := visit(dep, [*stack, dep])):
                return cycle
        state[node] = 2
        return None

    for name in graph:
        if name not in state:
            cycle = visit(name, [name])
            assert cycle is None, " -> ".join(cycle)


def test_the_core_needs_no_torch_and_does_no_io():
    for name, path in modules().items():
        if layer(name) not in CORE:
            continue
        deps = set(imports(path))
        assert not {d for d in deps if d.split(".")[0] in ("torch", "deepspeed")}, name
        calls = {
            n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call)
        }
        assert not calls & {"open", "print", "read_text", "write_text", "savefig"}, name


def _sources() -> list[Path]:
    return [p for d in ("zsim", "tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path: Path):
    source = path.read_text()
    assert source.count("\n") <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{node.name}: {length} lines"
