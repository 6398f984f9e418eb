"""Structural rules of the repository: no import cycles, no kind-guessing from names, layers kept apart,
and docs/architecture.md naming only files and names that exist.

The structural checks read the source with ``ast`` (nothing is imported), so
a rule broken in a module that tests never import still fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aner_nb"
REPO = PACKAGE.parent
# Folders of scripts that import each other as top-level modules (a script's folder is on sys.path:
# ``python benchmarks/bench_batching.py``, or a test or script that inserts it, as soak.py does).
SCRIPT_ROOTS = ("benchmarks", "fuzz", "scripts", "tests", "notebooks")


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


def _dotted(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repository_modules() -> dict[str, Path]:
    """Every Python module of the repository: the package's by dotted name (``aner_nb.llm.lease``),
    each script folder's as ``folder/dotted`` (``benchmarks/bench_batching``, ``tests/fixtures.models``)."""
    modules = dict(MODULES)
    for root in SCRIPT_ROOTS:
        base = REPO / root
        modules.update({f"{root}/{_dotted(p, base)}": p for p in sorted(base.rglob("*.py"))})
    return modules


def repository_imports(node: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository modules ``node`` imports, lazy imports included.

    An absolute import names a module of the importer's own script folder first, then of the
    package, then of another script folder (``benchmarks/check_kv_estimate.py`` imports the tests'
    ``fixtures.models``); anything else (the standard library, dependencies) is not an edge.
    """
    root, _, own = node.rpartition("/") if "/" in node else ("", "", node)

    def lookup(dotted: str) -> str | None:
        for candidate in ([f"{root}/{dotted}"] if root else []) + [dotted] + [f"{r}/{dotted}" for r in SCRIPT_ROOTS]:
            if candidate in modules:
                return candidate
        return None

    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for imp in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(imp, ast.Import):
            found = [lookup(a.name) for a in imp.names]
        else:
            package = own if is_package else own.rpartition(".")[0]
            base = importlib.util.resolve_name("." * imp.level + (imp.module or ""), package) if imp.level else imp.module
            found = [lookup(f"{base}.{a.name}") or lookup(base) for a in imp.names]
        out.update(f for f in found if f is not None and f != node)
    return out


def repository_import_graph() -> dict[str, set[str]]:
    modules = repository_modules()
    return {node: repository_imports(node, path, modules) for node, path in modules.items()}


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "aner_nb.llm.lease" in graph and "aner_nb.llm.batching" in graph["aner_nb.llm.lease"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_anywhere_in_the_repository():
    """The package, the benchmarks, the fuzzers, the scripts and the tests, across folders."""
    graph = repository_import_graph()
    # The walk sees script-to-script imports (lazy ones too), script-to-package and cross-folder ones.
    assert "benchmarks/_workloads" in graph["benchmarks/bench_llama_server"]
    assert "benchmarks/bench_llama_server" in graph["benchmarks/bench_batching"]  # a lazy import
    assert "aner_nb.bench" in graph["benchmarks/bench_batching"]
    assert "tests/fixtures.models" in graph["benchmarks/check_kv_estimate"]
    assert graph["aner_nb.llm.lease"] == import_graph()["aner_nb.llm.lease"]
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


# -- docs/architecture.md names only what exists ----------------------------------------------------
ARCHITECTURE = REPO / "docs" / "architecture.md"
_FILE_SUFFIXES = (".py", ".md", ".json", ".toml", ".ipynb", ".txt", ".yaml", ".yml", ".cfg", ".sh", ".gguf")
_TOP_FOLDERS = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
_SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:/[A-Za-z_]\w*)*")
_CALLED = re.compile(r"([A-Za-z_][\w.]*)\((.*)\)", re.S)


def doc_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text (fenced blocks, such as diagrams, left out)."""
    return re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", re.sub(r"```.*?```", "", text, flags=re.S))


def classify(span: str) -> tuple[str, str] | None:
    """``("path", p)``, ``("name", dotted)``, ``("defined", identifier)`` or None (not checked).

    - A path has no spaces, does not start with ``/`` (that is an HTTP route) and either ends
      with a file suffix (``.py``, ``.md``...; a pytest node ``file.py::test`` counts as the file
      plus its test), ends with ``/``, or starts with a folder of the repository or of the
      package (``aner_nb/llm``, ``llm/``).
    - A dotted name is identifiers joined by dots, optionally called (``NativeModel.free()``,
      ``bench.divergence(model, ...)``: the arguments are dropped); ``a.b/c/d`` lists the
      alternatives ``a.b``, ``a.c``, ``a.d``.
    - A bare identifier written as a call with no arguments (``prepare()``) names a function,
      class or method of the package.
    Everything else is prose: parameters (``max_tokens=0``), expressions, C functions and
    llama.cpp names (``llama_decode``), magics, routes.
    """
    span = span.strip()
    called = _CALLED.fullmatch(span)
    if called and _DOTTED.fullmatch(called.group(1)):
        return "name", called.group(1)
    if called and called.group(2) == "" and called.group(1).isidentifier():
        return "defined", called.group(1)
    if " " in span or "\n" in span or span.startswith("/"):
        return None
    file_part = span.split("::")[0]
    if (file_part.endswith(_FILE_SUFFIXES) or file_part.endswith("/")
            or ("/" in file_part and file_part.split("/")[0] in _TOP_FOLDERS | _SUBPACKAGES)):
        return "path", span
    if _DOTTED.fullmatch(span):
        return "name", span
    return None


def _installed_path(path: str) -> Path | None:
    """``pkg/x.py`` inside the installed top-level package ``pkg`` (``llama_cpp/_internals.py``)."""
    top = path.split("/")[0]
    if top == PACKAGE.name or not top.isidentifier():
        return None
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent / path


def path_exists(span: str) -> bool:
    """A path exists relative to the repository root or to the package (the page says ``llm/``,
    ``magics/cells.py``); a bare file name (``prefix_pool.py``) anywhere in the package or in
    ``benchmarks/`` (``RESULTS.md``); a path that starts with an installed package other than
    aner_nb inside that package; a pytest node id (``tests/x.py::test_y``) also needs the test."""
    file_part, _, test = span.partition("::")
    file_part = file_part.rstrip("/")
    if "/" in file_part:
        candidates = [REPO / file_part, PACKAGE / file_part, _installed_path(file_part)]
    else:
        candidates = [REPO / file_part, REPO / "benchmarks" / file_part, *PACKAGE.rglob(file_part)]
    found = [c for c in candidates if c is not None and c.exists()]
    if not found or not test:
        return bool(found)
    return any(re.search(rf"^\s*def {re.escape(test)}\(", f.read_text(), re.M) for f in found if f.is_file())


def _package_definitions() -> dict[str, list[str]]:
    """Top-level classes and functions of the package, by name: the modules that define them."""
    out: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, []).append(name)
    return out


