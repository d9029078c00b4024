"""``ckpt materialize SRC DST``: a self-contained copy of a checkpoint that references chunks of others."""

from __future__ import annotations

from typing import Any

import click

from ckptfmt.materialize import materialize_checkpoint

from .errors import reports_errors
from .options import json_output, quiet, storage_options
from .output import ProgressBar, emit_json, human_bytes


@click.command("materialize")
@click.argument("src")
@click.argument("dst")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint already at DST.")
@storage_options
@json_output
@quiet
@reports_errors
def materialize_cmd(
    src: str, dst: str, overwrite: bool, storage_options: dict[str, Any], as_json: bool, quiet: bool
) -> None:
    """Copy the checkpoint SRC to DST with every chunk it references in another checkpoint (an
    incremental checkpoint's base) stored in the copy, so that DST outlives those checkpoints.

    Files are copied byte for byte and checked (size, header, digest) on the way; DST is committed
    as a save is. A checkpoint that references nothing is copied as it is.
    """
    with ProgressBar("materialize", quiet=quiet) as bar:
        done = materialize_checkpoint(src, dst, storage_options=storage_options, overwrite=overwrite, progress=bar)
    if as_json:
        emit_json({"source": src, "destination": dst, **done.to_dict()})
        return
    click.echo(
        f"{src} -> {dst}: {done.files} file(s), {human_bytes(done.bytes)}, of which "
        f"{len(done.copied_from_bases)} file(s), {human_bytes(done.bytes_from_bases)} from its bases"
    )
    click.echo(f"checkpoint id {done.checkpoint_id}")
