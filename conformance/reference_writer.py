"""The reference writer adapter: ``python -m conformance.reference_writer INPUT.json OUT_DIR``.

Writes the checkpoint a writer input describes with ``ckptfmt.open_writer`` and prints its
checkpoint id on stdout. Honours the optional ``hints`` (target file size, digest algorithm, block size of
block digests: ``block_bytes``, the library's default when absent, ``null`` for none; ``base``: the name of a
checkpoint beside OUT_DIR whose equal chunks are referenced instead of written, and ``frozen``: the tensors
declared unchanged since it, spec/references.md; ``codec``: the codec to write with, ``"xor-zstd"`` for delta
chunks against the base, spec/delta.md) and the
``rank`` hints of chunks and context fields: an input naming ranks above 0 is written as a real
multi-rank save, one writer per rank (threads joined by a ThreadCollective), each rank writing its own
chunks and contexts, rank 0 the whole tensors and the commit.
Exit 0 written; 1 refused, with ``error [CODE]: message`` on stderr.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import ckptfmt
from ckptfmt.blocks import DEFAULT_BLOCK_BYTES
from ckptfmt.collective import ThreadCollective
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


def _ranks(writer_input: dict[str, Any]) -> int:
    """How many ranks the input's ``rank`` hints name (1 when none does)."""
    ranks = [0]
    for field in writer_input["fields"].values():
        ranks.append(int(field.get("rank", 0)))
        for entry in field.get("tensors", {}).values():
            ranks += [int(c["rank"]) for c in entry.get("chunks", ())]
    return max(ranks) + 1


def _write_rank(w: CheckpointWriter, writer_input: dict[str, Any], rank: int) -> None:
    """One rank's part of a multi-rank save: its chunks and contexts; rank 0 also the whole tensors."""
    fields: dict[str, Any] = writer_input["fields"]
    for name in sorted(fields):
        field = fields[name]
        if field["kind"] == "tensors":
            w.write_tensors(name, {})
        for tname, entry in field.get("tensors", {}).items():
            if "chunks" not in entry and rank == 0:
                w.write_tensor(name, tname, array_from(entry))
        for tname, entry in field.get("tensors", {}).items():
            for chunk in entry.get("chunks", ()):
                if int(chunk["rank"]) == rank:
                    box = tuple(slice(o, o + s) for o, s in zip(chunk["offsets"], chunk["shape"], strict=True))
                    data = array_from(entry)[box]
                    w.write_tensor(
                        name, tname, data, global_shape=tuple(entry["shape"]), offsets=tuple(chunk["offsets"])
                    )
        if "context" in field and int(field.get("rank", 0)) == rank:
            w.write_context(name, to_context(field["context"]))  # type: ignore[arg-type]


def _write_ranks(writer_input: dict[str, Any], out_dir: str | Path, world: int, options: dict[str, Any]) -> str:
    group = ThreadCollective.group(world)
    outcomes: list[str | BaseException] = [""] * world

    def run(rank: int) -> None:
        try:
            with ckptfmt.open_writer(out_dir, collective=group[rank], **options) as w:
                _write_rank(w, writer_input, rank)
            outcomes[rank] = str(w.checkpoint_id)
        except BaseException as exc:  # every rank fails with the coordinator's error; rank 0's is reported
            outcomes[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = outcomes[0]
    if isinstance(first, BaseException):
        raise first
    return first


def write(writer_input: dict[str, Any], out_dir: str | Path) -> str:
    """Write ``writer_input`` to ``out_dir``; returns the checkpoint id."""
    hints: dict[str, Any] = writer_input.get("hints", {})
    options: dict[str, Any] = {
        "profile": writer_input["profile"],
        "metadata": writer_input.get("metadata") or None,
        "target_file_size": int(hints.get("target_file_size", DEFAULT_TARGET_FILE_SIZE)),
        "digest": str(hints.get("digest", "xxh3-128")),
        "block_bytes": hints.get("block_bytes", DEFAULT_BLOCK_BYTES),
    }
    if "codec" in hints:  # "xor-zstd" with a base: chunks stored as deltas of the base's (spec/delta.md)
        options["codec"] = str(hints["codec"])
    if "base" in hints:  # a sibling of the output directory, in the same run directory
        options["base"] = Path(out_dir).parent / str(hints["base"])
        options["frozen"] = [str(name) for name in hints.get("frozen", ())]
    world = _ranks(writer_input)
    if world > 1:
        return _write_ranks(writer_input, out_dir, world, options)
    with ckptfmt.open_writer(out_dir, **options) as w:
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
