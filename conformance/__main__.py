"""``python -m conformance {run,generate,check}`` (protocol in conformance/README.md)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import VECTORS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a reader or a writer over the vectors and print a table")
    who = run.add_mutually_exclusive_group(required=True)
    who.add_argument("--reader", metavar="CMD", help="reader command; called as CMD <checkpoint dir>")
    who.add_argument("--writer", metavar="CMD", help="writer command; called as CMD <writer-input.json> <out dir>")
    run.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="reader processes at once (default: CPUs)")
    run.add_argument("--vectors", type=Path, default=VECTORS, help="vector tree (default: the committed one)")
    gen = sub.add_parser("generate", help="regenerate the vectors from valid.py, invalid_*.py and scenarios.py")
    gen.add_argument("--out", type=Path, default=VECTORS, help="where to write them (default: conformance/vectors)")
    sub.add_parser("check", help="traceability: every spec requirement is covered")
    args = parser.parse_args(argv)

    if args.command == "run":
        from .runner import print_table, reader_rows, writer_rows

        try:
            if args.reader:
                rows = reader_rows(shlex.split(args.reader), args.vectors, args.jobs)
            else:
                from .writer_checks import CHECKS, DETERMINISM

                ids = ", ".join([rid for rid, _ in CHECKS] + [DETERMINISM])
                print(f"every checkpoint written is read back by the reference reader and checked for {ids}")
                rows = writer_rows(shlex.split(args.writer), args.vectors)
        except OSError as exc:  # the command cannot be started at all
            print(f"cannot run {args.reader or args.writer!r}: {exc}", file=sys.stderr)
            return 2
        print_table(rows, sys.stdout)
        return 0 if rows and all(r.ok for r in rows) else 1
    if args.command == "generate":
        from .generate import generate

        generate(args.out)
        print(f"vectors written to {args.out}")
        return 0
    from .traceability import trace

    result = trace()
    for problem in result.problems:
        print(problem)
    print(
        f"{len(result.spec)} requirement IDs: {len(result.by_vectors & result.spec)} named by vectors, "
        f"{len(result.by_checks - result.by_vectors)} more by writer checks, {len(result.by_tests)} by reference tests "
        f"(coverage.json); {len(result.problems)} problem(s)"
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
