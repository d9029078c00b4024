"""``ckpt verify URL``: re-read and re-hash everything, streaming, and report every problem found."""

from __future__ import annotations

from typing import Any

import click

import ckptfmt
from ckptfmt.reader import open_for_verify

from .errors import FAILED, OK, USAGE, exit_code_for, reports_errors
from .options import json_output, quiet, storage_options
from .output import ProgressBar, emit_json, human_bytes


def run_verify(url: str, storage_options: dict[str, Any], *, quick: bool, quiet: bool) -> ckptfmt.VerifyReport:
    """The report; a checkpoint that cannot be opened (incomplete, invalid manifest) is a report too.

    Errors that are not about the checkpoint (nothing there, storage failing) propagate, to exit as usage errors.
    """
    opened = open_for_verify(url, storage_options, quick=quick, raise_if=lambda exc: exit_code_for(exc) != FAILED)
    if isinstance(opened, ckptfmt.VerifyReport):
        return opened
    with opened, ProgressBar("verify", quiet=quiet) as bar:
        bar.start(opened.manifest.total_bytes)
        return opened.verify(quick=quick, progress=bar.advance)


def _render(report: ckptfmt.VerifyReport) -> str:
    counts = f"{report.files_checked} files, {report.chunks_checked} chunks, {human_bytes(report.bytes_checked)} hashed"
    mode = " (quick: structure and sizes, no hashing)" if report.quick else ""
    if report.ok:
        return f"OK       {report.url}\n         {report.checkpoint_id}\n         {counts}{mode}"
    lines = [f"INVALID  {report.url}: {len(report.problems)} problem(s){mode}"]
    if report.checkpoint_id:
        lines.append(f"         {report.checkpoint_id}; {counts}")
    lines += [f"  {problem}" for problem in report.problems]
    return "\n".join(lines)


@click.command("verify")
@click.argument("url")
@click.option("--quick", is_flag=True, help="Check structure and sizes only; do not re-hash.")
@storage_options
@json_output
@quiet
@reports_errors
def verify_cmd(url: str, quick: bool, storage_options: dict[str, Any], as_json: bool, quiet: bool) -> None:
    """Check that the checkpoint at URL is whole and uncorrupted, re-hashing every byte (bounded memory).

    Reports all problems found. Exit 0 valid, 1 invalid or incomplete, 2 usage or I/O error.
    """
    report = run_verify(url, storage_options, quick=quick, quiet=quiet)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(_render(report))
    if report.ok:
        raise SystemExit(OK)
    raise SystemExit(USAGE if any(p.code == "storage" for p in report.problems) else FAILED)
