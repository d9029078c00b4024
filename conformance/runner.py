"""``run --reader CMD`` and ``run --writer CMD``: run an implementation over the vectors and print a table.

Reader: ``CMD <vector>/checkpoint`` must print the expected description (valid) or exit non-zero
(invalid). Writer: ``CMD <writer-input.json> <out_dir>`` must write a checkpoint whose content the
reference reader returns as the input describes, passing every writer check, twice byte-identically;
and must refuse each writer scenario, leaving its output directory as the scenario says.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ckptfmt.canonical import canonical_json
from ckptfmt.describe import describe
from ckptfmt.errors import CheckpointError

from .values import expected_description, load
from .writer_checks import DETERMINISM, run_checks

TIMEOUT = 120
TIMED_OUT = -1000  # not a real exit status: a hung reader neither accepts nor refuses


@dataclass(frozen=True)
class Row:
    vector: str
    requirements: str
    expected: str
    got: str
    ok: bool


def _json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _call(cmd: list[str], *args: Path) -> subprocess.CompletedProcess[str]:
    """Run the adapter; a run that does not finish in time gets the exit status ``TIMED_OUT``."""
    argv = [*cmd, *map(str, args)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, TIMED_OUT, "", f"no answer in {TIMEOUT} s")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:100] if lines else ""


def _first_difference(got: Any, want: Any, where: str = "$") -> str:
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want)):
            if key not in got or key not in want:
                return f"{where}.{key} {'missing' if key not in got else 'unexpected'}"
            if got[key] != want[key]:
                return _first_difference(got[key], want[key], f"{where}.{key}")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                return _first_difference(g, w, f"{where}[{i}]")
    return f"{where} differs"


def _compare(got: Any, want: Any) -> str | None:
    """None when equal, else where they first differ (both compared as canonical JSON)."""
    try:
        if canonical_json(got) == canonical_json(want):
            return None
    except CheckpointError as exc:  # a float NaN, a non-JSON value...
        return f"not a description: {exc.message}"
    return _first_difference(got, want)


def _reader_row(cmd: list[str], vec: Path) -> Row:
    proc = _call(cmd, vec / "checkpoint")
    if vec.parent.name == "invalid":
        expected = _json(vec / "expected.json")
        got = {0: "accepted", TIMED_OUT: "no answer"}.get(proc.returncode, "rejected")
        return Row(f"invalid/{vec.name}", ",".join(expected["requirements"]), "rejected", got, got == "rejected")
    about = _json(vec / "about.json")
    if proc.returncode != 0:
        got = f"rejected: {_last_line(proc.stderr)}"
    else:
        try:
            problem = _compare(json.loads(proc.stdout), _json(vec / "expected.json"))
        except ValueError as exc:
            problem = f"stdout is not JSON: {exc}"
        got = "same content" if problem is None else f"different content: {problem}"
    return Row(f"valid/{vec.name}", ",".join(about["requirements"]), "accepted", got, got == "same content")


def reader_rows(cmd: list[str], vectors: Path, jobs: int = 1) -> list[Row]:
    """One row per valid and invalid vector, running up to ``jobs`` reader processes at once."""
    todo = _dirs(vectors / "valid") + _dirs(vectors / "invalid")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda vec: _reader_row(cmd, vec), todo))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file and symlink under ``root`` (hidden ones included) with its bytes or link target."""
    if not root.exists():
        return {}
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = b"-> " + str(path.readlink()).encode()
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def _write_valid(cmd: list[str], vec: Path, tmp: Path) -> str:
    """'' when the writer passes on this input, else what went wrong."""
    source = vec / "writer-input.json"
    first, second = tmp / "first", tmp / "second"
    proc = _call(cmd, source, first)
    if proc.returncode != 0:
        return f"writer failed: {_last_line(proc.stderr)}"
    try:
        got = describe(first)
    except CheckpointError as exc:
        return f"reference reader refuses it: [{exc.code}] {exc.message}"[:160]
    want = expected_description(load(source.read_bytes()))
    want["format_version"] = "1.0"  # what a writer of this specification writes (VER-1)
    problems = [f"content: {d}"] if (d := _compare(got, want)) else []
    problems += [f"{rid}: {message}" for rid, message in run_checks(first, proc.stdout)]
    again = _call(cmd, source, second)
    if again.returncode != 0 or _tree(first) != _tree(second):
        problems.append(f"{DETERMINISM}: a second run gave different bytes")
    return "; ".join(problems)[:300]


def writer_rows(cmd: list[str], vectors: Path) -> list[Row]:
    rows = []
    for vec in _dirs(vectors / "valid"):
        if not (vec / "writer-input.json").exists():
            continue
        about = _json(vec / "about.json")
        with tempfile.TemporaryDirectory(prefix="ckptfmt-conformance-") as tmp:
            problem = _write_valid(cmd, vec, Path(tmp))
        rows.append(
            Row(f"valid/{vec.name}", ",".join(about["requirements"]), "written", problem or "written", not problem)
        )
    for vec in _dirs(vectors / "writer"):
        expected = _json(vec / "expected.json")
        with tempfile.TemporaryDirectory(prefix="ckptfmt-conformance-") as tmp:
            out = Path(tmp) / "out"
            if (vec / "setup").is_dir():
                shutil.copytree(vec / "setup", out, symlinks=True)
            before = _tree(out)
            proc = _call(cmd, vec / "writer-input.json", out)
            after = _tree(out)
        if proc.returncode in (0, TIMED_OUT):
            got = "written" if proc.returncode == 0 else "no answer"
        elif expected["after"] == "unchanged" and after != before:
            got = "refused, but changed the directory"
        elif expected["after"] == "empty" and after:
            got = f"refused, but left {len(after)} file(s)"
        else:
            got = "refused"
        rows.append(Row(f"writer/{vec.name}", ",".join(expected["requirements"]), "refused", got, got == "refused"))
    return rows


def print_table(rows: list[Row], stream: TextIO) -> None:
    """One line per row: vector, requirement IDs, expected, got, pass/fail; then ``N passed, N failed``."""
    header = ["vector", "requirements", "expected", "got", "result"]
    lines = [[r.vector, r.requirements, r.expected, r.got, "pass" if r.ok else "FAIL"] for r in rows]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(4)]
    for line in [header, *lines]:
        print("  ".join([*(c.ljust(w) for c, w in zip(line, widths, strict=False)), line[4]]), file=stream)
    passed = sum(r.ok for r in rows)
    print(f"{passed} passed, {len(rows) - passed} failed", file=stream)
