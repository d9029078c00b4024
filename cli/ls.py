"""``ckpt ls RUN_URL``: the checkpoints under a run directory, newest first."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import click

import ckptfmt
from ckptfmt.convert.base import Location, fs_call, locate
from ckptfmt.errors import CheckpointError, ManifestError, UsageError
from ckptfmt.paths import LOCK_NAME, MANIFEST_NAME

from .errors import reports_errors
from .options import json_output, storage_options
from .output import emit_json, human_bytes, table

# A file the reference writer puts in a checkpoint: how an uncommitted one is told from any other directory.
_LAYOUT = re.compile(r"[a-z][a-z0-9_]{0,63}/(\.?r\d{5}-\d{5}\.safetensors(\.tmp-[0-9a-f]+)?|\.?context\.msgpack.*)")
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def _mtime(info: Mapping[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
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


def _entry(child: Location, name: str, files: dict[str, Mapping[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    newest = max((t for t in (_mtime(i) for i in files.values()) if t is not None), default=None)
    match = _TRAILING_NUMBER.search(name)
    entry: dict[str, Any] = {
        "name": name,
        "url": child.url,
        "step": int(match.group(1)) if match else None,
        "created": _iso(newest),
        "size": sum(int(i.get("size") or 0) for i in files.values()),
        "status": "incomplete",
        "checkpoint_id": None,
        "profile": None,
        "error": None,
    }
    if MANIFEST_NAME not in files:
        return entry
    try:
        with ckptfmt.open(child.url, opts) as ckpt:
            entry.update(status="committed", checkpoint_id=ckpt.id, profile=ckpt.profile)
            if "provenance" in ckpt.fields:
                provenance = ckpt.read_context("provenance")
                if type(provenance.get("step")) is int:
                    entry["step"] = provenance["step"]
                if _timestamp(provenance.get("created_at")) is not None:
                    entry["created"] = provenance["created_at"]
    except ManifestError as exc:
        entry.update(status="invalid manifest", error=exc.to_dict())
    except CheckpointError as exc:
        entry["error"] = exc.to_dict()  # committed, but its provenance could not be read
    return entry


def list_run(run_url: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    run = locate(run_url, opts)
    if not fs_call(run.url, run.fs.isdir, run.path):
        raise UsageError("not a directory", path=run.url)
    found = fs_call(run.url, run.fs.find, run.path, detail=True, withdirs=False)
    prefix = run.path.rstrip("/") + "/"
    if MANIFEST_NAME in {str(n)[len(prefix) :] for n in found}:
        raise UsageError("this is a checkpoint, not a run directory; use `ckpt inspect`", path=run.url)
    children: dict[str, dict[str, Mapping[str, Any]]] = {}
    for full, info in found.items():
        rel = str(full)[len(prefix) :]
        name, sep, inner = rel.partition("/")
        if sep and not name.startswith("."):
            children.setdefault(name, {})[inner] = info
    entries = []
    for name, files in children.items():
        if MANIFEST_NAME in files or LOCK_NAME in files or any(_LAYOUT.fullmatch(p) for p in files):
            entries.append(_entry(run.join(name), name, files, opts))
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
    and status: committed, incomplete (files but no manifest), or invalid manifest.
    """
    entries = list_run(run_url, storage_options)
    if as_json:
        emit_json({"url": run_url, "checkpoints": entries})
        return
    rows = [[e["name"], e["step"], e["created"], human_bytes(e["size"]), e["status"]] for e in entries]
    click.echo(table(["NAME", "STEP", "CREATED", "SIZE", "STATUS"], rows))
