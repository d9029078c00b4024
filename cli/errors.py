"""Turning ckptfmt errors into a clear stderr line, a JSON error object (--json), and the exit code.

Exit codes: 0 ok; 1 a check failed (invalid, incomplete, corrupt, different); 2 usage or I/O error
(bad arguments, nothing at the URL, storage failure, destination exists).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ckptfmt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    FieldNotFoundError,
    StorageError,
    UsageError,
)

from .output import emit_json

OK = 0
FAILED = 1
USAGE = 2

_USAGE_ERRORS = (UsageError, StorageError, CheckpointNotFoundError, CheckpointExistsError, FieldNotFoundError)

F = TypeVar("F", bound=Callable[..., Any])


def exit_code_for(exc: CheckpointError) -> int:
    return USAGE if isinstance(exc, _USAGE_ERRORS) else FAILED


def error_document(exc: CheckpointError) -> dict[str, Any]:
    return {"error": {**exc.to_dict(), "exit_code": exit_code_for(exc)}}


def fail(exc: CheckpointError, *, as_json: bool) -> None:
    """Report ``exc`` (stderr, and stdout as JSON when asked) and exit with its code."""
    if as_json:
        emit_json(error_document(exc))
    click.echo(f"ckpt: error [{exc.code}]: {exc}", err=True)
    sys.exit(exit_code_for(exc))


def reports_errors(func: F) -> F:
    """Wrap a command so that any CheckpointError (or stray OSError) ends it cleanly."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return func(*args, **kwargs)
        except CheckpointError as exc:
            fail(exc, as_json=as_json)
        except OSError as exc:
            error = StorageError(f"{type(exc).__name__}: {exc}")
            error.__cause__ = exc
            fail(error, as_json=as_json)
        return None

    return wrapper  # type: ignore[return-value]
