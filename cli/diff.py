"""``ckpt diff A B``: what changed between two checkpoints; exit 0 identical, 1 different or corrupt."""

from __future__ import annotations

from typing import Any

import click

import ckptfmt

from .checkpoint_diff import Compared, diff_checkpoints
from .errors import FAILED, OK, reports_errors
from .options import json_output, storage_options
from .output import emit_json

DIGESTS_ONLY_NOTE = "chunk digests compared, bytes not read: run `ckpt verify` on both to prove the data is intact"


def _render(doc: dict[str, Any]) -> str:
    note = [f"note: {DIGESTS_ONLY_NOTE}"] if doc["compared"] == "digests" else []
    if doc["identical"]:
        how = "manifests and digests agree (bytes not read)" if doc["compared"] == "digests" else "bytes compared"
        return "\n".join([f"identical ({how}): {doc['a']} and {doc['b']}", *note])
    lines = [f"--- {doc['a']}", f"+++ {doc['b']}", *note]
    for p in doc["problems"]:
        where = ", ".join(f"{k} {p[k]!r}" for k in ("path", "field", "tensor") if k in p)
        lines.append(f"! corrupt {p['side']} ({p['url']}): [{p['code']}] {where}: {p['message']}")
    lines += [f"+ field {n}" for n in doc["fields"]["added"]]
    lines += [f"- field {n}" for n in doc["fields"]["removed"]]
    lines += [f"~ field {c['name']}: kind {c['kind'][0]} -> {c['kind'][1]}" for c in doc["fields"]["changed"]]
    lines += [f"+ tensor {t['field']}/{t['name']}" for t in doc["tensors"]["added"]]
    lines += [f"- tensor {t['field']}/{t['name']}" for t in doc["tensors"]["removed"]]
    for t in doc["tensors"]["changed"]:
        what = []
        if t["dtype"][0] != t["dtype"][1]:
            what.append(f"dtype {t['dtype'][0]} -> {t['dtype'][1]}")
        if t["shape"][0] != t["shape"][1]:
            what.append(f"shape {t['shape'][0]} -> {t['shape'][1]}")
        if t["different_elements"] is not None:
            what.append(f"{t['different_elements']} element(s) differ")
        if t["max_abs_diff"] is not None:
            what.append(f"max abs diff {t['max_abs_diff']:.6g}")
        if t["nonfinite_mismatches"]:
            what.append(f"{t['nonfinite_mismatches']} NaN/inf mismatch(es)")
        lines.append(f"~ tensor {t['field']}/{t['name']}: {', '.join(what)}")
    marks = {"added": "+", "removed": "-", "changed": "~"}
    lines += [f"{marks[c['change']]} context {c['field']}: {c['key']}" for c in doc["context"]]
    lines += [f"~ metadata {k}" for k in doc["metadata"]]
    if isinstance(doc["format_version"], list):
        lines.append(f"~ format_version {doc['format_version'][0]} -> {doc['format_version'][1]}")
    return "\n".join(lines)


@click.command("diff")
@click.argument("a")
@click.argument("b")
@click.option(
    "--ignore",
    multiple=True,
    metavar="GLOB",
    help="Leave out a FIELD, a tensor FIELD/NAME, a context key FIELD.KEY.PATH or metadata.KEY (repeatable), "
    "e.g. --ignore provenance.",
)
@click.option(
    "--digests-only",
    is_flag=True,
    help="Trust matching chunk digests without reading the bytes (fast; does not detect corrupt data).",
)
@storage_options
@json_output
@reports_errors
def diff_cmd(
    a: str, b: str, ignore: tuple[str, ...], digests_only: bool, storage_options: dict[str, Any], as_json: bool
) -> None:
    """Compare checkpoints A and B: fields, tensors (with max abs difference of floats), context keys.

    Every chunk of both sides is read and hashed against its digest, so corrupt data is reported
    (exit 1), never taken for equality. Exit 0 when identical, 1 when they differ or either is corrupt.
    """
    compared: Compared = "digests" if digests_only else "bytes"
    with ckptfmt.open(a, storage_options) as ca, ckptfmt.open(b, storage_options) as cb:
        doc = {"a": ca.url, "b": cb.url, **diff_checkpoints(ca, cb, ignore=ignore, compared=compared)}
    if compared == "digests":
        doc["note"] = DIGESTS_ONLY_NOTE
    if as_json:
        emit_json(doc)
    else:
        click.echo(_render(doc))
    raise SystemExit(OK if doc["identical"] else FAILED)
