"""``ckpt dump URL``: the canonical description of a checkpoint's content (conformance/README.md).

This is the reference implementation's reader adapter for the conformance suite; the description
itself is computed by :mod:`ckptfmt.description`.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ckptfmt.canonical import canonical_json
from ckptfmt.description import canonical_description, refusal_line
from ckptfmt.errors import CheckpointError

from .errors import FAILED, reports_errors
from .options import storage_options
from .output import emit_json


@click.command("dump")
@click.argument("url")
@click.option(
    "--canonical",
    is_flag=True,
    help="Print canonical JSON (one line, sorted keys) instead of indented, and refuse as the conformance "
    "suite's strict protocol says (exit 1, stderr's first line starting with the requirement ID).",
)
@storage_options
@reports_errors
def dump_cmd(url: str, canonical: bool, storage_options: dict[str, Any]) -> None:
    """Verify the checkpoint at URL in full and print its content as the conformance suite's description.

    Tensors appear as dtype, shape and the SHA-256 of their bytes; context values as JSON. Exit 0
    printed, 1 the checkpoint is refused (the error's code on stderr), 2 usage or I/O error. With
    --canonical a refusal that names the rule it refused on prints ``<ID>: [<code>] <message>`` as
    the first line of stderr and exits 1, whatever the error (the strict reader protocol).
    """
    try:
        document = canonical_description(url, storage_options)
    except CheckpointError as exc:
        if not canonical or exc.requirement is None:
            raise  # reports_errors: "ckpt: error [code]: ...", exit 1 or 2
        click.echo(refusal_line(exc), err=True)
        sys.exit(FAILED)
    if canonical:
        click.echo(canonical_json(document).decode("utf-8"))
    else:
        emit_json(document)
