"""``python -m conformance {run,vectors,generate,check}`` (protocol in conformance/README.md).

From a checkout this is the same runner as the installed ``ckpt conformance run``; ``generate`` and
``check`` need the repository (they write the committed vectors and read spec/).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from . import SPEC, VECTORS


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--reader", metavar="CMD", help="reader command; called as CMD <checkpoint dir>")
    run.add_argument("--writer", metavar="CMD", help="writer command; called as CMD <writer-input.json> <out dir>")
    run.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="adapter processes at once (default: CPUs)")
    run.add_argument("--timeout", type=float, default=120.0, help="seconds an adapter may take per call (120)")
    run.add_argument("--vectors", type=Path, default=None, help="vector tree (default: the suite's own)")
    run.add_argument("--only", action="append", default=[], metavar="PATTERN", help="vector name or requirement ID")
    run.add_argument("--skip", action="append", default=[], metavar="PATTERN", help="vector name or requirement ID")
    run.add_argument("--json", dest="json_path", type=Path, metavar="FILE", help="write every result as JSON")
    run.add_argument("--junit-xml", type=Path, metavar="FILE", help="write a JUnit XML file, a case per vector")
    run.add_argument("--report", type=Path, metavar="FILE", help="write a markdown conformance report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="run a reader and/or a writer over the vectors"))
    vec = sub.add_parser("vectors", help="print where the vectors are (generating them once if installed)")
    vec.add_argument("--out", type=Path, help="copy them there instead (symlinks and hidden files kept)")
    gen = sub.add_parser("generate", help="regenerate the vectors from valid.py, invalid_*.py and scenarios.py")
    gen.add_argument("--out", type=Path, default=None, help="where to write them (default: conformance/vectors)")
    sub.add_parser("check", help="traceability: every spec requirement is covered")
    args = parser.parse_args(argv)

    if args.command == "run":
        from .session import Options, run

        options = Options(
            reader=args.reader,
            writer=args.writer,
            jobs=args.jobs,
            timeout=args.timeout,
            vectors=args.vectors,
            only=tuple(args.only),
            skip=tuple(args.skip),
            json_path=args.json_path,
            junit_xml=args.junit_xml,
            report=args.report,
        )
        return run(options, sys.stdout, sys.stderr)
    if args.command == "vectors":
        return print_vectors(args.out)
    if not SPEC.is_dir() and (args.command == "check" or args.out is None):
        print(f"{args.command} needs a checkout of the repository (spec/, conformance/vectors/)", file=sys.stderr)
        return 2
    if args.command == "generate":
        from .generate import generate

        out = args.out or VECTORS
        generate(out)
        if out == VECTORS:  # the digest an installed suite checks its generated tree against
            from .suite import DIGEST_FILE, tree_digest

            DIGEST_FILE.write_text(tree_digest(out) + "\n", encoding="ascii")
        print(f"vectors written to {out}")
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


def print_vectors(out: Path | None) -> int:
    from ckptfmt.errors import CheckpointError

    from .suite import vectors_root

    try:
        root = vectors_root()
    except CheckpointError as exc:
        print(f"cannot use the conformance vectors: {exc}", file=sys.stderr)
        return 2
    if out is None:
        print(root)
        return 0
    if out.exists():
        print(f"{out} exists; give a new directory", file=sys.stderr)
        return 2
    shutil.copytree(root, out, symlinks=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
