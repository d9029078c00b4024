"""``ckpt conformance run|vectors``: the conformance suite, installed (conformance/README.md).

The suite's code is packaged as ``ckptfmt.conformance`` (pyproject's package-dir maps conformance/
there, as it maps cli/ to ``ckptfmt.cli``); it is imported when the command runs, so ``ckpt``'s other
commands do not load it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click


@click.group("conformance")
def conformance_cmd() -> None:
    """Run the conformance suite against any implementation's reader or writer adapter."""


@conformance_cmd.command("run")
@click.option("--reader", metavar="CMD", help="Reader adapter, called as CMD <checkpoint dir>.")
@click.option("--writer", metavar="CMD", help="Writer adapter, called as CMD <writer-input.json> <out dir>.")
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=os.cpu_count() or 1,
    show_default=True,
    help="Adapter processes at once (readers and writers).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=120.0,
    show_default=True,
    help="Seconds an adapter may take per call.",
)
@click.option(
    "--vectors",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Another vector tree (default: the suite's own).",
)
@click.option(
    "--only",
    multiple=True,
    metavar="PATTERN",
    help="Run only these vectors: a name (globs allowed), a requirement ID or an ID prefix (repeatable).",
)
@click.option("--skip", multiple=True, metavar="PATTERN", help="Leave out these vectors (same patterns; repeatable).")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write every result, and the status of every requirement ID, as JSON.",
)
@click.option(
    "--junit-xml",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a JUnit XML file: a test case per vector.",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a markdown conformance report: which requirement IDs pass, fail or are untested.",
)
def run_cmd(
    reader: str | None,
    writer: str | None,
    jobs: int,
    timeout: float,
    vectors: Path | None,
    only: tuple[str, ...],
    skip: tuple[str, ...],
    json_path: Path | None,
    junit_xml: Path | None,
    report: Path | None,
) -> None:
    """Run a reader (--reader), a writer (--writer) or both over the vectors.

    Prints the suite and spec versions, one line per vector, then "N passed, N failed". Exit 0 every
    vector passed, 1 any failed, 2 usage (no adapter, no vector selected, an adapter that cannot start).
    """
    # conformance/ is packaged as ckptfmt.conformance; a source-tree mypy cannot see that mapping
    from ckptfmt.conformance.session import Options, run  # type: ignore[import-not-found, unused-ignore]

    options = Options(
        reader=reader,
        writer=writer,
        jobs=jobs,
        timeout=timeout,
        vectors=vectors,
        only=only,
        skip=skip,
        json_path=json_path,
        junit_xml=junit_xml,
        report=report,
    )
    sys.exit(run(options, sys.stdout, sys.stderr))


@conformance_cmd.command("vectors")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Copy the vector tree to this new directory (symlinks and hidden files kept).",
)
def vectors_cmd(out: Path | None) -> None:
    """Print where the suite's vectors are (an installed suite generates them once, into a cache)."""
    from ckptfmt.conformance.__main__ import print_vectors  # type: ignore[import-not-found, unused-ignore]

    sys.exit(print_vectors(out))