def _package_methods() -> set[str]:
    """The names of the methods the package's classes define."""
    return {item.name for path in MODULES.values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) for item in node.body
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _has(obj: object, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    if dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
        return True
    return attr in getattr(obj, "__annotations__", {})  # a declared field (traitlets, NamedTuple)


def name_resolves(dotted: str, definitions: dict[str, list[str]]) -> bool:
    """``first.rest``: ``first`` is a package module by its last name (``_engine``, ``bench``,
    ``requests``), the package itself, a class or function the package defines (``Timings``), or
    an importable module (``numpy``, ``time``); ``rest`` are attributes of it, or submodules."""
    first, *rest = dotted.split(".")
    roots: list[str] = []
    if first == PACKAGE.name:
        roots.append(first)
    roots += [m for m in MODULES if m.rpartition(".")[2] == first]
    starts: list[object] = []
    for module in roots:
        starts.append(importlib.import_module(module))
    for module in definitions.get(first, []):
        starts.append(getattr(importlib.import_module(module), first))
    if not starts and importlib.util.find_spec(first) is not None:
        starts.append(importlib.import_module(first))
    for obj in starts:
        for i, attr in enumerate(rest):
            if _has(obj, attr):
                obj = getattr(obj, attr, None)
                continue
            try:  # a submodule not imported by its package (``tqdm.auto``)
                obj = importlib.import_module(".".join([obj.__name__] + [attr]))  # type: ignore[attr-defined]
            except (AttributeError, ImportError, TypeError):
                break
        else:
            return True
    return False


def _alternatives(dotted: str) -> list[str]:
    head, *others = dotted.split("/")
    stem = head.rpartition(".")[0]
    return [head] + [f"{stem}.{o}" for o in others]


# "`llm/requests.py` (the `RequestOptions` key ...)": a file and, first in the parenthesis after it, one of its names.
_FILE_THEN_NAME = re.compile(r"`([\w/]+\.py)`\s+\((?:the |a |an )?`([A-Za-z_]\w*)`")


def file_defines(path: str, name: str) -> bool:
    """The package module at ``path`` (relative to the repository or the package) has ``name``,
    defined or imported; another Python file defines or assigns it at its top level."""
    for candidate in (REPO / path, PACKAGE / path):
        if candidate.is_file() and PACKAGE in candidate.parents:
            return hasattr(importlib.import_module(module_name(candidate)), name)
        if candidate.is_file():
            return bool(re.search(rf"^(?:def |class )?{re.escape(name)}\b", candidate.read_text(), re.M))
    return False


def test_the_span_rules_classify_paths_names_and_prose():
    assert classify("llm/profiles.py") == ("path", "llm/profiles.py")
    assert classify("aner_nb/llm") == ("path", "aner_nb/llm")
    assert classify("tests/test_x.py::test_y") == ("path", "tests/test_x.py::test_y")
    assert classify("widgets/") == ("path", "widgets/")
    assert classify("NativeModel.free()") == ("name", "NativeModel.free")
    assert classify("deadline.within(2 s)") == ("name", "deadline.within")
    assert classify("Lease.generate/chat/stream") == ("name", "Lease.generate/chat/stream")
    assert _alternatives("Lease.generate/chat/stream") == ["Lease.generate", "Lease.chat", "Lease.stream"]
    assert classify("prepare()") == ("defined", "prepare")
    for prose in ("/openapi.json", "max_tokens=0", "llama_decode", "%llm", "seq_pos_min/max", "k * D(1) / D(k)",
                  "outcome == \"ok\"", "with_batching(n)"):
        assert classify(prose) is None, prose
    definitions = _package_definitions()
    assert name_resolves("aner_nb.llm.lookup", definitions) and name_resolves("Timings.assemble", definitions)
    assert not name_resolves("Timings.no_such_thing", definitions) and not name_resolves("no_such_module.x", definitions)
    assert path_exists("docs/architecture.md") and not path_exists("docs/no_such_page.md")
    pairs = _FILE_THEN_NAME.findall("`llm/requests.py` (the `prepare` function), `llm/chat.py` (templates: `x`)")
    assert pairs == [("llm/requests.py", "prepare")] and file_defines(*pairs[0])
    assert not file_defines("llm/requests.py", "no_such_function")


def test_every_path_and_name_in_the_architecture_notes_exists():
    """docs/architecture.md: each backticked path, dotted name and ``function()`` (see :func:`classify`),
    and each name given first in parentheses after a file (see ``_FILE_THEN_NAME``) is in that file."""
    definitions, methods = _package_definitions(), _package_methods()
    missing = []
    for span in doc_spans(ARCHITECTURE.read_text()):
        kind = classify(span)
        if kind is None:
            continue
        what, value = kind
        if what == "path":
            ok = path_exists(value)
        elif what == "name":
            ok = all(name_resolves(n, definitions) for n in _alternatives(value))
        else:
            ok = value in definitions or value in methods
        if not ok:
            missing.append(span)
    text = ARCHITECTURE.read_text()
    missing += [f"{name} in {path}" for path, name in _FILE_THEN_NAME.findall(text) if not file_defines(path, name)]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
