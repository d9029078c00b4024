"""Corruption: every single-byte flip and every truncation of every file of a checkpoint, and three detectors.

For each damaged copy (one file changed, everything else as written):

- ``ckpt verify COPY`` exits non-zero;
- reading: a tensor with a chunk in the damaged data file (or the damaged context blob) raises a
  library error; every other read raises a library error or returns exactly what was written;
- ``ckpt diff ORIGINAL COPY`` does not exit 0 ("identical"), and prints no traceback.

Every byte of every file the manifest lists is covered by that file's digest (and the manifest is
canonical JSON every byte of which is parsed), so there is no byte a detector may skip: a flip in
safetensors header padding, say, changes the file digest as much as one in tensor data.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ckptfmt.cli import cli
from click.testing import CliRunner

import ckptfmt

from . import payload

MANIFEST = "manifest.json"


@dataclass(slots=True)
class CorruptionFigures:
    name: str
    files: int = 0
    bytes: int = 0
    tried: int = 0
    flips: int = 0
    truncations: int = 0
    by_verify: int = 0
    by_read: int = 0
    by_diff: int = 0
    missed_by_verify: list[str] = field(default_factory=list)
    # verify passed a manifest naming a codec no reader implements (its tensor then fails to read): defect D7
    missed_by_verify_codec: list[str] = field(default_factory=list)
    # the damaged manifest is another valid, wholly readable checkpoint (a renamed field or tensor, a later
    # minor version): nothing inside a checkpoint digests its manifest; its id (recorded in latest.json and
    # in a child's provenance) is what tells it apart, and diff must
    other_valid_manifest: list[str] = field(default_factory=list)
    missed_by_read: list[str] = field(default_factory=list)
    missed_by_diff: list[str] = field(default_factory=list)


def write_small(url: str) -> None:
    """Three data files of one tensor each, two context blobs, and the manifest: about 2 KB in all."""
    rng = np.random.default_rng(7)
    with ckptfmt.open_writer(url, profile="weights", target_file_size=64) as w:
        w.write_tensor("weights", "a", rng.standard_normal((4, 4)).astype(np.float32))
        w.write_tensor("weights", "b", rng.integers(0, 255, (6, 5)).astype(np.uint8))
        w.write_tensor("weights", "c", rng.standard_normal(5).astype(np.float64))
        w.write_context("data", {"epoch": 2, "global_sample_offset": 640})
        w.write_context("provenance", payload.contexts(0)["provenance"])


def write_large(url: str) -> None:
    """The crash payload with larger tensors: several MiB over several files."""
    rng = np.random.default_rng(8)
    with ckptfmt.open_writer(url, profile="training", target_file_size=1 << 20) as w:
        payload.write_into(w, 0)
        for i in range(6):
            w.write_tensor("weights", f"big{i}", rng.standard_normal((256, 512)).astype(np.float32))


def _snapshot(url: str) -> tuple[dict[str, dict[str, bytes]], dict[str, Any]]:
    with ckptfmt.open(url) as ckpt:
        tensors = {
            f: {n: ckpt.read_tensor(f, n).tobytes() for n in ckpt.tensor_names(f)}
            for f, r in ckpt.fields.items()
            if r.kind == "tensors"
        }
        contexts = {f: ckpt.read_context(f) for f, r in ckpt.fields.items() if r.context is not None}
    return tensors, contexts


def _owners(url: str) -> dict[str, list[tuple[str, str | None, int, int]]]:
    """File path -> (field, tensor or None for a context blob, begin, end) of what is stored in it."""
    out: dict[str, list[tuple[str, str | None, int, int]]] = {}
    with ckptfmt.open(url) as ckpt:
        for fname, record in ckpt.fields.items():
            for tname, tensor in record.tensors.items():
                for chunk in tensor.chunks:
                    out.setdefault(chunk.path, []).append((fname, tname, chunk.begin, chunk.end))
            if record.context is not None:
                out.setdefault(record.context, []).append((fname, None, 0, 1 << 62))
    return out


def _affected(stored: list[tuple[str, str | None, int, int]], how: str, at: int) -> list[tuple[str, str | None]]:
    """The reads a damaged byte must fail: a truncation or a header byte fails every read of the file (its
    size and header are checked first); a flipped data byte fails the read of the chunk holding it."""
    header_end = min((begin for _, _, begin, _ in stored), default=0)
    if how == "truncate" or at < header_end:
        return [(f, t) for f, t, _, _ in stored]
    return [(f, t) for f, t, begin, end in stored if begin <= at < end]


def _reads(
    url: str,
    affected: list[tuple[str, str | None]] | None,
    tensors: dict[str, dict[str, bytes]],
    contexts: dict[str, Any],
) -> str | None:
    """None when every read of the damaged copy raised or returned the original, and every affected one raised."""
    affected_set = set(affected or [])
    try:
        ckpt = ckptfmt.open(url)
    except ckptfmt.CheckpointError:
        return None
    except Exception as exc:
        return f"open raised {type(exc).__name__}: {exc}"
    with ckpt:
        items: list[tuple[str, str | None]] = [(f, n) for f, names in tensors.items() for n in names]
        items += [(f, None) for f in contexts]
        for fname, tname in items:
            try:
                value: Any = ckpt.read_tensor(fname, tname).tobytes() if tname else ckpt.read_context(fname)
            except ckptfmt.CheckpointError:
                continue
            except Exception as exc:
                return f"reading {fname}/{tname} raised {type(exc).__name__}: {exc}"
            if (fname, tname) in affected_set:
                return f"reading {fname}/{tname} returned without error"
            expected = tensors[fname][tname] if tname else contexts[fname]
            if not payload._same_value(value, expected):
                return f"reading {fname}/{tname} returned different data without error"
    return None


def _manifest_kind(url: str) -> str:
    """For a damaged manifest verify accepted: "codec" (a chunk's codec is unknown, so its tensor cannot be
    read), "valid" (every field, tensor and context of it reads), else "miss"."""
    try:
        with ckptfmt.open(url) as ckpt:
            if any(c.codec.name != "raw" for r in ckpt.fields.values() for t in r.tensors.values() for c in t.chunks):
                return "codec"
            for fname, record in ckpt.fields.items():
                for tname in record.tensors:
                    ckpt.read_tensor(fname, tname)
                if record.context is not None:
                    ckpt.read_context(fname)
    except ckptfmt.CheckpointError:
        return "miss"
    return "valid"


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return -1, f"{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, result.output


def corrupt(original: str, workdir: Path, name: str, *, sample: int | None = None, seed: int = 0) -> CorruptionFigures:
    """Damage a copy of ``original`` once per case (every flip and truncation, or ``sample`` of them)."""
    figures = CorruptionFigures(name)
    copy = workdir / "copy"
    shutil.copytree(original, copy)
    files = {p: (copy / p).read_bytes() for p in sorted(ckptfmt.open_store(str(copy)).list())}
    figures.files = len(files)
    figures.bytes = sum(len(d) for d in files.values())
    owners = _owners(original)
    tensors, contexts = _snapshot(original)
    cases = [(p, "flip", i) for p, d in files.items() for i in range(len(d))]
    cases += [(p, "truncate", k) for p, d in files.items() for k in range(len(d))]
    if sample is not None and sample < len(cases):
        cases = random.Random(seed).sample(cases, sample)
    for path, how, at in cases:
        data = files[path]
        damaged = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :] if how == "flip" else data[:at]
        (copy / path).write_bytes(damaged)
        label = f"{path} {'byte' if how == 'flip' else 'cut at'} {at}"
        figures.tried += 1
        figures.flips += how == "flip"
        figures.truncations += how == "truncate"
        try:
            code, out = _cli("verify", str(copy))
            if code == 0 or code == -1:
                miss = f"{label}: ckpt verify exit {code}: {out.strip()[:200]}"
                kind = _manifest_kind(str(copy)) if path == MANIFEST and code == 0 else "miss"
                {
                    "miss": figures.missed_by_verify,
                    "codec": figures.missed_by_verify_codec,
                    "valid": figures.other_valid_manifest,
                }[kind].append(miss)
            else:
                figures.by_verify += 1
            affected = None if path == MANIFEST else _affected(owners.get(path, []), how, at)
            problem = _reads(str(copy), affected, tensors, contexts)
            if problem:
                figures.missed_by_read.append(f"{label}: {problem}")
            else:
                figures.by_read += 1
            code, out = _cli("diff", original, str(copy))
            if code == 0 or code == -1 or "Traceback" in out:
                figures.missed_by_diff.append(f"{label}: ckpt diff exit {code}: {out.strip()[:200]}")
            else:
                figures.by_diff += 1
        finally:
            (copy / path).write_bytes(data)
    return figures
