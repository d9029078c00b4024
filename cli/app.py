"""The click group; each subcommand lives in its own module, imported only when it runs (or when help lists it),
so ``ckpt verify`` starts without loading the converters, the diff engine or the memory tier."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import click

from ckptfmt import __version__

# name -> (module of cli, the click command in it), in the order help lists them
COMMANDS = {
    "inspect": ("inspect", "inspect_cmd"),
    "verify": ("verify", "verify_cmd"),
    "ls": ("ls", "ls_cmd"),
    "diff": ("diff", "diff_cmd"),
    "convert": ("convert", "convert_cmd"),
    "materialize": ("materialize", "materialize_cmd"),
    "dump": ("dump", "dump_cmd"),
    "gc": ("gc", "gc_cmd"),
    "rescue": ("rescue", "rescue_cmd"),
    "conformance": ("conformance", "conformance_cmd"),
}


class _Commands(Mapping[str, click.Command]):
    """The subcommands by name, each module imported on first access."""

    def __getitem__(self, name: str) -> click.Command:
        module, attribute = COMMANDS[name]
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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli() -> None:
    """Inspect, verify, list, diff, convert, collect and rescue ckptfmt checkpoints (local paths or fsspec URLs)."""
