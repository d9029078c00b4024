"""The ``ckpt`` command: inspect, verify, list, diff and convert checkpoints."""

from __future__ import annotations

from .app import cli


def main() -> None:
    cli()


__all__ = ["cli", "main"]
