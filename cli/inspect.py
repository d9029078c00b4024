"""``ckpt inspect URL``: what is in a checkpoint (or, for an incomplete one, what is there)."""

from __future__ import annotations

from typing import Any

import click

import ckptfmt
from ckptfmt.errors import IncompleteCheckpointError

from .errors import FAILED, OK, reports_errors
from .options import json_output, storage_options
from .output import emit_json, human_bytes, table
from .summary import summarize, summarize_incomplete


def _render(doc: dict[str, Any]) -> str:
    lines = [
        f"checkpoint   {doc['url']}",
        f"id           {doc['checkpoint_id']}",
        f"format       ckptfmt {doc['format_version']}, profile {doc['profile']}",
        f"step         {doc['step'] if doc['step'] is not None else '-'}",
        f"created      {doc['created_at'] or '-'}",
        f"code commit  {doc['code_commit'] or '-'}",
        f"size         {human_bytes(doc['total_bytes'])} in {doc['file_count']} files",
    ]
    if doc["bases"]:
        lines.append(f"referenced   {human_bytes(doc['referenced_bytes'])} stored in its bases:")
        lines += [f"base         {b['location']} ({b['checkpoint_id']})" for b in doc["bases"]]
    lines += [f"metadata     {k} = {v}" for k, v in doc["metadata"].items()]
    referencing = bool(doc["bases"])
    rows = [
        [name, f["kind"], f["files"], human_bytes(f["bytes"])]
        + ([human_bytes(f["referenced_bytes"])] if referencing else [])
        + [f["tensors"], ",".join(f["dtypes"]) or "-"]
        for name, f in doc["fields"].items()
    ]
    header = ["FIELD", "KIND", "FILES", "BYTES", *(["REFERENCED"] if referencing else []), "TENSORS", "DTYPES"]
    lines += ["", table(header, rows)]
    if doc["context"]:
        lines.append("")
        for name, summary in doc["context"].items():
            if "error" in summary:
                text = f"UNREADABLE [{summary['error']['code']}] {summary['error']['message']}"
            else:
                shown = {k: v for k, v in summary.items() if not (name == "data" and k == "quarantine")}
                text = ", ".join(f"{k}={_short(v)}" for k, v in shown.items()) or "(empty)"
            lines.append(f"{name + ':':12} {text}")
            record = summary.get("quarantine") if name == "data" else None
            if isinstance(record, list):
                lines += [f"{'quarantine':12} {_quarantine_entry(entry)}" for entry in record]
    if "tensors" in doc:
        rows = [
            [t["field"], t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", t["bytes"], t["chunks"]]
            for t in doc["tensors"]
        ]
        lines += ["", table(["FIELD", "TENSOR", "DTYPE", "SHAPE", "BYTES", "CHUNKS"], rows)]
    return "\n".join(lines)


SAMPLES_SHOWN = 8  # a window of rolled-back steps can quarantine thousands of samples: --json has them all


def _quarantine_entry(entry: object) -> str:
    """One entry of the data field's quarantine record on a line: step, reason, what, values."""
    if not isinstance(entry, dict):
        return _short(entry)
    parts = [f"step {_short(entry.get('step'))}", _short(entry.get("reason"))]
    if entry.get("shard") is not None:
        parts.append(f"shard {_short(entry['shard'])}")
    samples = entry.get("samples")
    if isinstance(samples, list) and samples:
        more = f", … ({len(samples)} in all)" if len(samples) > SAMPLES_SHOWN else ""
        parts.append(f"samples {', '.join(map(_short, samples[:SAMPLES_SHOWN]))}{more}")
    values = entry.get("values")
    if isinstance(values, dict) and values:
        parts.append(" ".join(f"{k}={_short(v)}" for k, v in values.items()))
    return "  ".join(parts)


def _short(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def _render_incomplete(doc: dict[str, Any]) -> str:
    lines = [
        f"INCOMPLETE   {doc['url']}",
        f"             {doc['message']}",
        f"             {len(doc['files'])} files, {human_bytes(doc['total_bytes'])}; no manifest.json",
    ]
    lock = doc["writer_lock"]
    if isinstance(lock, dict) and "pid" in lock:
        lines.append(f"writer lock  pid {lock.get('pid')} on {lock.get('host')} since {lock.get('started_at')}")
    rows = [[f["path"], f["size"]] for f in doc["files"]]
    return "\n".join([*lines, "", table(["FILE", "BYTES"], rows)])


@click.command("inspect")
@click.argument("url")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor: dtype, shape, bytes, chunks.")
@click.option(
    "--match", "pattern", metavar="GLOB", help="Only tensors whose NAME or FIELD/NAME matches (implies --tensors)."
)
@storage_options
@json_output
@reports_errors
def inspect_cmd(
    url: str, show_tensors: bool, pattern: str | None, storage_options: dict[str, Any], as_json: bool
) -> None:
    """Summarize the checkpoint at URL: version, profile, fields, context, and optionally tensors.

    Exit 0 when shown, 1 when the checkpoint is incomplete, invalid or a context blob is unreadable.
    """
    glob = pattern if pattern is not None else ("*" if show_tensors else None)
    try:
        ckpt = ckptfmt.open(url, storage_options)
    except IncompleteCheckpointError as exc:
        doc = summarize_incomplete(url, storage_options, exc.message)
        emit_json(doc) if as_json else click.echo(_render_incomplete(doc))
        raise SystemExit(FAILED) from None
    with ckpt:
        doc, all_read = summarize(ckpt, tensor_glob=glob)
    emit_json(doc) if as_json else click.echo(_render(doc))
    raise SystemExit(OK if all_read else FAILED)
