"""docs/cli.md documents every registered command and every option of each."""

from __future__ import annotations

import re
from pathlib import Path

import click
from ckptfmt.cli import cli

DOC = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()


def test_every_command_has_a_section() -> None:
    assert cli.commands, "no commands registered"
    for name in cli.commands:
        assert re.search(rf"^## `ckpt {re.escape(name)}\b", DOC, re.MULTILINE), f"ckpt {name} is not documented"


def test_every_option_is_documented() -> None:
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option):
                for opt in param.opts:
                    if opt.startswith("--"):
                        assert f"`{opt}" in DOC, f"{opt} of ckpt {name} is not documented"


def test_json_examples_parse() -> None:
    import json

    for block in re.findall(r"```json\n(.*?)```", DOC, re.DOTALL):
        json.loads(block)
