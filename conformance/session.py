"""One run of the suite as both front ends do it (``ckpt conformance run``, ``python -m conformance run``).

Prints the suite and spec versions first, then one line per vector, then exactly ``N passed, N failed``;
writes the requested files (JSON, JUnit XML, markdown report); returns the exit status: 0 every
vector passed, 1 any failed, 2 nothing to run or an adapter that cannot be started.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ckptfmt.errors import CheckpointError

from . import COVERAGE
from .junit import write_junit_xml
from .report import write_report
from .results import Result, Run
from .runner import TIMEOUT, run_reader, run_writer
from .suite import known_ids, select, suite, vectors, vectors_root
from .writer_checks import CHECKS, DETERMINISM


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    reader: str | None = None  # CMD <checkpoint dir>
    writer: str | None = None  # CMD <writer-input.json> <out dir>
    jobs: int = 1
    timeout: float = TIMEOUT
    vectors: Path | None = None  # default: the committed tree, or this installation's generated one
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    json_path: Path | None = None
    junit_xml: Path | None = None
    report: Path | None = None


def print_table(results: list[Result], out: TextIO) -> None:
    """One line per result: vector, requirement IDs, expected, got, pass/FAIL; then ``N passed, N failed``."""
    header = ["vector", "requirements", "expected", "got", "result"]
    lines = [[r.vector, ",".join(r.requirements), r.expected, r.got, "pass" if r.ok else "FAIL"] for r in results]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(4)]
    for line in [header, *lines]:
        print("  ".join([*(c.ljust(w) for c, w in zip(line, widths, strict=False)), line[4]]), file=out)
    passed = sum(r.ok for r in results)
    print(f"{passed} passed, {len(results) - passed} failed", file=out)


def run(options: Options, out: TextIO, err: TextIO) -> int:
    if not (options.reader or options.writer):
        print("give --reader CMD, --writer CMD or both", file=err)
        return 2
    for command in (options.reader, options.writer):
        try:
            shlex.split(command or "")
        except ValueError as exc:  # an unclosed quote
            print(f"cannot parse {command!r}: {exc}", file=err)
            return 2
    try:
        root = vectors_root(options.vectors)
    except CheckpointError as exc:  # a generated tree that is not the one this release ships
        print(f"cannot use the conformance vectors: {exc}", file=err)
        return 2
    everything = vectors(root)
    chosen = select(everything, options.only, options.skip)
    about = suite(root)
    print(about.line, file=out, flush=True)  # first, even when the run takes minutes and stdout is a pipe
    commands = {d: c for d, c in (("reader", options.reader), ("writer", options.writer)) if c}
    todo = [v for v in chosen if v.kind != "writer"] if options.reader else []
    writes = [v for v in chosen if v.writes] if options.writer else []
    if not todo and not writes:
        print(f"no vector of {root} matches --only {options.only} --skip {options.skip}", file=err)
        return 2
    start = time.monotonic()
    results: list[Result] = []
    command = ""
    try:
        if options.reader:
            command = options.reader
            results += run_reader(shlex.split(command), todo, options.jobs, options.timeout)
        if options.writer:
            command = options.writer
            ids = ", ".join([rid for rid, _ in CHECKS] + [DETERMINISM])
            print(f"every checkpoint written is read back by the reference reader and checked for {ids}", file=out)
            results += run_writer(shlex.split(command), writes, options.timeout, options.jobs)
    except OSError as exc:  # the command cannot be started at all
        print(f"cannot run {command!r}: {exc}", file=err)
        return 2
    untested = json.loads(COVERAGE.read_bytes()) if COVERAGE.is_file() else {}
    result = Run(
        suite=about,
        commands=commands,
        results=results,
        seconds=time.monotonic() - start,
        untested=untested,
        known=known_ids(everything) - set(untested),
    )
    print_table(results, out)
    try:
        if options.json_path:
            document = json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n"
            options.json_path.write_text(document, encoding="utf-8")
        if options.junit_xml:
            write_junit_xml(result, options.junit_xml)
        if options.report:
            write_report(result, options.report)
    except OSError as exc:  # a CI that finds no result file must not think the suite passed
        print(f"cannot write the results: {exc}", file=err)
        return 2
    return 0 if result.ok else 1
