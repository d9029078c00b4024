"""Which parts of ckptfmt may import which: ``ckptfmt.torch`` never imports the converters."""

from __future__ import annotations

import ast
from pathlib import Path

import ckptfmt

PACKAGE = Path(ckptfmt.__file__).parent


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
