"""``ckpt ls RUN_URL``: the checkpoints under a run directory, newest first."""

from __future__ import annotations

import stat
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import click

from ckptfmt.convert.base import Location, fs_call, locate
from ckptfmt.errors import UsageError
from ckptfmt.paths import MANIFEST_NAME
from ckptfmt.run import RunDirectory
from ckptfmt.storage.local import kind_of, lstat_children, walk_lstat

from .errors import reports_errors
from .options import json_output, storage_options
from .output import emit_json, human_bytes, info, table

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


def _find(run: Location) -> dict[str, Mapping[str, Any]]:
    """Every file below the run directory -> fsspec-style detail; on a local disk walked following no
    symlink (fsspec's find descends into symlinked directories)."""
    if not run.is_local:
        found: dict[str, Mapping[str, Any]] = fs_call(run.url, run.fs.find, run.path, detail=True, withdirs=False)
        return found
    prefix = run.path.rstrip("/") + "/"
    return {prefix + rel: {"mtime": st.st_mtime, "size": st.st_size} for rel, st in walk_lstat(run.path).items()}


def strays(run_url: str, opts: dict[str, Any]) -> list[str]:
    """Children of a local run directory that are symlinks or special files: never followed, listed or
    deleted; named so that an operator knows they were seen."""
    run = locate(run_url, opts)
    if not run.is_local:
        return []
    return [
        f"{name} ({kind_of(st.st_mode)})"
        for name, st in sorted(lstat_children(run.path))
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode))
    ]


def check_run_dir(run_url: str, opts: dict[str, Any]) -> tuple[Location, dict[str, Mapping[str, Any]]]:
    """The run directory's location and its files (fsspec detail); refuses what is not a run directory."""
    run = locate(run_url, opts)
    if not fs_call(run.url, run.fs.isdir, run.path):
        raise UsageError("not a directory", path=run.url)
    found = _find(run)
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
    for full, detail in found.items():
        name, sep, _ = str(full)[len(prefix) :].partition("/")
        stamp = _mtime(detail)
        if sep and stamp is not None:
            newest[name] = max(stamp, newest.get(name, stamp))
    entries = []
    for e in RunDirectory(run_url, opts).entries():
        if e.foreign and e.status != "committed":
            info(f"{e.name}: {len(e.foreign)} file(s) no ckptfmt writer made (e.g. {e.foreign[0]}); gc leaves it alone")
        created = e.created if _timestamp(e.created) is not None else _iso(newest.get(e.name))
        entries.append(
            {
                "name": e.name,
                "url": run.join(e.name).url,
                "step": e.step,
                "created": created,
                "size": e.size,
                "referenced_bytes": e.referenced_bytes,
                "bases": list(e.bases),
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

    Each has a name, step (provenance, else the trailing number of its name), created time, size
    (its own files), and status: committed, writing (no manifest yet, its writer is alive), incomplete
    (no manifest, its writer is gone), or invalid manifest. When some checkpoint is incremental, the
    table adds the bytes each references in other checkpoints and which (its bases). The same rules as
    ``ckpt gc``.
    """
    entries = list_run(run_url, storage_options)
    for stray in strays(run_url, storage_options):
        info(f"skipped {stray}: symlinks and special files in a run directory are never followed")
    restore = RunDirectory(run_url, storage_options).last_restore()
    if as_json:
        emit_json({"url": run_url, "checkpoints": entries, "last_restore": restore})
        return
    rows = [[e["name"], e["step"], e["created"], human_bytes(e["size"]), e["status"]] for e in entries]
    headers = ["NAME", "STEP", "CREATED", "SIZE", "STATUS"]
    if any(e["bases"] for e in entries):  # incremental checkpoints: what each stores vs reads from its bases
        headers[4:4] = ["REFERENCED"]
        headers.append("BASES")
        for row, e in zip(rows, entries, strict=True):
            row[4:4] = [human_bytes(e["referenced_bytes"]) if e["referenced_bytes"] else "-"]
            row.append(",".join(e["bases"]) or "-")
    click.echo(table(headers, rows))
    if restore is not None:
        click.echo("\n" + "\n".join(describe_restore(restore)))


def describe_restore(report: Mapping[str, Any]) -> list[str]:
    """The last restore's report (``last-restore.json``) in a few lines: what it took, from where, what memory held."""
    listed = report.get("ranks")
    ranks: list[Any] = listed if isinstance(listed, list) else []
    tiers = sorted({str(r.get("tier")) for r in ranks if isinstance(r, Mapping)}) or [str(report.get("tier"))]
    given = report.get("phases")
    order = ("agree", "gather", "read", "apply")
    phases = (
        {k: given[k] for k in sorted(given, key=lambda k: (k not in order, order.index(k) if k in order else 0, k))}
        if isinstance(given, Mapping)
        else {}
    )
    lines = [
        f"last restore: step {report.get('step')} from {'+'.join(tiers)} on {len(ranks) or 1} rank(s), "
        f"{human_bytes(int(report.get('bytes_between_nodes') or 0))} between nodes, "
        f"{float(report.get('seconds') or 0.0):.3f} s"
        + (f" ({', '.join(f'{k} {float(v):.3f} s' for k, v in phases.items())})" if phases else "")
    ]
    for skipped in report.get("skipped") or []:
        lines.append(f"  passed over: {skipped}")
    held = [h for h in report.get("held") or [] if isinstance(h, Mapping)]
    if held:
        lines.append("  memory held (complete checkpoints):")
        for h in sorted(held, key=lambda h: (-int(h.get("step") or 0), str(h.get("node")), str(h.get("kind")))):
            lines.append(
                f"    step {h.get('step')}: node {h.get('node')} {h.get('kind')}, {h.get('files')} file(s), "
                f"{human_bytes(int(h.get('bytes') or 0))}"
            )
    return lines
