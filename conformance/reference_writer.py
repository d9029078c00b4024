"""The reference writer adapter: ``python -m conformance.reference_writer INPUT.json OUT_DIR``.

Writes the checkpoint a writer input describes with ``ckptfmt.open_writer`` and prints its
checkpoint id on stdout. Honours the optional ``hints`` (target file size, digest algorithm) and
per-tensor ``chunks`` hints (each rank's chunks are written, then flushed to that rank's file).
Exit 0 written; 1 refused, with ``error [CODE]: message`` on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import ckptfmt
from ckptfmt.errors import CheckpointError
from ckptfmt.writer import DEFAULT_TARGET_FILE_SIZE, CheckpointWriter

from .values import array_from, load, to_context


def _write_field(w: CheckpointWriter, name: str, field: dict[str, Any]) -> None:
    tensors: dict[str, Any] = field.get("tensors", {})
    if field["kind"] == "tensors":
        w.write_tensors(name, {})  # declares the field, even when it has no tensors
    by_rank: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for tname, entry in tensors.items():
        array = array_from(entry)
        if "chunks" not in entry:
            w.write_tensor(name, tname, array)
            continue
        for chunk in entry["chunks"]:
            by_rank.setdefault(int(chunk["rank"]), []).append((tname, chunk))
    for rank in sorted(by_rank):
        for tname, chunk in by_rank[rank]:
            entry = tensors[tname]
            array = array_from(entry)
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offsets"], chunk["shape"], strict=True))
            w.write_tensor(name, tname, array[box], global_shape=tuple(entry["shape"]), offsets=tuple(chunk["offsets"]))
        w.flush()  # one data file per rank
    if "context" in field:
        w.write_context(name, to_context(field["context"]))  # type: ignore[arg-type]


def write(writer_input: dict[str, Any], out_dir: str | Path) -> str:
    """Write ``writer_input`` to ``out_dir``; returns the checkpoint id."""
    hints: dict[str, Any] = writer_input.get("hints", {})
    with ckptfmt.open_writer(
        out_dir,
        profile=writer_input["profile"],
        metadata=writer_input.get("metadata") or None,
        target_file_size=int(hints.get("target_file_size", DEFAULT_TARGET_FILE_SIZE)),
        digest=str(hints.get("digest", "xxh3-128")),
    ) as w:
        for name in sorted(writer_input["fields"]):
            _write_field(w, name, writer_input["fields"][name])
    assert w.checkpoint_id is not None
    return w.checkpoint_id


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m conformance.reference_writer INPUT.json OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(write(load(Path(argv[0]).read_bytes()), argv[1]))
    except CheckpointError as exc:
        print(f"error [{exc.code}]: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
