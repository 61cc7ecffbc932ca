"""The layout rules of docs/ARCHITECTURE.md, checked on the source text (no import is executed).

* no import circle among the project's modules, counting imports made inside functions;
* no module imports another module's private (``_underscore``) name, or reaches one through a
  module it imported (``mod._name``);
* no source file under kdtree_numba/, reference/ or formats/ is longer than MAX_LINES.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kdtree_numba", "reference", "formats")
MAX_LINES = 800


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _sources()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(current: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    if not _is_package(current):
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str):
    """(target module, imported name or None, line) for every import in the module, at any
    depth (inside functions too).  ``from pkg import sub`` targets the submodule ``pkg.sub``."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node.module, node.level)
            if target == "__future__":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                elif target in MODULES:
                    yield target, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    return {name: {t for t, _, _ in _imports(name) if t != name} for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_the_packages():
    assert {"kdtree_numba.ddtree", "reference.layers", "formats.kdtr"} <= set(MODULES)
    graph = _graph()
    assert "kdtree_numba.compat" in graph["kdtree_numba.ddtree.build"] or any(
        t.startswith("kdtree_numba.gpu") for t in graph["kdtree_numba.ddtree.build"])
    # the checker finds a circle where one exists
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_counting_function_level_imports():
    assert _cycles(_graph()) == []


def _private_uses(name: str):
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    module_aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    module_aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node.module, node.level)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    module_aliases[alias.asname or alias.name] = sub
    for target, imported, line in _imports(name):
        if imported and imported.startswith("_") and not imported.startswith("__") \
                and target != name:
            yield f"{name}:{line} imports {target}.{imported}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases and node.attr.startswith("_")
                and not node.attr.startswith("__") and module_aliases[node.value.id] != name):
            yield f"{name}:{node.lineno} uses {module_aliases[node.value.id]}.{node.attr}"


def test_no_module_uses_another_modules_private_name():
    assert [use for name in MODULES for use in _private_uses(name)] == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_source_files_are_short(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines"


# Where each package may read the environment: one module (docs/ARCHITECTURE.md).
ENVIRONMENT_READERS = {"kdtree_numba": "kdtree_numba.runtime", "formats": "formats.console",
                       "reference": None}


def _environment_reads(name: str):
    """Lines of ``name`` that read the process environment (``os.environ``, ``os.getenv``)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "os" and node.attr in ("environ", "getenv", "environb"):
            yield node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv") for a in node.names):
            yield node.lineno


def test_each_package_reads_the_environment_in_one_module():
    found = [f"{name}:{line}" for name in MODULES for line in _environment_reads(name)
             if ENVIRONMENT_READERS[name.split(".")[0]] != name]
    assert found == [], "read the switch through kdtree_numba.runtime (formats: formats.console)"



def test_ops_and_weights_are_not_namespaces():
    """The model's kernels and weights are typed objects a reader can follow, not
    SimpleNamespace bags (go-to-definition stops at a namespace)."""
    for name in ("kdtree_numba.backends", "kdtree_numba.model"):
        assert "SimpleNamespace" not in MODULES[name].read_text(), name
