"""Invalid vectors: the record type and the mutations the tables use (invalid_manifest.py, invalid_tensors.py,
invalid_context.py). Each vector is a valid base checkpoint plus one deterministic mutation breaking one MUST.

``requirements`` names the MUST the vector is about. Where the spec makes it impossible to break
that rule alone (e.g. a chunk range past the end of its file also disagrees with the file's
header), ``also`` names the rules inevitably broken with it. ``scope`` is what the rule refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .edits import (
    DATA,
    NOTES,
    Mutation,
    chunk,
    context,
    header,
)
from .mutations import Json, Tree

PROV = "provenance/context.msgpack"
PROV_REF = {"context": {"path": PROV}}


@dataclass(frozen=True)
class Invalid:
    name: str
    requirements: tuple[str, ...]
    note: str
    mutate: Mutation
    base: str = "weights"
    also: tuple[str, ...] = ()
    scope: str = "checkpoint"


def truncate(path: str, n: int) -> Mutation:
    def run(t: Tree) -> None:
        (t.root / path).write_bytes(t.read(path)[:-n])

    return run


def flip_chunk_byte(t: Tree) -> None:
    doc = t.manifest()
    begin = doc["fields"]["weights"]["tensors"]["w"]["chunks"][0]["range"][0]
    data = bytearray(t.read(DATA))
    data[begin] ^= 0x01
    t.write(DATA, bytes(data))  # the file record follows; the chunk digest does not


def flip_blob_text(t: Tree) -> None:
    t.write(PROV, t.read(PROV).replace(b"conformance", b"conformancf"), refresh=False)


def swap_ranges(doc: Json) -> None:
    a, b = doc["fields"]["weights"]["tensors"]["s"]["chunks"]
    a["range"], b["range"] = b["range"], a["range"]
    a["digest"], b["digest"] = b["digest"], a["digest"]


def past_end(doc: Json) -> None:
    """Chunk w (24 bytes) keeps its length but ends 8 bytes after the end of its file."""
    size = next(r["size"] for r in doc["files"] if r["path"] == DATA)
    doc["fields"]["weights"]["tensors"]["w"]["chunks"][0]["range"] = [size - 16, size + 8]


def second_empty_chunk(t: Tree) -> None:
    """Give the empty tensor ``e`` [0, 3] a second empty chunk, stored as its own (empty) entry."""
    end = t.data_end(DATA)
    t.rewrite_data_file(
        DATA, header=lambda h: h.__setitem__("e2", {"dtype": "F32", "shape": [0, 3], "data_offsets": [end, end]})
    )

    at = len(t.read(DATA))  # e2's entry is at the end of the data section, which ends the file

    def fn(doc: Json) -> None:
        chunks = doc["fields"]["weights"]["tensors"]["e"]["chunks"]
        chunks.append({**chunks[0], "key": "e2", "range": [at, at]})  # its own range: the header agrees (SAF-13)

    t.edit(fn)


def header_length(value: int) -> Mutation:
    return lambda t: t.rewrite_data_file(DATA, length=value)


def header_past_end(t: Tree) -> None:
    t.rewrite_data_file(DATA, length=len(t.read(DATA)) - 8 + 1)


def symlink_file(t: Tree) -> None:
    (t.root / "real").mkdir()
    (t.root / DATA).rename(t.root / "real" / "data.safetensors")
    (t.root / DATA).symlink_to("../real/data.safetensors")


def symlink_dir(t: Tree) -> None:
    (t.root / "weights").rename(t.root / "real-weights")
    (t.root / "weights").symlink_to("real-weights")


def directory_blob(t: Tree) -> None:
    (t.root / NOTES).unlink()
    (t.root / NOTES).mkdir()
    (t.root / NOTES / "x").write_bytes(b"x")


def long_path(t: Tree) -> None:
    t.move(DATA, "/".join(["d" * 255] * 4 + ["x"]))  # 4 * 255 + 1 + 4 separators = 1025 octets


def dup_member(t: Tree) -> None:
    t.set_raw_manifest(b'{"format":"ckptfmt",' + t.raw_manifest()[1:])


def weights_entry(fn: Callable[[dict[str, Any]], object]) -> Mutation:
    return header(lambda h: fn(h["w"]))


def ctx(value: dict[str, Any]) -> Mutation:
    return context("notes", value)


BIGINT_2_64 = b"\xc7\x09\x01" + (1 << 64).to_bytes(9, "big", signed=True)
NOT_MINIMAL = b"\xc7\x0a\x01" + (1 << 64).to_bytes(10, "big", signed=True)
IN_RANGE = b"\xc7\x09\x01" + (1 << 63).to_bytes(9, "big", signed=True)


def ndarray_ext(payload: bytes) -> bytes:
    return b"\xc7" + bytes([len(payload)]) + b"\x02" + payload


GOOD_NDARRAY: list[object] = [b"U32", [1], b"\x01\x00\x00\x00"]


def nd(parts: list[object]) -> bytes:
    return ndarray_ext(msgpack.packb(parts, use_bin_type=False))


def deep(levels: int) -> object:
    value: object = 0
    for _ in range(levels):
        value = [value]
    return value


EXTRA_CTX = {"kind": "context", **PROV_REF}
W = ("fields", "weights", "tensors", "w")
C = chunk("weights", "w")
S1 = chunk("weights", "s", 1)


def _entry(header_text: bytes, key: str) -> bytes:
    return json.dumps(json.loads(header_text)[key], separators=(",", ":")).encode()
