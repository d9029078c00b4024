"""Describing a checkpoint as plain data: what ``ckpt inspect`` prints (and ``--json`` shows as is)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import ckptfmt
from ckptfmt.errors import CheckpointError
from ckptfmt.jsonio import load_json
from ckptfmt.lock import MAX_LOCK_BYTES
from ckptfmt.paths import LOCK_NAME

from .output import jsonable


def _get(value: Mapping[str, object], *keys: str) -> object:
    node: object = value
    for key in keys:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def summarize_context(field: str, value: Mapping[str, object]) -> dict[str, Any]:
    """The few facts an operator wants from a standard context field; other fields: their keys."""
    if field == "rng":
        generators = value.get("generators")
        gens = generators if isinstance(generators, Mapping) else {}
        return {"generators": {str(n): _get(g, "kind") for n, g in gens.items() if isinstance(g, Mapping)}}
    if field == "data":
        keep = ("epoch", "global_sample_offset", "dataset", "sampler")
        out: dict[str, Any] = {k: jsonable(value[k]) for k in keep if k in value}
        offsets = value.get("shard_offsets")
        if isinstance(offsets, (Mapping, list)):
            out["shards"] = len(offsets)
        if "quarantined_shards" in value:
            out["quarantined_shards"] = jsonable(value["quarantined_shards"])
        if "quarantine" in value:  # the record as stored (NaN and infinities as strings); a reader does not check it
            out["quarantine"] = jsonable(value["quarantine"])
        return out
    if field == "topology":
        shown = ("world_size", "rank", "mesh", "device_kinds", "regions")
        return {k: jsonable(value[k]) for k in shown if k in value}
    if field == "config":
        config = value.get("config")
        return {"hash": value.get("hash"), "keys": sorted(config) if isinstance(config, Mapping) else []}
    if field == "provenance":
        return {str(k): jsonable(v) for k, v in value.items()}
    return {"keys": sorted(str(k) for k in value)}


def summarize(ckpt: ckptfmt.Checkpoint, *, tensor_glob: str | None) -> tuple[dict[str, Any], bool]:
    """(the document, whether every context blob could be read)."""
    manifest = ckpt.manifest
    sizes = {f.path: f.size for f in manifest.files}
    fields: dict[str, Any] = {}
    contexts: dict[str, Any] = {}
    all_read = True
    for name, record in manifest.fields.items():
        paths = {c.path for t in record.tensors.values() for c in t.chunks if c.base is None}
        if record.context is not None:
            paths.add(record.context)
        referenced = [c for t in record.tensors.values() for c in t.chunks if c.base is not None]
        fields[name] = {
            "kind": record.kind,
            "files": len(paths),
            "bytes": sum(sizes[p] for p in paths),
            "referenced_bytes": sum(c.nbytes for c in referenced),  # stored in a base (spec/references.md)
            "tensors": len(record.tensors),
            "dtypes": sorted({t.dtype for t in record.tensors.values()}),
            "context": record.context is not None,
        }
        if record.context is not None:
            try:
                contexts[name] = summarize_context(name, ckpt.read_context(name))
            except CheckpointError as exc:
                contexts[name] = {"error": exc.to_dict()}
                all_read = False
    provenance = contexts.get("provenance", {})
    doc: dict[str, Any] = {
        "url": ckpt.url,
        "status": "committed",
        "checkpoint_id": ckpt.id,
        "format_version": ckpt.format_version,
        "profile": ckpt.profile,
        "step": provenance.get("step"),
        "created_at": provenance.get("created_at"),
        "code_commit": _get(provenance, "code", "commit"),
        "metadata": dict(manifest.metadata),
        "total_bytes": manifest.total_bytes,
        "file_count": len(manifest.files),
        "referenced_bytes": manifest.referenced_bytes,
        "bases": [
            {"location": b.location, "checkpoint_id": b.checkpoint_id, "files": len(b.files)} for b in manifest.bases
        ],
        "fields": fields,
        "context": contexts,
    }
    if tensor_glob is not None:
        doc["tensors"] = [
            {
                "field": fname,
                "name": tname,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "chunks": len(t.chunks),
            }
            for fname, record in manifest.fields.items()
            for tname, t in record.tensors.items()
            if fnmatch.fnmatchcase(tname, tensor_glob) or fnmatch.fnmatchcase(f"{fname}/{tname}", tensor_glob)
        ]
    return doc, all_read


def summarize_incomplete(url: str, storage_options: Mapping[str, Any], message: str) -> dict[str, Any]:
    """What is at a root that no manifest commits: its files and the writer lock, if any."""
    store = ckptfmt.open_store(url, storage_options)
    files = store.list()
    lock: object = None
    if LOCK_NAME in files:
        try:  # shown as it is; bounded and strict, a symlink or special file refused
            data = store.read(LOCK_NAME, max_size=MAX_LOCK_BYTES)
            lock = load_json(data, error=CheckpointError, what="writer lock", path=LOCK_NAME)
        except CheckpointError:
            lock = {"error": "unreadable"}
    return {
        "url": store.url,
        "status": "incomplete",
        "message": message,
        "total_bytes": sum(files.values()),
        "files": [{"path": p, "size": s} for p, s in sorted(files.items())],
        "writer_lock": lock,
    }
