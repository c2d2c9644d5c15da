"""No import cycles inside ``slurm_ckpt``: read from the source, not by importing it.

A cycle works until someone imports the modules in another order, then fails
with a half-initialised module. The graph holds the imports that run when a
module is imported: module-level statements (class bodies, ``if`` and ``try``
blocks included), not those inside functions (the lazy imports that keep the
hooks fast) nor those under ``if TYPE_CHECKING:``. Importing ``a.b.c`` first
imports the packages ``a`` and ``a.b``, so those count too, except a package
the importing module itself lives in (it is already being imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "slurm_ckpt"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run at import time: not in functions, not under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _runtime_imports(node.body)
            found += _runtime_imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    found += _runtime_imports([s for s in sub if isinstance(s, ast.stmt)])
                    for h in sub:
                        if isinstance(h, ast.ExceptHandler):
                            found += _runtime_imports(h.body)
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _all_imports(body: list[ast.stmt], typed: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, the lazy ones in functions included
    (``typed``: and those only a type checker reads)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not typed:
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return found


def import_graph(root: Path = ROOT, *, lazy: bool = False, typed: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules importing it imports at once (``lazy``: or ever;
    ``typed``: or ever, or for type hints)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]
        own = set(_ancestors(mod)) | ({mod} if is_pkg else set())
        # (module, whether a name is read from its namespace)
        targets: list[tuple[str, bool]] = []
        body = ast.parse(path.read_text(), str(path)).body
        for node in _all_imports(body, typed) if lazy or typed else _runtime_imports(body):
            if isinstance(node, ast.Import):
                targets += [(a.name, False) for a in node.names]
                continue
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            targets.append((src, False))
            for a in node.names:
                sub = f"{src}.{a.name}"
                # ``from pkg import name``: a submodule, or a name pkg's __init__
                # must have defined already, even when pkg is our own package.
                targets.append((sub, False) if sub in mods else (src, True))
        for t, reads in targets:
            for name in [*_ancestors(t), t]:
                if name not in mods or name == mod:
                    continue
                if name not in own or (reads and name == t):
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    # Sanity: a few edges everyone relies on, so an empty graph cannot pass.
    assert "slurm_ckpt.errors" in graph["slurm_ckpt.store.commit"]
    assert "slurm_ckpt.store.manifest" in graph["slurm_ckpt.store.commit"]
    assert "slurm_ckpt.store" in graph["slurm_ckpt.checkpointer"]  # parent of store.X


def test_cycles_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n"
        "def f():\n    from .. import a\n"
    )
    (pkg / "c.py").write_text("from . import a\n")
    assert cycles(import_graph(pkg)) == []  # only lazy and type-only imports close the loop
    (pkg / "sub" / "b.py").write_text("try:\n    from ..a import x\nexcept ImportError:\n    pass\n")
    assert cycles(import_graph(pkg)) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub", f"{PACKAGE}.sub.b"]]
    # A name read from the package's own __init__, which imports the module first.
    (pkg / "sub" / "b.py").write_text("from . import NAME\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import x\nNAME = 1\n")
    assert cycles(import_graph(pkg)) == [[f"{PACKAGE}.sub", f"{PACKAGE}.sub.b"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in slurm_ckpt (break them with a module of its own):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_no_import_cycles_through_lazy_imports() -> None:
    # A function-level import keeps the hooks fast; it must not hide a loop
    # between two modules either (stage-out and shard stage-out had one).
    found = cycles(import_graph(lazy=True))
    assert not found, "import cycles in slurm_ckpt through function-level imports:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_no_import_cycles_through_type_hints() -> None:
    # Two modules that name each other's types are one module in two files.
    found = cycles(import_graph(typed=True))
    assert not found, "import cycles in slurm_ckpt through type-only imports:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_lazy_imports_are_seen(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert cycles(import_graph(pkg, lazy=True)) == []  # a type-only import never runs
    assert cycles(import_graph(pkg, typed=True)) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]
    (pkg / "b.py").write_text("def f():\n    if True:\n        from .a import x\n")
    assert cycles(import_graph(pkg)) == []
    assert cycles(import_graph(pkg, lazy=True)) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]

