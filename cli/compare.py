"""Comparing two checkpoints field by field, tensor by tensor, context key by context key.

Tensors with the same dtype, shape, chunking and chunk digests are equal without reading a byte
(same algorithm, same digest of the same bytes). Otherwise both are read in blocks of rows along
the first dimension, so memory stays at two blocks; float differences are computed in float64.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import ckptfmt
from ckptfmt import dtypes
from ckptfmt.manifest import TensorRecord

BLOCK_BYTES = 64 << 20
FLOAT_KINDS = "fc"


def _same_chunks(a: TensorRecord, b: TensorRecord) -> bool:
    key = [(c.offsets, c.shape, c.digest) for c in a.chunks]
    return sorted(key) == sorted((c.offsets, c.shape, c.digest) for c in b.chunks)


def _row_blocks(shape: Sequence[int], itemsize: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    if not shape:
        yield (), ()
        return
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    rows = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, shape[0], rows):
        count = min(rows, shape[0] - start)
        yield (start,) + (0,) * (len(shape) - 1), (count, *shape[1:])


def compare_tensor(a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, field: str, name: str) -> dict[str, Any] | None:
    """None if equal, else what differs (dtype/shape/bytes, and for floats the max abs difference)."""
    ra, rb = a.tensor(field, name), b.tensor(field, name)
    if ra.dtype != rb.dtype or ra.shape != rb.shape:
        return {
            "field": field,
            "name": name,
            "dtype": [ra.dtype, rb.dtype],
            "shape": [list(ra.shape), list(rb.shape)],
            "bytes": [ra.nbytes, rb.nbytes],
            "max_abs_diff": None,
            "different_elements": None,
            "nonfinite_mismatches": None,
        }
    if _same_chunks(ra, rb):
        return None
    is_float = np.dtype(dtypes.to_numpy(ra.dtype)).kind in FLOAT_KINDS or ra.dtype.startswith(("BF", "F8"))
    different = 0
    nonfinite = 0
    max_diff: float | None = None
    itemsize = dtypes.itemsize(ra.dtype)
    for offsets, shape in _row_blocks(ra.shape, itemsize):
        xa = a.read_slice(field, name, offsets, shape)
        xb = b.read_slice(field, name, offsets, shape)
        same_bits = xa.reshape(-1).view(np.uint8).reshape(xa.size, itemsize) == xb.reshape(-1).view(np.uint8).reshape(
            xb.size, itemsize
        )
        unequal = ~same_bits.all(axis=1) if xa.size else np.zeros(0, dtype=bool)
        different += int(unequal.sum())
        if is_float and unequal.any():
            wide = np.complex128 if ra.dtype == "C64" else np.float64
            fa = xa.reshape(-1)[unequal].astype(wide)
            fb = xb.reshape(-1)[unequal].astype(wide)
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.abs(fa - fb)
            finite = diff[np.isfinite(diff)]
            # NaN vs NaN with other payload bits is not a mismatch of values; NaN vs number or inf vs -inf is
            nonfinite += int((~np.isfinite(diff)).sum() - (np.isnan(fa) & np.isnan(fb)).sum())
            if finite.size:
                max_diff = max(max_diff or 0.0, float(finite.max()))
    if different == 0:
        return None
    return {
        "field": field,
        "name": name,
        "dtype": [ra.dtype, rb.dtype],
        "shape": [list(ra.shape), list(rb.shape)],
        "bytes": [ra.nbytes, rb.nbytes],
        "max_abs_diff": max_diff if is_float else None,
        "different_elements": different,
        "nonfinite_mismatches": nonfinite if is_float else None,
    }


def _flatten(value: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, Mapping) and item:
            out.update(_flatten(item, name))
        else:
            out[name] = item
    return out


def _equal(x: object, y: object) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return (
            isinstance(x, np.ndarray)
            and isinstance(y, np.ndarray)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.tobytes() == y.tobytes()
        )
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_equal(i, j) for i, j in zip(x, y, strict=True))
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def compare_context(a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, field: str) -> list[dict[str, str]]:
    ca = _flatten(a.read_context(field)) if a.has_context(field) else {}
    cb = _flatten(b.read_context(field)) if b.has_context(field) else {}
    out = []
    for key in sorted(set(ca) | set(cb)):
        if key not in ca:
            out.append({"field": field, "key": key, "change": "added"})
        elif key not in cb:
            out.append({"field": field, "key": key, "change": "removed"})
        elif not _equal(ca[key], cb[key]):
            out.append({"field": field, "key": key, "change": "changed"})
    return out


def _ignored(patterns: Sequence[str], *names: str) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def compare(a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, *, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The ``ckpt diff --json`` document (without the urls)."""
    fa, fb = a.fields, b.fields
    doc: dict[str, Any] = {
        "fields": {
            "added": sorted(n for n in fb if n not in fa and not _ignored(ignore, n)),
            "removed": sorted(n for n in fa if n not in fb and not _ignored(ignore, n)),
            "changed": [],
        },
        "tensors": {"added": [], "removed": [], "changed": []},
        "context": [],
        "metadata": sorted(
            k
            for k in set(a.manifest.metadata) | set(b.manifest.metadata)
            if a.manifest.metadata.get(k) != b.manifest.metadata.get(k) and not _ignored(ignore, f"metadata.{k}")
        ),
    }
    for field in sorted(set(fa) & set(fb)):
        if _ignored(ignore, field):
            continue
        if fa[field].kind != fb[field].kind:
            doc["fields"]["changed"].append({"name": field, "kind": [fa[field].kind, fb[field].kind]})
            continue
        ta, tb = fa[field].tensors, fb[field].tensors
        for name in sorted(set(ta) | set(tb)):
            if _ignored(ignore, f"{field}/{name}"):
                continue
            if name not in ta:
                doc["tensors"]["added"].append({"field": field, "name": name})
            elif name not in tb:
                doc["tensors"]["removed"].append({"field": field, "name": name})
            else:
                change = compare_tensor(a, b, field, name)
                if change is not None:
                    doc["tensors"]["changed"].append(change)
        doc["context"] += [c for c in compare_context(a, b, field) if not _ignored(ignore, f"{field}.{c['key']}")]
    doc["identical"] = not (
        any(doc["fields"].values()) or any(doc["tensors"].values()) or doc["context"] or doc["metadata"]
    )
    return doc
