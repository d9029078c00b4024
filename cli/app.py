"""The click group; each subcommand lives in its own module and registers here."""

from __future__ import annotations

import click

import ckptfmt


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ckptfmt.__version__, prog_name="ckpt")
def cli() -> None:
    """Inspect, verify, list, diff and convert ckptfmt checkpoints (local paths or fsspec URLs)."""
