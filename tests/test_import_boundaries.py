"""Which parts of ckptfmt may import which.

- The import graph of ``ckptfmt/`` has no circle: every module sits above what it imports.
- Nothing below the package face (``ckptfmt/__init__.py``) imports it; only the converters, the integrations
  and ``python -m ckptfmt``, which are written against the public API as a user's code is, do.
- ``ckptfmt.torch`` never imports the converters.

Every import counts: at module level, inside a function (a lazy import hides a circle from the interpreter,
not from a reader), and under ``if TYPE_CHECKING:`` (a type the lower module needs from the upper one is a
concept living in the wrong module: ``retention`` took ``Entry`` from ``run`` that way). Imports by string
(``importlib.import_module``, the converters' registry) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptfmt

PACKAGE = Path(ckptfmt.__file__).parent
FACE = "ckptfmt"
# Modules above the face, written against the public API (``import ckptfmt``) as a user's code is. The CLI and the
# conformance runner are mapped into the package when it is installed (cli/ -> ckptfmt.cli, as CI runs the tests).
FACE_USERS = (
    "ckptfmt.__main__",
    "ckptfmt.cli",
    "ckptfmt.conformance",
    "ckptfmt.convert",
    "ckptfmt.integrations",
)


def _imports(path: Path) -> set[str]:
    """The absolute module names a file of ``ckptfmt`` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            prefix = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(prefix)
            out.update(f"{prefix}.{alias.name}" for alias in node.names)
    return out


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package at ``root`` (a package is its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in the file.

    ``from X import name`` is an arrow to ``X.name`` when that is a module, else to ``X`` (``from . import
    __version__`` in ``ckptfmt/writer.py`` is an arrow to the face). An import of ``a.b.c`` is an arrow to
    ``a.b.c`` alone: that Python runs ``a/__init__.py`` first is not a dependency of the importer's on it.
    """
    modules = _modules(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        arrows: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                arrows.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                source = ".".join([*base, *(node.module.split(".") if node.module else [])])
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    arrows.add(target if target in modules else known(source))
        graph[module] = {a for a in arrows if a is not None and a != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def face_importers(graph: dict[str, set[str]]) -> list[str]:
    """The modules below the face that import it."""
    users = [m for m, arrows in graph.items() if FACE in arrows]
    return sorted(m for m in users if not any(m == u or m.startswith(u + ".") for u in FACE_USERS))


def test_the_import_graph_of_ckptfmt_has_no_circle() -> None:
    assert circles(import_graph(PACKAGE)) == [], "import circles in ckptfmt/ (see this module's doc)"


def test_nothing_below_the_package_face_imports_it() -> None:
    assert face_importers(import_graph(PACKAGE)) == []


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The scan follows what the checks above rely on: lazy, TYPE_CHECKING, relative and absolute imports, and
    a name of the face imported as ``from . import name`` (the four ways the circles of 2c837a8 were made)."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "__version__ = '1'\nfrom .top import Top\n",
        "top.py": "from .sub import low\nfrom . import __version__\n",
        "lazy.py": "def f():\n    from .sub.low import g\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .lazy import f\n",
        "sub/__init__.py": "",
        "sub/low.py": "import pkg.lazy\nfrom ..typed import x\n",
    }
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    graph = import_graph(root)
    assert graph["pkg.top"] == {"pkg.sub.low", "pkg"}
    assert graph["pkg.lazy"] == {"pkg.sub.low"}
    assert graph["pkg.typed"] == {"pkg.lazy"}
    assert graph["pkg.sub.low"] == {"pkg.lazy", "pkg.typed"}
    assert circles(graph) == [["pkg", "pkg.top"], ["pkg.lazy", "pkg.sub.low", "pkg.typed"]]


def test_torch_package_does_not_import_convert() -> None:
    files = sorted((PACKAGE / "torch").glob("*.py"))
    assert files, "ckptfmt/torch/ not found"
    offenders = {
        f"{path.name}: {name}"
        for path in files
        for name in _imports(path)
        if name == "ckptfmt.convert" or name.startswith("ckptfmt.convert.")
    }
    assert not offenders, f"ckptfmt/torch/ imports ckptfmt/convert/: {sorted(offenders)}"


def test_the_scan_sees_relative_imports() -> None:
    names = _imports(PACKAGE / "torch" / "state.py")
    assert "ckptfmt.optimizer_layout" in names or "ckptfmt.optimizer_layout" in {n.rpartition(".")[0] for n in names}
    assert "ckptfmt.torch.sharding" in names
