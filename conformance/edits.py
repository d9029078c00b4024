"""Small, composable mutations for the vector table (conformance/vectors.py).

Each function returns a ``Mutation``: a callable applied to the :class:`Tree` of a freshly written
checkpoint. Paths into the manifest are tuples of keys and list indices.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ckptfmt.canonical import canonical_json
from ckptfmt.context import encode

from .mutations import Json, Tree
from .values import to_context

Mutation = Callable[[Tree], None]
Key = str | int

DATA = "weights/r00000-00000.safetensors"
NOTES = "notes/context.msgpack"


def _parent(doc: Json, path: Sequence[Key]) -> Any:
    node = doc
    for key in path[:-1]:
        node = node[key]
    return node


def chain(*mutations: Mutation) -> Mutation:
    def run(tree: Tree) -> None:
        for m in mutations:
            m(tree)

    return run


def manifest(fn: Callable[[Json], object]) -> Mutation:
    return lambda tree: tree.edit(fn)


def set_(path: Sequence[Key], value: object) -> Mutation:
    def fn(doc: Json) -> None:
        _parent(doc, path)[path[-1]] = value

    return manifest(fn)


def delete(path: Sequence[Key]) -> Mutation:
    def fn(doc: Json) -> None:
        del _parent(doc, path)[path[-1]]

    return manifest(fn)


def raw_manifest(fn: Callable[[bytes], bytes]) -> Mutation:
    return lambda tree: tree.set_raw_manifest(fn(tree.raw_manifest()))


def replace_in_manifest(old: str, new: str, count: int = 1) -> Mutation:
    """Replace text in the manifest bytes (for what a JSON encoder cannot write: duplicates, bad escapes)."""

    def fn(data: bytes) -> bytes:
        assert old.encode() in data, old
        return data.replace(old.encode(), new.encode("utf-8", "surrogateescape"), count)

    return raw_manifest(fn)


def tensor(field: str, name: str) -> tuple[str, ...]:
    return ("fields", field, "tensors", name)


def chunk(field: str, name: str, index: int = 0) -> tuple[Key, ...]:
    return (*tensor(field, name), "chunks", index)


def file_record(tree_doc: Json, path: str) -> int:
    return next(i for i, r in enumerate(tree_doc["files"]) if r["path"] == path)


def set_file(path: str, member: str, value: object) -> Mutation:
    def fn(doc: Json) -> None:
        doc["files"][file_record(doc, path)][member] = value

    return manifest(fn)


def delete_file_member(path: str, member: str) -> Mutation:
    def fn(doc: Json) -> None:
        del doc["files"][file_record(doc, path)][member]

    return manifest(fn)


def add_field(name: str, record: Json) -> Mutation:
    return set_(("fields", name), record)


def rename_tensor(field: str, old: str, new: str) -> Mutation:
    def fn(doc: Json) -> None:
        tensors = doc["fields"][field]["tensors"]
        tensors[new] = tensors.pop(old)

    return manifest(fn)


def blob(path: str, data: bytes) -> Mutation:
    """Replace a context blob's bytes; its file record follows."""
    return lambda tree: tree.write(path, data)


def context(field: str, value: dict[str, Any]) -> Mutation:
    """Replace a context blob with the encoding of a tagged-JSON value (no standard-field check)."""
    return blob(f"{field}/context.msgpack", encode(to_context(value)))  # type: ignore[arg-type]


def packb(value: object) -> bytes:
    data = msgpack.packb(value, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def fixmap(*members: tuple[bytes, bytes]) -> bytes:
    """A msgpack map of already-encoded keys and values, in the order given (duplicates allowed)."""
    return bytes([0x80 | len(members)]) + b"".join(k + v for k, v in members)


def header(fn: Callable[[dict[str, Any]], object], *, append: bytes = b"", path: str = DATA) -> Mutation:
    return lambda tree: tree.rewrite_data_file(path, header=fn, append=append)


def extra_entry(entry: dict[str, Any], nbytes: int, path: str = DATA) -> Mutation:
    """Add a header entry no chunk references, with ``nbytes`` appended; ``@END`` in offsets is the old end."""

    def run(tree: Tree) -> None:
        end = tree.data_end(path)
        resolved = {k: ([end + o for o in v] if k == "data_offsets" else v) for k, v in entry.items()}
        tree.rewrite_data_file(path, header=lambda h: h.__setitem__("extra", resolved), append=b"\x00" * nbytes)

    return run


def pad_byte(byte: bytes, path: str = DATA) -> Mutation:
    """Pad the header with spaces and make the last padding byte ``byte``."""

    def run(tree: Tree) -> None:
        tree.rewrite_data_file(path, pad=8)
        data = bytearray(tree.read(path))
        (length,) = struct.unpack("<Q", data[:8])
        data[8 + length - 1 : 8 + length] = byte
        tree.write(path, bytes(data))

    return run


def naive_hash(config: Json) -> str:
    """The hash a reader that skipped FLD-7 would compute (bin as hex, bigint as int, ndarray as list, NaN as null)."""

    def plain(v: object) -> object:
        v = to_context(v) if isinstance(v, dict) and len(v) == 1 and next(iter(v)).startswith("$") else v
        if isinstance(v, bytes):
            return v.hex()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if hasattr(v, "tolist"):
            return v.tolist()
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return "sha256:" + hashlib.sha256(canonical_json(plain(config))).hexdigest()


def config(value: Json, hash_: str | None = None) -> Mutation:
    """Replace the config blob with ``{"config": value, "hash": hash_ or naive_hash(value)}``."""
    return context("config", {"config": value, "hash": hash_ or naive_hash(value)})


def json_text(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
