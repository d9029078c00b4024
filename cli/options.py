"""Options shared by the subcommands, as decorators, so every command spells them the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def _parse_storage_options(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    """KEY=VALUE pairs; a VALUE that parses as JSON (true, 3, {"a": 1}) is taken as that value, else as text."""
    out: dict[str, Any] = {}
    for item in values:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", ctx=ctx, param=param)
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def storage_options(func: F) -> F:
    return click.option(
        "--storage-option",
        "storage_options",
        multiple=True,
        metavar="KEY=VALUE",
        callback=_parse_storage_options,
        help="Option for the fsspec backend (repeatable), e.g. anon=true or endpoint_url=http://...; "
        "VALUE is read as JSON when it parses, else as text.",
    )(func)


def json_output(func: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print one JSON document on stdout (shapes in docs/cli.md)."
    )(func)


def quiet(func: F) -> F:
    return click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr.")(func)
