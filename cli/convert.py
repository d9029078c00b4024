"""``ckpt convert SRC DST --to FORMAT``: between ckptfmt and Hugging Face, PyTorch, DCP and trainer checkpoints."""

from __future__ import annotations

from typing import Any

import click

from ckptfmt.convert import ALIASES, FORMATS, convert, parse_size

from .errors import reports_errors
from .options import json_output, quiet, storage_options
from .output import ProgressBar, emit_json, human_bytes, info

_CHOICES = click.Choice([*FORMATS, *ALIASES], case_sensitive=False)


@click.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--to", "to", required=True, type=_CHOICES, help="Format to write (any but pt).")
@click.option("--from", "source_format", type=_CHOICES, help="Format of SRC (detected when omitted).")
@click.option("--max-shard-size", metavar="SIZE", help="hf: largest shard, e.g. 5GB (default), 500MB, 2GiB.")
@click.option("--target-file-size", metavar="SIZE", help="ckptfmt: data file target size (default 1GiB).")
@click.option("--field", default="weights", show_default=True, help="hf/dcp: the tensor field to export.")
@click.option(
    "--codec",
    metavar="CODEC",
    help="ckptfmt to ckptfmt: re-encode the chunks with raw, zstd or zstd:LEVEL (lossless; see spec/codecs.md).",
)
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint already at DST.")
@storage_options
@json_output
@quiet
@reports_errors
def convert_cmd(
    src: str,
    dst: str,
    to: str,
    source_format: str | None,
    max_shard_size: str | None,
    target_file_size: str | None,
    field: str,
    codec: str | None,
    overwrite: bool,
    storage_options: dict[str, Any],
    as_json: bool,
    quiet: bool,
) -> None:
    """Convert SRC into format --to at DST; one side is always ckptfmt.

    \b
    Formats: ckptfmt (re-encode), hf (safetensors, single or sharded with
    model.safetensors.index.json), pt (.pt/.bin/.pth state dicts, import only,
    weights_only loading), dcp (PyTorch Distributed Checkpoint; .metadata read
    with a restricted unpickler), hf-trainer (a Trainer checkpoint-N/ directory;
    training_args.bin is never unpickled), lightning (a .ckpt file, weights_only),
    accelerate (a save_state directory). Trainer formats import into
    the training profile; the notes say which fields the source lacked.
    """
    with ProgressBar("convert", quiet=quiet) as bar:
        result = convert(
            src,
            dst,
            to=to,
            source_format=source_format,
            storage_options=storage_options,
            overwrite=overwrite,
            target_file_size=parse_size(target_file_size) if target_file_size else None,
            max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
            field=field,
            progress=bar,
            codec=codec,
        )
    for note in result.notes:
        info(f"ckpt: note: {note}")
    if as_json:
        emit_json(result.to_dict())
        return
    click.echo(
        f"{result.source_format} {result.source} -> {result.destination_format} {result.destination}: "
        f"{result.tensors} tensors, {human_bytes(result.bytes)}"
    )
    if result.checkpoint_id:
        click.echo(f"checkpoint id {result.checkpoint_id}")
