"""Run an implementation's adapters over the vectors: one :class:`~.results.Result` per vector.

Reader: ``CMD <vector>/checkpoint`` must print the expected description (valid) or refuse
(invalid); the judge is conformance/classify.py; the checkpoints it references are its siblings in the
vector's directory. Writer: ``CMD <writer-input.json> <out_dir>`` must
write a checkpoint whose content the reference reader returns as the input describes, passing every
writer check, twice byte-identically; and must refuse each writer scenario, leaving its output
directory as the scenario says. The output directory's siblings are copies of the vector's bases, which a
writer input's hint ``base`` may name (spec/references.md).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from ckptfmt.description import canonical_description
from ckptfmt.errors import CheckpointError

from .classify import REFUSAL_STATUS, Exchange, judge_invalid, judge_valid, mismatch
from .results import Kind, Result
from .suite import Vector
from .values import expected_description, load
from .writer_checks import CHECKS, DETERMINISM, expected_version, run_checks

TIMEOUT = 120.0
STDOUT_LIMIT = 64 << 20  # a description longer than this is not one (the largest vector's is a few KiB)
STDERR_LIMIT = 64 << 10  # kept for the reports: the start of what the adapter said


def _read(stream: IO[bytes], limit: int) -> str:
    stream.seek(0)
    data = stream.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")  # an adapter's bytes need not be UTF-8
    return text + ("\n[... truncated]" if len(data) > limit else "")


def call(cmd: list[str], *args: Path, timeout: float = TIMEOUT) -> Exchange:
    """Run the adapter with its output in files (bounded reads; a grandchild holding a pipe cannot hang us).

    The adapter runs in a process group of its own, killed whole when the call ends however it ends
    (answered, timed out, or interrupted): a hung adapter's children, or a daemon it left behind,
    never outlive the call. (A process that leaves the group with setsid() is beyond any runner.)
    """
    argv = (*cmd, *map(str, args))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        answered = False
        try:
            answered = _exited(proc, timeout)
        finally:
            _kill_group(proc)
        status = proc.returncode if answered else None
        seconds = time.monotonic() - start
        return Exchange(
            argv=argv,
            status=status,
            stdout=_read(out, STDOUT_LIMIT),
            stderr=_read(err, STDERR_LIMIT),
            seconds=seconds,
            timeout=timeout,
        )


def _exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether the adapter exits within ``timeout``, waited for without reaping it: until it is reaped its pid,
    the group's id, cannot be given to another process, so killing the group cannot hit a stranger."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (not Linux, or before 5.3): reap, and accept the tiny race
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(ready)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the adapter's process group (its own pid: start_new_session), then reap the adapter."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone: every process of it has exited
    proc.wait()


def _json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _reader_result(cmd: list[str], vec: Vector, timeout: float) -> Result:
    ex = call(cmd, vec.path / "checkpoint", timeout=timeout)
    if vec.kind == "invalid":
        verdict, expected = judge_invalid(ex, vec.requirements, vec.also), "rejected"
    else:
        verdict, expected = judge_valid(ex, _json(vec.path / "expected.json")), "accepted"
    return Result(
        vector=vec.name,
        direction="reader",
        requirements=vec.requirements,
        also=vec.also,
        expected=expected,
        got=verdict.got,
        kind=verdict.kind,
        detail=verdict.detail,
        checked=vec.requirements,
        failed=() if verdict.kind is Kind.PASSED else vec.requirements,
        exit_status=ex.status,
        stdout="" if verdict.kind is Kind.PASSED else ex.stdout[:STDERR_LIMIT],
        stderr=ex.stderr,
        seconds=ex.seconds,
    )


def run_reader(cmd: list[str], todo: list[Vector], jobs: int = 1, timeout: float = TIMEOUT) -> list[Result]:
    """One result per valid and invalid vector of ``todo``, running up to ``jobs`` reader processes at once."""
    todo = [v for v in todo if v.kind in ("valid", "invalid")]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda vec: _reader_result(cmd, vec, timeout), todo))


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


def _write_valid(cmd: list[str], vec: Vector, tmp: Path, timeout: float) -> Result:
    source = vec.path / "writer-input.json"
    first, second = tmp / "first", tmp / "second"
    for base in vec.bases:  # the checkpoints an input's hint "base" may name, beside the output directory
        shutil.copytree(base, tmp / base.name, symlinks=True)
    ex = call(cmd, source, first, timeout=timeout)
    seconds = ex.seconds
    problems: list[tuple[Kind, tuple[str, ...], str]] = []  # kind, the IDs it fails, message
    checked: tuple[str, ...] = vec.requirements
    if ex.status is None:
        problems.append((Kind.NO_ANSWER, vec.requirements, f"no answer in {timeout:g} s"))
    elif ex.status != 0:
        problems.append((Kind.WRITE_FAILED, vec.requirements, f"writer failed: {_last_line(ex.stderr)}"))
    else:
        try:
            written = canonical_description(first)
        except CheckpointError as exc:
            message = f"reference reader refuses it: [{exc.code}] {exc.message}"[:160]
            problems.append((Kind.UNREADABLE, vec.requirements, message))
        else:
            checked = (*vec.requirements, *(rid for rid, _ in CHECKS), DETERMINISM)
            want = expected_description(load(source.read_bytes()))
            # what a writer of this specification writes for what it wrote (VER-1): 1.0, or 1.2 with block digests
            want["format_version"] = expected_version(json.loads((first / "manifest.json").read_bytes()))
            if (difference := mismatch(written, want)) is not None:
                problems.append((Kind.WRONG_CONTENT, vec.requirements, f"content: {difference}"))
            for rid, message in run_checks(first, ex.stdout):
                problems.append((Kind.CHECK_FAILED, (rid,), f"{rid}: {message}"))
            again = call(cmd, source, second, timeout=timeout)
            seconds += again.seconds
            if again.status != 0 or _tree(first) != _tree(second):
                message = f"{DETERMINISM}: a second run gave different bytes"
                problems.append((Kind.NOT_DETERMINISTIC, (DETERMINISM,), message))
    messages = "; ".join(message for _, _, message in problems)
    return Result(
        vector=vec.name,
        direction="writer",
        requirements=vec.requirements,
        expected="written",
        got=messages[:300] or "written",
        kind=problems[0][0] if problems else Kind.PASSED,
        detail=messages,
        checked=checked,
        failed=tuple(dict.fromkeys(rid for _, rids, _ in problems for rid in rids)),
        exit_status=ex.status,
        stdout=ex.stdout[:STDERR_LIMIT] if problems else "",
        stderr=ex.stderr,
        seconds=seconds,
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:100] if lines else ""


def _scenario(cmd: list[str], vec: Vector, tmp: Path, timeout: float) -> Result:
    out = tmp / "out"
    if (vec.path / "setup").is_dir():
        shutil.copytree(vec.path / "setup", out, symlinks=True)
    before = _tree(out)
    ex = call(cmd, vec.path / "writer-input.json", out, timeout=timeout)
    after = _tree(out)
    if ex.status is None:
        kind, got = Kind.NO_ANSWER, "no answer"
    elif ex.status == 0:
        kind, got = Kind.NOT_REFUSED, "written"
    elif ex.status != REFUSAL_STATUS:  # a signal or another status: a crash is not a refusal
        kind, got = Kind.CRASHED, f"crashed (exit status {ex.status})"
    elif vec.doc["after"] == "unchanged" and after != before:
        changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        kind, got = Kind.LEFT_CHANGES, f"refused, but changed the directory: {', '.join(changed)[:100]}"
    elif vec.doc["after"] == "empty" and after:
        kind, got = Kind.LEFT_CHANGES, f"refused, but left {len(after)} file(s)"
    else:
        kind, got = Kind.PASSED, "refused"
    return Result(
        vector=vec.name,
        direction="writer",
        requirements=vec.requirements,
        expected="refused",
        got=got,
        kind=kind,
        detail="" if kind is Kind.PASSED else got,
        checked=vec.requirements,
        failed=() if kind is Kind.PASSED else vec.requirements,
        exit_status=ex.status,
        stderr=ex.stderr,
        seconds=ex.seconds,
    )


def run_writer(cmd: list[str], todo: list[Vector], timeout: float = TIMEOUT, jobs: int = 1) -> list[Result]:
    """One result per writer input (valid vectors that have one) and per writer scenario of ``todo``, in order,
    running up to ``jobs`` of them at once (each in a directory of its own)."""

    def one(vec: Vector) -> Result:
        with tempfile.TemporaryDirectory(prefix="ckptfmt-conformance-") as tmp:
            run = _scenario if vec.kind == "writer" else _write_valid
            return run(cmd, vec, Path(tmp), timeout)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, [v for v in todo if v.writes]))
