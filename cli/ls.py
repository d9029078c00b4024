"""``ckpt ls RUN_URL``: the checkpoints under a run directory, newest first."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import click

from ckptfmt.convert.base import Location, fs_call, locate
from ckptfmt.errors import UsageError
from ckptfmt.paths import MANIFEST_NAME
from ckptfmt.run import RunDirectory

from .errors import reports_errors
from .options import json_output, storage_options
from .output import emit_json, human_bytes, table

_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "created")


def _mtime(info: Mapping[str, Any]) -> float | None:
    for key in _MTIME_KEYS:
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _timestamp(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def check_run_dir(run_url: str, opts: dict[str, Any]) -> tuple[Location, dict[str, Mapping[str, Any]]]:
    """The run directory's location and its files (fsspec detail); refuses what is not a run directory."""
    run = locate(run_url, opts)
    if not fs_call(run.url, run.fs.isdir, run.path):
        raise UsageError("not a directory", path=run.url)
    found = fs_call(run.url, run.fs.find, run.path, detail=True, withdirs=False)
    prefix = run.path.rstrip("/") + "/"
    if MANIFEST_NAME in {str(n)[len(prefix) :] for n in found}:
        raise UsageError("this is a checkpoint, not a run directory; use `ckpt inspect`", path=run.url)
    return run, found


def list_run(run_url: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's checkpoints as ``ckpt ls --json`` shows them.

    Which children are checkpoints, their status and step come from :class:`ckptfmt.run.RunDirectory`,
    the rules ``ckpt gc`` and the trainer's CheckpointManager apply; ``created`` falls back to the
    newest modification time of a checkpoint's files.
    """
    run, found = check_run_dir(run_url, opts)
    prefix = run.path.rstrip("/") + "/"
    newest: dict[str, float] = {}
    for full, info in found.items():
        name, sep, _ = str(full)[len(prefix) :].partition("/")
        stamp = _mtime(info)
        if sep and stamp is not None:
            newest[name] = max(stamp, newest.get(name, stamp))
    entries = []
    for e in RunDirectory(run_url, opts).entries():
        created = e.created if _timestamp(e.created) is not None else _iso(newest.get(e.name))
        entries.append(
            {
                "name": e.name,
                "url": run.join(e.name).url,
                "step": e.step,
                "created": created,
                "size": e.size,
                "status": e.status,
                "checkpoint_id": e.checkpoint_id,
                "profile": e.profile,
                "error": e.error,
            }
        )
    entries.sort(
        key=lambda e: (_timestamp(e["created"]) or 0.0, e["step"] if e["step"] is not None else -1, e["name"]),
        reverse=True,
    )
    return entries


@click.command("ls")
@click.argument("run_url")
@storage_options
@json_output
@reports_errors
def ls_cmd(run_url: str, storage_options: dict[str, Any], as_json: bool) -> None:
    """List the checkpoints under the run directory RUN_URL, newest first.

    Each has a name, step (provenance, else the trailing number of its name), created time, size,
    and status: committed, writing (no manifest yet, its writer is alive), incomplete (no manifest,
    its writer is gone), or invalid manifest. The same rules as ``ckpt gc``.
    """
    entries = list_run(run_url, storage_options)
    if as_json:
        emit_json({"url": run_url, "checkpoints": entries})
        return
    rows = [[e["name"], e["step"], e["created"], human_bytes(e["size"]), e["status"]] for e in entries]
    click.echo(table(["NAME", "STEP", "CREATED", "SIZE", "STATUS"], rows))
