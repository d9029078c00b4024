"""The click group; each subcommand lives in its own module and registers here."""

from __future__ import annotations

import click

import ckptfmt


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ckptfmt.__version__, prog_name="ckpt")
def cli() -> None:
    """Inspect, verify, list, diff, convert, collect and rescue ckptfmt checkpoints (local paths or fsspec URLs)."""


from .conformance import conformance_cmd  # noqa: E402
from .convert import convert_cmd  # noqa: E402
from .diff import diff_cmd  # noqa: E402
from .dump import dump_cmd  # noqa: E402
from .gc import gc_cmd  # noqa: E402
from .inspect import inspect_cmd  # noqa: E402
from .ls import ls_cmd  # noqa: E402
from .rescue import rescue_cmd  # noqa: E402
from .verify import verify_cmd  # noqa: E402

cli.add_command(inspect_cmd)
cli.add_command(verify_cmd)
cli.add_command(ls_cmd)
cli.add_command(diff_cmd)
cli.add_command(convert_cmd)
cli.add_command(dump_cmd)
cli.add_command(gc_cmd)
cli.add_command(rescue_cmd)
cli.add_command(conformance_cmd)
