"""``ckpt dump URL``: the canonical description of a checkpoint's content (conformance/README.md).

This is the reference implementation's reader adapter for the conformance suite; the description
itself is computed by :mod:`ckptfmt.describe`.
"""

from __future__ import annotations

from typing import Any

import click

from ckptfmt.canonical import canonical_json
from ckptfmt.describe import describe

from .errors import reports_errors
from .options import storage_options
from .output import emit_json


@click.command("dump")
@click.argument("url")
@click.option("--canonical", is_flag=True, help="Print canonical JSON (one line, sorted keys) instead of indented.")
@storage_options
@reports_errors
def dump_cmd(url: str, canonical: bool, storage_options: dict[str, Any]) -> None:
    """Verify the checkpoint at URL in full and print its content as the conformance suite's description.

    Tensors appear as dtype, shape and the SHA-256 of their bytes; context values as JSON. Exit 0
    printed, 1 the checkpoint is refused (the error's code on stderr), 2 usage or I/O error.
    """
    document = describe(url, storage_options)
    if canonical:
        click.echo(canonical_json(document).decode("utf-8"))
    else:
        emit_json(document)
