"""The click group; each subcommand lives in its own module, imported only when it runs, so ``ckpt verify`` starts
without loading the converters, the diff engine or the memory tier, and ``ckpt --help`` without any of them."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import click

from ckptfmt import __version__

# name -> (module of cli, the click command in it, the first paragraph of its help), in the order help lists them.
# The summaries are here so that ``ckpt --help`` imports no command module (tests/test_cli_startup.py keeps each
# equal to its command's own help).
COMMANDS = {
    "inspect": (
        "inspect",
        "inspect_cmd",
        "Summarize the checkpoint at URL: version, profile, fields, context, and optionally tensors.",
    ),
    "verify": (
        "verify",
        "verify_cmd",
        "Check that the checkpoint at URL is whole and uncorrupted, re-hashing every byte (bounded memory).",
    ),
    "ls": ("ls", "ls_cmd", "List the checkpoints under the run directory RUN_URL, newest first."),
    "diff": (
        "diff",
        "diff_cmd",
        "Compare checkpoints A and B: fields, tensors (with max abs difference of floats), context keys.",
    ),
    "convert": ("convert", "convert_cmd", "Convert SRC into format --to at DST; one side is always ckptfmt."),
    "materialize": (
        "materialize",
        "materialize_cmd",
        "Copy the checkpoint SRC to DST with every chunk it references in another checkpoint (an incremental "
        "checkpoint's base) stored in the copy, so that DST outlives those checkpoints.",
    ),
    "dump": (
        "dump",
        "dump_cmd",
        "Verify the checkpoint at URL in full and print its content as the conformance suite's description.",
    ),
    "gc": ("gc", "gc_cmd", "Delete checkpoints of the run directory RUN_URL that retention no longer keeps."),
    "rescue": (
        "rescue",
        "rescue_cmd",
        "Persist the memory snapshots of RUN_URL found under MEMORY_DIR as ordinary checkpoints of RUN_URL.",
    ),
    "conformance": (
        "conformance",
        "conformance_cmd",
        "Run the conformance suite against any implementation's reader or writer adapter.",
    ),
}


class _Commands(Mapping[str, click.Command]):
    """The subcommands by name, each module imported on first access."""

    def __getitem__(self, name: str) -> click.Command:
        module, attribute, _ = COMMANDS[name]
        command: click.Command = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        return command

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class LazyGroup(click.Group):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands()  # type: ignore[assignment]

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands[cmd_name] if cmd_name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their summaries, as click lists them, from the table: no command module imported."""
        width = max(len(name) for name in COMMANDS)
        limit = formatter.width - 6 - width
        rows = [
            (name, click.Command(name, help=summary).get_short_help_str(limit))  # a stand-in: click's own shortening
            for name, (_, _, summary) in COMMANDS.items()
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli() -> None:
    """Inspect, verify, list, diff, convert, collect and rescue ckptfmt checkpoints (local paths or fsspec URLs)."""
