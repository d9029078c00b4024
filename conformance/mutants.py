"""Mutation testing of the suite itself: does every refusal check of the reference reader matter?

A mutant is the reference reader with one requirement's refusals disabled. It is made at the AST
level, so the library carries no switch for it: in a copy of the source of each module a reader
runs, a ``raise E(..., requirement=<expr>)`` whose ID is computed is guarded by ``if (<expr>) != ID``,
and any other simple statement (``raise ...``, or an expression statement such as
``report.problems.append(...)`` or ``_require(ok, ..., "FLD-2")``) holding the string literal of that
ID is replaced by ``pass`` (:class:`_Disable`). A worker process imports ``ckptfmt`` with those
modules swapped in (a meta-path finder) and runs every reader vector in process through
:func:`ckptfmt.description.canonical_description`, judged exactly as the runner judges ``ckpt dump --canonical``
(conformance/classify.py). The mutant is *caught* when some vector the unmutated reader passes now
fails; one that survives shows a check no vector needs, unless the check is provably redundant
(:data:`REDUNDANT` says which rule catches it).

``python -m conformance.mutants [--only ID ...] [--lenient] [--jobs N]``: ``--lenient`` judges with the
protocol before issue 14 (any non-zero exit is a refusal), for the "before" score in the README.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .classify import Exchange, Verdict, judge_invalid, judge_valid
from .results import Kind
from .suite import Vector, vectors, vectors_root

ID = re.compile(r"[A-Z]+-[0-9]+")

# Checks whose mutant survives because another check, run before or after it on every path a
# vector can take, refuses the same input with an ID the vector names. Each entry says which.
REDUNDANT: dict[str, str] = {
    "SAF-2": "SAF-3: a header length over 100,000,000 runs past the end of any data file under 100 MB, "
    "and the suite holds no such file (st-header-too-large names SAF-3 in also)",
    "REF-4": "REF-7: a checkpoint_id that is not 'sha256:' and 64 lowercase hex digits is the id of no checkpoint, so "
    "the base a verifying reader opens never has it (the REF-4 vectors name REF-7 in also)",
    "TEN-20": "SAF-13 with SAF-11: a verifying reader compares every chunk's range with its header entry, "
    "and entries lie in the file's data section, so no range past the end (or reversed) matches one",
    "TEN-21": "SAF-13 with SAF-9: the header entry must have the chunk's dtype, shape and range, and its "
    "byte length prod(shape) * itemsize, so a raw chunk's range of another length matches none",
    "TEN-23": "SAF-13 with SAF-14: the header entry must have the tensor's (chunk's) shape, and SAF-14 "
    "refuses the same shapes in a header as TEN-23 in the manifest",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    module: str  # "ckptfmt.manifest_parse"
    line: int


def _library_root() -> Path:
    import ckptfmt

    return Path(ckptfmt.__file__).resolve().parent


READER_PACKAGES = ("", "codecs", "storage")  # ckptfmt's subpackages a reader runs (not torch/, convert/, ...)


def _modules(root: Path) -> dict[str, Path]:
    """The reader's modules by name: ckptfmt's top-level ones, its codecs and its stores."""
    out = {}
    for package in READER_PACKAGES:
        base = ".".join(filter(None, ("ckptfmt", package)))
        for path in sorted((root / package).glob("*.py")):
            out[base if path.stem == "__init__" else f"{base}.{path.stem}"] = path
    return out


def _ids_in(node: ast.AST) -> set[str]:
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and ID.fullmatch(n.value)
    }


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _computed_requirement(node: ast.Raise) -> ast.expr | None:
    """The expression of a ``raise SomeError(..., requirement=<expr>)`` whose ID is computed, not a literal."""
    call = node.exc
    if not isinstance(call, ast.Call):
        return None
    for keyword in call.keywords:
        if keyword.arg == "requirement" and not isinstance(keyword.value, ast.Constant):
            return keyword.value
    return None


def sites(root: Path | None = None) -> dict[str, list[Site]]:
    """Every requirement ID the reader's code names, with the statements that name it literally.

    An ID only computed at run time (passed to a helper, looked up in a table) has a mutant too; its
    sites are then the raise statements whose ``requirement=`` is computed (see :class:`_Disable`).
    """
    out: dict[str, list[Site]] = {}
    for name, path in _modules(root or _library_root()).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for rid in _ids_in(tree):
            out.setdefault(rid, [])
        for stmt in ast.walk(tree):
            if isinstance(stmt, (ast.Raise, ast.Expr)) and not _is_docstring(stmt):
                for rid in _ids_in(stmt):
                    out[rid].append(Site(module=name, line=stmt.lineno))
    return dict(sorted(out.items(), key=lambda item: _key(item[0])))


def process_rules() -> set[str]:
    """Rules that no reader vector can exercise (a partial read's block checks, a writer's per-store check):
    conformance/coverage.json names the tests that cover them, so they have no mutant here."""
    return set(json.loads((Path(__file__).parent / "coverage.json").read_text(encoding="utf-8")))


def _key(rid: str) -> tuple[str, int]:
    family, number = rid.split("-")
    return family, int(number)


class _Disable(ast.NodeTransformer):
    """Disable the refusals of one requirement ID.

    - a ``raise E(..., requirement=<expr>)`` whose ID is computed (a helper's argument, a table, a
      conditional expression) becomes ``if (<expr>) != ID: raise ...``, so only the refusals of that ID
      go (the expression is evaluated once more: every such expression in the library is side-effect free);
    - any other ``raise`` or expression statement holding the ID as a literal becomes ``pass``.
    """

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.changed = 0

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        if isinstance(node, ast.Raise) and (expr := _computed_requirement(node)) is not None:
            self.changed += 1
            test = ast.Compare(left=expr, ops=[ast.NotEq()], comparators=[ast.Constant(self.rid)])
            return ast.copy_location(ast.If(test=test, body=[node], orelse=[]), node)
        if isinstance(node, (ast.Raise, ast.Expr)) and not _is_docstring(node) and self.rid in _ids_in(node):
            self.changed += 1
            return ast.copy_location(ast.Pass(), node)
        return node


def mutated_sources(rid: str, root: Path | None = None) -> dict[str, str]:
    """module name -> source with ``rid``'s refusals disabled (only modules that change)."""
    out = {}
    for name, path in _modules(root or _library_root()).items():
        disable = _Disable(rid)
        tree = disable.visit(ast.parse(path.read_text(encoding="utf-8")))
        if disable.changed:
            out[name] = ast.unparse(ast.fix_missing_locations(tree))
    return out


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the mutated modules instead of the real ones (installed first in sys.meta_path)."""

    def __init__(self, sources: dict[str, str], root: Path) -> None:
        self.sources = sources
        self.paths = _modules(root)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.sources:
            return None
        origin = self.paths[fullname]
        is_package = origin.name == "__init__.py"
        spec = importlib.util.spec_from_loader(fullname, self, origin=str(origin), is_package=is_package)
        if spec is not None and is_package:
            spec.submodule_search_locations = [str(origin.parent)]
        return spec

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = module.__spec__.origin if module.__spec__ else None
        exec(compile(self.sources[module.__name__], module.__file__ or module.__name__, "exec"), module.__dict__)


# ---------------------------------------------------------------- the reader, in process


def exchange_in_process(vec: Vector) -> Exchange:
    """What ``ckpt dump --canonical <vec>/checkpoint`` would answer, without a process per vector."""
    from ckptfmt.canonical import canonical_json
    from ckptfmt.description import canonical_description, refusal_line
    from ckptfmt.errors import CheckpointError

    argv = ("describe", str(vec.path / "checkpoint"))
    start = time.monotonic()
    stdout, stderr, status = "", "", 0
    try:
        stdout = canonical_json(canonical_description(vec.path / "checkpoint")).decode("utf-8") + "\n"
    except CheckpointError as exc:
        # as cli/dump.py: an error naming no requirement goes through cli/errors.py (exit 1, or 2 for I/O)
        status = 1 if exc.requirement is not None or exc.code not in _USAGE_CODES else 2
        stderr = refusal_line(exc) + "\n"
    except Exception as exc:  # a crash of the reader is an outcome here
        status, stderr = 1, f"Traceback (most recent call last): {type(exc).__name__}: {exc}\n"
    return Exchange(argv=argv, status=status, stdout=stdout, stderr=stderr, seconds=time.monotonic() - start, timeout=0)


_USAGE_CODES = frozenset({"usage", "storage", "not_found", "exists", "locked", "no_such_field"})


def judge(vec: Vector, ex: Exchange, *, lenient: bool = False) -> Verdict:
    if vec.kind == "valid":
        return judge_valid(ex, json.loads((vec.path / "expected.json").read_bytes()))
    if lenient and ex.status not in (None, 0):  # the protocol before issue 14: any non-zero exit refuses
        return Verdict(kind=Kind.PASSED, got="rejected")
    return judge_invalid(ex, vec.requirements, vec.also)


def outcomes(root: Path, *, lenient: bool = False) -> dict[str, tuple[str, str]]:
    """vector name -> (outcome kind, what the reader did), for every reader vector, run in this process."""
    out = {}
    for vec in vectors(root):
        if vec.kind in ("valid", "invalid"):
            verdict = judge(vec, exchange_in_process(vec), lenient=lenient)
            out[vec.name] = (verdict.kind.value, verdict.got)
    return out


def _worker(rid: str | None, root: Path, lenient: bool) -> int:
    if rid is not None:
        finder = _Finder(mutated_sources(rid), _library_root())  # (imports ckptfmt: before the purge)
        for name in [m for m in sys.modules if m == "ckptfmt" or m.startswith("ckptfmt.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, finder)
    print(json.dumps(outcomes(root, lenient=lenient)))
    return 0


# ---------------------------------------------------------------- the sweep


@dataclass(frozen=True, slots=True, kw_only=True)
class Mutant:
    requirement: str
    sites: tuple[Site, ...]
    killed_by: tuple[str, ...]  # vectors that pass unmutated and fail with it
    how: tuple[str, ...] = ()  # for each of killed_by, what the mutant did ("accepted", "refused on TEN-16, ...")
    error: str = ""  # the worker failed (the mutant does not even import): counted as caught

    @property
    def caught(self) -> bool:
        return bool(self.killed_by) or bool(self.error)


def _run_worker(rid: str | None, root: Path, lenient: bool) -> dict[str, tuple[str, str]] | str:
    argv = [sys.executable, "-m", "conformance.mutants", "--worker", rid or "-", "--vectors", str(root)]
    if lenient:
        argv.append("--lenient")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False, env=env)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["worker failed"])[-1]
    return {name: (kind, got) for name, (kind, got) in json.loads(proc.stdout).items()}


def sweep(
    only: Sequence[str] = (), *, root: Path | None = None, lenient: bool = False, jobs: int = 1
) -> tuple[dict[str, tuple[str, str]], list[Mutant]]:
    """The unmutated outcomes, and one :class:`Mutant` per requirement ID with refusal sites (or ``only``)."""
    root = vectors_root(root)
    all_sites = sites()
    process = process_rules()
    wanted = [rid for rid in all_sites if rid in only or (not only and rid not in process)]
    base = _run_worker(None, root, lenient)
    if isinstance(base, str):
        raise RuntimeError(f"the unmutated reader failed: {base}")
    passing = {name for name, (kind, _) in base.items() if kind == Kind.PASSED.value}

    def one(rid: str) -> Mutant:
        got = _run_worker(rid, root, lenient)
        if isinstance(got, str):
            return Mutant(requirement=rid, sites=tuple(all_sites[rid]), killed_by=(), error=got)
        killed = tuple(sorted(name for name in passing if got[name][0] != Kind.PASSED.value))
        how = tuple(got[name][1] for name in killed)
        return Mutant(requirement=rid, sites=tuple(all_sites[rid]), killed_by=killed, how=how)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return base, list(pool.map(one, wanted))


def breaks_more(mutants: list[Mutant], root: Path) -> dict[str, list[str]]:
    """Invalid vectors that the mutant of their own rule refuses on a rule neither named nor in ``also``.

    Such a vector breaks that rule too: a reader that checks it first is refused for the wrong reason.
    """
    named = {v.name: v for v in vectors(root)}
    out: dict[str, list[str]] = {}
    for m in mutants:
        for name, how in zip(m.killed_by, m.how, strict=True):
            vec = named[name]
            found = REFUSED_ON.match(how)
            if m.requirement in vec.requirements and found and found.group(1) not in (*vec.requirements, *vec.also):
                out.setdefault(name, []).append(found.group(1))
    return out


REFUSED_ON = re.compile(r"refused on ([A-Z]+-[0-9]+),")


def score(mutants: list[Mutant]) -> tuple[int, int, int]:
    """(caught, redundant survivors, total)."""
    caught = sum(m.caught for m in mutants)
    redundant = sum(not m.caught and m.requirement in REDUNDANT for m in mutants)
    return caught, redundant, len(mutants)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.mutants", description=__doc__)
    parser.add_argument("--only", action="append", default=[], metavar="ID", help="only this requirement's mutant")
    parser.add_argument("--lenient", action="store_true", help="judge with the protocol before issue 14")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes at once")
    parser.add_argument("--vectors", type=Path, default=None, help="vector tree (default: the suite's own)")
    parser.add_argument("--json", dest="json_path", type=Path, metavar="FILE", help="write every mutant as JSON")
    parser.add_argument("--worker", metavar="ID", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = vectors_root(args.vectors)
    if args.worker is not None:
        return _worker(None if args.worker == "-" else args.worker, root, args.lenient)

    start = time.monotonic()
    base, mutants = sweep(args.only, root=root, lenient=args.lenient, jobs=args.jobs)
    failing = sorted(name for name, (kind, _) in base.items() if kind != Kind.PASSED.value)
    if failing:
        print(f"the unmutated reader fails {len(failing)} vector(s): {', '.join(failing[:10])}")
    for m in mutants:
        where = ", ".join(f"{s.module.removeprefix('ckptfmt.')}:{s.line}" for s in m.sites)
        if m.error:
            verdict = f"caught (the mutant fails to run: {m.error[:80]})"
        elif m.caught:
            verdict = (
                f"caught by {len(m.killed_by)}: {', '.join(m.killed_by[:3])}{' ...' if len(m.killed_by) > 3 else ''}"
            )
        elif m.requirement in REDUNDANT:
            verdict = f"survived, redundant: {REDUNDANT[m.requirement]}"
        else:
            verdict = "SURVIVED"
        print(f"{m.requirement:8} {verdict}  [{where}]")
    more = breaks_more(mutants, root)
    for name, extra in more.items():
        print(f"{name} may break more than it names: refused on {', '.join(extra)} with its rule disabled")
    caught, redundant, total = score(mutants)
    protocol = "lenient" if args.lenient else "strict"
    print(
        f"{caught} of {total} mutants caught ({100 * caught / max(total, 1):.0f}%), {redundant} redundant, "
        f"{total - caught - redundant} survived; {protocol} protocol, {time.monotonic() - start:.0f} s"
    )
    if args.json_path:
        doc = {
            "protocol": protocol,
            "caught": caught,
            "redundant": redundant,
            "total": total,
            "mutants": [
                {
                    "requirement": m.requirement,
                    "caught": m.caught,
                    "killed_by": dict(zip(m.killed_by, m.how, strict=True)),
                    "error": m.error,
                    "redundant": REDUNDANT.get(m.requirement, "") if not m.caught else "",
                    "sites": [f"{s.module}:{s.line}" for s in m.sites],
                }
                for m in mutants
            ],
        }
        args.json_path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if caught + redundant == total and not failing else 1


if __name__ == "__main__":
    sys.exit(main())
