"""``ckpt ls RUN_URL``: the checkpoints under a run directory, newest first."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import click

from ckptfmt.errors import CheckpointError, UsageError
from ckptfmt.manifest_io import read_manifest_bytes
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.paths import MANIFEST_NAME
from ckptfmt.run import RunDirectory
from ckptfmt.storage import FileInfo, open_store
from ckptfmt.tier.binding import SlotBinding
from ckptfmt.tier.placement_record import PLACEMENT_NAME, PlacementRecord

from .errors import reports_errors
from .options import json_output, storage_options
from .output import emit_json, human_bytes, info, table


def _timestamp(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def shown_url(run_url: str) -> str:
    """The run directory as reports name it: a local path made absolute, a URL as given."""
    return run_url if "://" in run_url else os.path.abspath(run_url)


def strays(files: Mapping[str, FileInfo]) -> list[str]:
    """Children of a run directory (its listing, ``Store.list_detail``) that are symlinks or special files:
    never followed, listed or deleted; named so that an operator knows they were seen (local disks only)."""
    return [f"{name} ({f.kind})" for name, f in sorted(files.items()) if "/" not in name and f.kind is not None]


def check_run_dir(run: RunDirectory) -> dict[str, FileInfo]:
    """The run directory's files (``Store.list_detail``); refuses what is not a run directory."""
    if not run.store.is_directory():
        raise UsageError("not a directory", path=shown_url(run.url))
    files = run.store.list_detail()
    if MANIFEST_NAME in files:
        raise UsageError("this is a checkpoint, not a run directory; use `ckpt inspect`", path=shown_url(run.url))
    return files


def list_run(run: RunDirectory, files: Mapping[str, FileInfo]) -> list[dict[str, Any]]:
    """The run's checkpoints as ``ckpt ls --json`` shows them.

    Which children are checkpoints, their status and step come from :class:`ckptfmt.run.RunDirectory`,
    the rules ``ckpt gc`` and the trainer's CheckpointManager apply; ``created`` falls back to the
    newest modification time of a checkpoint's files.
    """
    newest: dict[str, float] = {}
    for path, detail in files.items():
        name, sep, _ = path.partition("/")
        if sep and detail.mtime is not None:
            newest[name] = max(detail.mtime, newest.get(name, detail.mtime))
    entries = []
    for e in run.entries():
        if e.foreign and e.status != "committed":
            info(f"{e.name}: {len(e.foreign)} file(s) no ckptfmt writer made (e.g. {e.foreign[0]}); gc leaves it alone")
        created = e.created if _timestamp(e.created) is not None else _iso(newest.get(e.name))
        entries.append(
            {
                "name": e.name,
                "url": f"{shown_url(run.url).rstrip('/')}/{e.name}",
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
    run = RunDirectory(run_url, storage_options)
    files = check_run_dir(run)
    entries = list_run(run, files)
    for stray in strays(files):
        info(f"skipped {stray}: symlinks and special files in a run directory are never followed")
    restore = run.last_restore()
    replicas = replica_holders(run, entries)
    if as_json:
        emit_json({"url": run_url, "checkpoints": entries, "last_restore": restore, "replicas": replicas})
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
    if replicas is not None:
        click.echo("\n" + "\n".join(describe_replicas(replicas)))
    if restore is not None:
        click.echo("\n" + "\n".join(describe_restore(restore)))


def replica_holders(run: RunDirectory, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For the newest committed snapshot of the run (a checkpoint written by the memory tier), which failure domains
    hold each rank's files: its own node's, and those of its copies (the recorded placement, recomputed from the
    snapshot's nodes). None without a placement record or such a checkpoint."""
    data = run.placement()
    if data is None:
        return None
    try:
        record = PlacementRecord.from_dict(data)
    except CheckpointError as exc:
        info(f"{PLACEMENT_NAME}: {exc}")
        return None
    for entry in entries:
        if entry["status"] != "committed":
            continue
        try:
            manifest = parse_manifest(
                read_manifest_bytes(open_store(run.child_url(entry["name"]), run.storage_options))
            )
            nodes = SlotBinding.from_metadata(manifest.metadata).nodes
        except CheckpointError:
            continue  # not a memory snapshot's copy (a direct save): no node of its ranks is known
        if nodes:
            return {
                "checkpoint": entry["name"],
                "step": entry["step"],
                "replicas": record.replicas,
                "ranks": record.holders(nodes),
            }
    return None


def describe_replicas(replicas: Mapping[str, Any]) -> list[str]:
    lines = [f"replicas ({replicas['replicas']} a rank) of {replicas['checkpoint']}, by failure domain:"]
    for r in replicas["ranks"]:
        copies = ", ".join(r["copies"]) or "none"
        lines.append(f"  rank {r['rank']}: {r['domain']} (node {r['node']}); copies in {copies}")
    return lines


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
            if "ranks" in h:  # what each node holds whole, as ranges of writer ranks (issue 42's summaries)
                lines.append(f"    step {h.get('step')}: node {h.get('node')} writer ranks {_ranges(h.get('ranks'))}")
                continue
            lines.append(
                f"    step {h.get('step')}: node {h.get('node')} {h.get('kind')}, {h.get('files')} file(s), "
                f"{human_bytes(int(h.get('bytes') or 0))}"
            )
    return lines


def _ranges(value: object) -> str:
    """``[[-1, 4], [6, 7]]`` as ``unnamed files, 0-3, 6`` (-1: the files no rank's name claims)."""
    if not isinstance(value, list):
        return "?"
    parts = []
    for item in value:
        if isinstance(item, list) and len(item) == 2 and all(isinstance(x, int) for x in item):
            start, stop = item
            if start < 0:
                parts.append("unnamed files")
                start = 0
            if start < stop:
                parts.append(str(start) if stop == start + 1 else f"{start}-{stop - 1}")
    return ", ".join(parts) or "none"
