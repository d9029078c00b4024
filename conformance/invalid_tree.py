"""Vectors about tree digests (spec/tree-digests.md, format 1.3): the bases and the invalid vectors.

``tree_input`` is written by the reference writer with ``xxh3-128-tree`` digests and its default block size,
64 KiB, the size of a tree's pieces: chunk w (65,600 bytes: a full piece and one of 64 bytes) has block digests
and a chunk tree digest; small and empty chunks have flat digests (a chunk of exactly one piece is a unit test's,
tests/test_tree_digests.py: the vectors stay small); the data file has a file tree digest, the provenance blob a
flat one. ``weights_tree`` is the small ``weights`` base with tree digests, for the vectors about the file digest.

Each invalid vector spells a value a reader that skips one step of the tree would accept: the flat digest of the
right bytes under a tree algorithm's name, so a reader that hashes a tree digest as a flat one accepts it.
"""

from __future__ import annotations

from typing import Any

from ckptfmt.digests import digest_of

from .edits import DATA, Mutation
from .inputs import document, provenance, tensor, weights_base
from .invalid import PROV, Invalid, flip_chunk_byte
from .invalid_digests import respell
from .mutations import Json, Tree

TREE = "xxh3-128-tree"


def tree_input(digest: str = TREE, block_bytes: int | None = None) -> dict[str, Any]:
    """Raw tensors under a tree digest algorithm (the writer's default block size unless ``block_bytes``)."""
    tensors = {
        "w": tensor("F32", [16400], seed=1),  # 65,600 bytes: pieces of 65,536 and 64 bytes
        "s": tensor(
            "F32",
            [8],
            seed=3,
            chunks=[{"rank": 0, "offsets": [0], "shape": [4]}, {"rank": 0, "offsets": [4], "shape": [4]}],
        ),
        "e": tensor("F32", [0, 3]),
    }
    hints: dict[str, Any] = {"digest": digest}
    if block_bytes is not None:
        hints["block_bytes"] = block_bytes
    return document(
        "weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()}, **hints
    )


def weights_tree() -> dict[str, Any]:
    doc = weights_base()
    doc["hints"] = {"digest": TREE}
    return doc


def _flat_under_tree_name(t: Tree, where: str) -> None:
    """Chunk w's digest (``where="chunk"``), or the data file's, becomes the flat xxh3-128 digest of its bytes
    written under the name ``xxh3-128-tree``."""

    def fn(doc: Json) -> None:
        if where == "chunk":
            chunk = doc["fields"]["weights"]["tensors"]["w"]["chunks"][0]
            begin, end = chunk["range"]
            chunk["digest"] = TREE + ":" + digest_of("xxh3-128", t.read(chunk["path"])[begin:end]).partition(":")[2]
        else:
            record = next(r for r in doc["files"] if r["path"] == (PROV if where == "blob" else DATA))
            record["digest"] = TREE + ":" + digest_of("xxh3-128", t.read(record["path"])).partition(":")[2]

    t.edit(fn)


def unplaced_copy(t: Tree) -> None:
    """A copy of the data file listed under another path with its right file tree digest; no chunk is placed in it
    (MAN-17 is a writer's rule: a reader does not refuse an extra listed file)."""
    path = "extra/copy.safetensors"
    data = t.read(DATA)
    (t.root / "extra").mkdir()
    (t.root / path).write_bytes(data)

    def fn(doc: Json) -> None:
        digest = next(r["digest"] for r in doc["files"] if r["path"] == DATA)
        doc["files"].append({"digest": digest, "path": path, "size": len(data)})
        doc["files"].sort(key=lambda r: r["path"])

    t.edit(fn)


def flat_under_tree_name(where: str) -> Mutation:
    return lambda t: _flat_under_tree_name(t, where)


VECTORS: tuple[Invalid, ...] = (
    Invalid(
        "tree-digest-on-unplaced-file",
        ("TRE-2",),
        "A copy of the data file is listed as extra/copy.safetensors with its right file tree digest, and no chunk is "
        "placed in it: only TRE-2 refuses it (its digest matches its bytes).",
        unplaced_copy,
        base="weights-tree",
    ),
    Invalid(
        "tree-file-digest-flat-value",
        ("DIG-4",),
        "The data file's digest is 'xxh3-128-tree:' and the flat xxh3-128 digest of its bytes; every chunk matches.",
        flat_under_tree_name("file"),
        base="weights-tree",
        scope="file",
    ),
    Invalid(
        "tree-chunk-digest-flat-value",
        ("DIG-4",),
        "Chunk w (two pieces, with blocks) has 'xxh3-128-tree:' and the flat xxh3-128 digest of its bytes; its "
        "block digests and the file's tree digest match.",
        flat_under_tree_name("chunk"),
        base="tree",
        scope="tensor",
    ),
    Invalid(
        "tree-chunk-byte-flipped",
        ("DIG-4",),
        "One bit of chunk w (two pieces, with blocks) flipped, the data file's size and tree digest updated, the "
        "chunk's tree digest and block digests not.",
        flip_chunk_byte,
        base="tree",
        also=("BLK-6",),
        scope="tensor",
    ),
    Invalid(
        "tree-digest-31-digits",
        ("DIG-3",),
        "The data file's digest is 'xxh3-128-tree:' and 31 hex digits.",
        respell("file", lambda d: d[:-1]),
        base="weights-tree",
        also=("DIG-4",),  # 31 digits cannot be the file's digest
    ),
    Invalid(
        "tree-digest-uppercase",
        ("DIG-3",),
        "The data file's digest is its right xxh3-128-tree value in uppercase hex.",
        respell("file", lambda d: TREE + ":" + d.partition(":")[2].upper()),
        base="weights-tree",
        also=("DIG-4",),  # a reader that compares digests as strings finds it differs
    ),
    Invalid(
        "tree-digest-unknown-form",
        ("DIG-2",),
        "The data file's digest is 'xxh3-64-tree:' and its right xxh3-128-tree hex value (no such algorithm).",
        respell("file", lambda d: "xxh3-64-tree:" + d.partition(":")[2]),
        base="weights-tree",
    ),
    Invalid(
        "tree-digest-on-blob",
        ("TRE-2",),
        "The provenance blob, a file in which no chunk is placed, has 'xxh3-128-tree:' and the flat xxh3-128 digest "
        "of its bytes: its tree digest has no segments to be derived from.",
        flat_under_tree_name("blob"),
        base="weights-tree",
        also=("DIG-4",),  # the blob's bytes are no data file: they have no tree digest to match
    ),
)
