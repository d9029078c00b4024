"""Cross-references in the library's docstrings name things that exist.

A ``:func:`x``` (or ``:meth:``, ``:class:``, ``:mod:``, ``:attr:``) names a function, method, class, module or
attribute: a dotted ``ckptfmt.…`` one must import and resolve, and a bare one must be defined or imported by
its module (a method: by some class of the package). So a rename cannot leave a docstring pointing at nothing.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("ckptfmt", "cli", "conformance") for p in (ROOT / d).rglob("*.py"))
ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|exc):`~?([^`<>]+?)(?:\(\))?`")
OUTSIDE = ("torch.", "numpy.", "np.", "fsspec.", "safetensors.", "lightning.", "accelerate.", "transformers.")


def _names(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


@functools.cache
def _names_of(where: str) -> frozenset[str]:
    return frozenset(_names(ast.parse((ROOT / where).read_text())))


PACKAGE_NAMES = set().union(*(_names_of(str(p.relative_to(ROOT))) for p in SOURCES))


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _references() -> list[tuple[str, str]]:
    out = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                out.extend((str(path.relative_to(ROOT)), m.group(1)) for m in ROLE.finditer(doc))
    return out


@pytest.mark.parametrize(("where", "target"), _references())
def test_a_docstring_reference_names_something_that_exists(where: str, target: str) -> None:
    if target.startswith(OUTSIDE):
        return
    if target.startswith("."):  # relative to the module's package, as an import would be
        package = where.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
        if not package.startswith("ckptfmt"):
            package = "ckptfmt." + package  # cli/ and conformance/ are packaged as ckptfmt.cli, ckptfmt.conformance
        target = package + target
    if target.startswith("ckptfmt."):
        assert _resolves(target), f"{where}: {target} does not exist"
        return
    local = _names_of(where)
    head, *rest = target.split(".")
    assert head in local or head in PACKAGE_NAMES, f"{where}: {target} names nothing defined or imported there"
    assert all(part in PACKAGE_NAMES for part in rest), f"{where}: {target} names no attribute of the package"


def test_the_references_are_found() -> None:
    assert len(_references()) > 50  # the pattern still matches the docstrings' style
