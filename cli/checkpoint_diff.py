"""Comparing two checkpoints field by field, tensor by tensor, context key by context key.

By default (``compared="bytes"``) every tensor of both sides is read and every chunk hashed against
its manifest digest, so a corrupt side is reported as a problem, never as equality. Tensors with the
same dtype, shape, chunking and chunk digests are then equal once both sides hash to those digests;
others are read chunk by chunk (same chunking) or in blocks of rows along the first dimension, so memory
stays at two blocks; float differences are computed in float64. ``compared="digests"`` trusts matching
digests without reading (fast, and says so: it proves the manifests agree, not that the bytes are there).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

import ckptfmt
from ckptfmt import dtypes
from ckptfmt.errors import CheckpointError, ContextError, IntegrityError, UnsupportedCodecError
from ckptfmt.manifest import TensorRecord

Compared = Literal["bytes", "digests"]
# Errors that mean "this side's stored data is bad": reported as problems of the diff, not as a crash
_DATA_ERRORS = (IntegrityError, ContextError, UnsupportedCodecError)

BLOCK_BYTES = 64 << 20
FLOAT_KINDS = "fc"


def _same_chunks(a: TensorRecord, b: TensorRecord) -> bool:
    key = [(c.offsets, c.shape, c.digest) for c in a.chunks]
    return sorted(key) == sorted((c.offsets, c.shape, c.digest) for c in b.chunks)


def _same_geometry(a: TensorRecord, b: TensorRecord) -> bool:
    return sorted((c.offsets, c.shape) for c in a.chunks) == sorted((c.offsets, c.shape) for c in b.chunks)


def _chunk_blocks(record: TensorRecord) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    # one block per chunk: each chunk of each side is read (and hashed) exactly once
    for chunk in sorted(record.chunks, key=lambda c: c.offsets):
        if all(chunk.shape):
            yield chunk.offsets, chunk.shape


class SideError(Exception):
    """Corrupt or unreadable data on one side of the diff (``side`` is "a" or "b")."""

    def __init__(self, side: str, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.side = side
        self.error = error


def _read(c: ckptfmt.Checkpoint, side: str, field: str, name: str, offsets: Any, shape: Any) -> np.ndarray[Any, Any]:
    try:
        return c.read_slice(field, name, offsets, shape, verify=True)
    except _DATA_ERRORS as exc:
        raise SideError(side, exc) from exc


def _verify_chunks(c: ckptfmt.Checkpoint, side: str, field: str, name: str) -> None:
    """Read every chunk of a tensor once and check it against its manifest digest (raises SideError)."""
    for offsets, shape in _chunk_blocks(c.tensor(field, name)):
        _read(c, side, field, name, offsets, shape)


def _verify_both(a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, field: str, name: str) -> None:
    errors = []
    for c, side in ((a, "a"), (b, "b")):
        try:
            _verify_chunks(c, side, field, name)
        except SideError as exc:
            errors.append(exc)
    if errors:
        raise errors[0] if len(errors) == 1 else BothSidesError(errors)


class BothSidesError(Exception):
    def __init__(self, errors: list[SideError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


def _row_blocks(shape: Sequence[int], itemsize: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    if not shape:
        yield (), ()
        return
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    rows = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, shape[0], rows):
        count = min(rows, shape[0] - start)
        yield (start,) + (0,) * (len(shape) - 1), (count, *shape[1:])


def compare_tensor(
    a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, field: str, name: str, *, compared: Compared = "bytes"
) -> dict[str, Any] | None:
    """None if equal, else what differs (dtype/shape/bytes, and for floats the max abs difference).

    With ``compared="bytes"`` both sides are read and digest-checked even when their digests match, and a
    corrupt side raises its IntegrityError; with ``"digests"`` matching digests are trusted unread.
    """
    ra, rb = a.tensor(field, name), b.tensor(field, name)
    if ra.dtype != rb.dtype or ra.shape != rb.shape:
        if compared == "bytes":
            _verify_both(a, b, field, name)
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
        if compared == "bytes":  # equal digests prove equal bytes only once both sides hash to them
            _verify_both(a, b, field, name)
        return None
    is_float = np.dtype(dtypes.to_numpy(ra.dtype)).kind in FLOAT_KINDS or ra.dtype.startswith(("BF", "F8"))
    different = 0
    nonfinite = 0
    max_diff: float | None = None
    itemsize = dtypes.itemsize(ra.dtype)
    blocks = _chunk_blocks(ra) if _same_geometry(ra, rb) else _row_blocks(ra.shape, itemsize)
    for offsets, shape in blocks:
        xa = _read(a, "a", field, name, offsets, shape)
        xb = _read(b, "b", field, name, offsets, shape)
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


def _context(c: ckptfmt.Checkpoint, side: str, field: str) -> dict[str, object]:
    if not c.has_context(field):
        return {}
    try:
        return _flatten(c.read_context(field))
    except _DATA_ERRORS as exc:
        raise SideError(side, exc) from exc


def compare_context(a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, field: str) -> list[dict[str, str]]:
    ca = _context(a, "a", field)
    cb = _context(b, "b", field)
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


def diff_checkpoints(
    a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint, *, ignore: Sequence[str] = (), compared: Compared = "bytes"
) -> dict[str, Any]:
    """The ``ckpt diff --json`` document (without the urls).

    ``problems`` lists corrupt or unreadable data found on either side (file, field, tensor named); a diff
    with problems is never ``identical``.
    """
    fa, fb = a.fields, b.fields
    problems: list[dict[str, str]] = []
    per_tensor = compared
    if compared == "bytes":
        # One streaming verify per side checks every byte against the whole-file and chunk digests (and the
        # blobs); after it, matching chunk digests prove matching bytes, so tensors are compared by digest and
        # only those that differ are read again.
        for side, c in (("a", a), ("b", b)):
            problems += [{"side": side, "url": c.url, **p.to_dict()} for p in c.verify().problems]
        per_tensor = "digests"
    doc: dict[str, Any] = {
        "compared": compared,
        "format_version": (
            [a.format_version, b.format_version] if a.format_version != b.format_version else a.format_version
        ),
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
                try:
                    change = compare_tensor(a, b, field, name, compared=per_tensor)
                except (SideError, BothSidesError) as exc:
                    problems += _problems(exc, a, b)
                    continue
                if change is not None:
                    doc["tensors"]["changed"].append(change)
        try:
            changes = compare_context(a, b, field)
        except SideError as exc:
            problems += _problems(exc, a, b)
            continue
        doc["context"] += [c for c in changes if not _ignored(ignore, f"{field}.{c['key']}")]
    doc["problems"] = _dedupe(problems)
    doc["identical"] = not (
        any(doc["fields"].values())
        or any(doc["tensors"].values())
        or doc["context"]
        or doc["metadata"]
        or problems
        or isinstance(doc["format_version"], list)
    )
    return doc


def _dedupe(problems: list[dict[str, str]]) -> list[dict[str, str]]:
    """One problem per corrupt thing: the first report of each (side, file, field, tensor), and no whole-file
    report for a file whose chunk was already named (a flipped byte breaks both digests)."""
    named = {(p["side"], p.get("path")) for p in problems if "tensor" in p}
    out: list[dict[str, str]] = []
    seen: set[tuple[str | None, ...]] = set()
    for p in problems:
        key = (p["side"], p.get("path"), p.get("field"), p.get("tensor"))
        if key in seen or (
            "tensor" not in p and p.get("code") == "digest_mismatch" and (p["side"], p.get("path")) in named
        ):
            continue
        seen.add(key)
        out.append(p)
    return out


def _problems(exc: SideError | BothSidesError, a: ckptfmt.Checkpoint, b: ckptfmt.Checkpoint) -> list[dict[str, str]]:
    errors = exc.errors if isinstance(exc, BothSidesError) else [exc]
    return [{"side": e.side, "url": a.url if e.side == "a" else b.url, **e.error.to_dict()} for e in errors]
