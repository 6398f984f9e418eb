"""Structural rules of the package: no import cycles, no kind-guessing from names, layers kept apart.

These read the source with ``ast`` (nothing is imported), so a rule broken
in a module that tests never import still fails here.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aner_nb"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs: at module level, in functions (lazy imports count), not under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def internal_imports(name: str, path: Path) -> set[str]:
    """The aner_nb modules ``name`` imports (``from pkg import submodule`` counts as the submodule)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            package = name if is_package else name.rpartition(".")[0]
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        out.update(t for t in targets if t in MODULES and t != name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = dfs(start)
            if cycle:
                return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    # A submodule's import also runs its package's __init__; the package does not import back
    # through that edge, so only explicit imports are edges.
    return {name: internal_imports(name, path) for name, path in MODULES.items()}


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "aner_nb.llm.lease" in graph and "aner_nb.llm.batching" in graph["aner_nb.llm.lease"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_layers_follow_the_design():
    """llm/ imports no IPython, widgets, HTTP or magics code; only _engine imports llama_cpp."""
    forbidden = ("IPython", "ipywidgets", "fastapi", "starlette", "uvicorn", "aner_nb.magics", "aner_nb.widgets", "aner_nb.api")
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        modules = {a.name for n in _imports(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module or "" for n in _imports(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        if name.startswith("aner_nb.llm"):
            bad = sorted(m for m in modules if m.startswith(forbidden))
            assert not bad, f"{name} imports {bad}"
        if name != "aner_nb.llm._engine":
            assert not any(m.split(".")[0] == "llama_cpp" for m in modules), f"{name} imports llama_cpp"


NAME_ATTRIBUTES = {"__name__", "__module__", "__qualname__"}


def name_sniffing(path: Path) -> list[int]:
    """Lines that use a class or module name as data (compared, matched, used as a key).

    Allowed: the name inside an f-string (an error message), ``getLogger(__name__)``,
    ``if __name__ == "__main__"`` and assigning a name (``f.__name__ = ...``).
    """
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FormattedValue):
            allowed.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger":
            allowed.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "__name__":
            if all(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.comparators):
                allowed.add(id(node.left))
    lines = []
    for node in ast.walk(tree):
        named = (isinstance(node, ast.Attribute) and node.attr in NAME_ATTRIBUTES) or (
            isinstance(node, ast.Name) and node.id in NAME_ATTRIBUTES
        )
        if named and isinstance(node.ctx, ast.Store):
            continue  # naming something (``f.__name__ = ...``) is not reading a name as data
        if named and id(node) not in allowed:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_sniffing_check_flags_name_comparisons_only():
    import textwrap

    sample = PACKAGE.parent / "tests" / "_sniff_sample.py"
    sample.write_text(textwrap.dedent('''
        import logging
        log = logging.getLogger(__name__)
        def f(x):
            if type(x).__name__ == "Session":
                return 1
            if x.__class__.__module__.startswith("aner_nb.llm"):
                return 2
            raise TypeError(f"got {type(x).__name__}")
        if __name__ == "__main__":
            f(1)
    '''))
    try:
        assert name_sniffing(sample) == [5, 7]
    finally:
        sample.unlink()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_kind_guessing_from_class_or_module_names(name):
    """Consumers switch on ``Lease.kind`` / ``supports()`` / isinstance, never on names."""
    assert name_sniffing(MODULES[name]) == [], f"{name} uses __name__/__module__ as data"
