"""Vectors about block digests (spec/blocks.md, format 1.2): the base input and the invalid vectors.

The base is written by the reference writer with 4096-byte blocks, so its larger raw chunks carry
``blocks`` (a last block shorter than the others included). Each invalid vector breaks one BLK rule
and keeps everything else consistent: a block size the rules refuse still comes with the digests of
blocks of that size, so the vector is refused for the size and not for the digests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptfmt.blocks import BlockHasher

from .edits import DATA, Mutation, chain, replace_in_manifest
from .inputs import document, provenance, tensor
from .invalid import Invalid
from .invalid_codecs import to_zstd
from .mutations import Json, Tree

BLOCK_BYTES = 4096


def blocks_input(digest: str | None = None) -> dict[str, Any]:
    """Raw tensors with block digests of 4096 bytes: several blocks with a short last one, a tensor in two chunks
    of two blocks each, one of exactly one block's size and smaller ones (no blocks), an empty one."""
    tensors = {
        "w": tensor("F32", [20, 64], seed=1),  # 5120 bytes: blocks of 4096 and 1024
        "s": tensor(
            "F32",
            [48, 64],
            seed=2,
            chunks=[
                {"rank": 0, "offsets": [0, 0], "shape": [24, 64]},  # 6144 bytes each: 4096 and 2048
                {"rank": 0, "offsets": [24, 0], "shape": [24, 64]},
            ],
        ),
        "x": tensor("BF16", [2048], seed=3),  # exactly one block: not larger than a block, so no blocks
        "steps": tensor("I64", [4], seed=4),
        "e": tensor("F32", [0, 3]),
    }
    hints: dict[str, Any] = {"block_bytes": BLOCK_BYTES}
    if digest is not None:
        hints["digest"] = digest
    return document(
        "weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()}, **hints
    )


def chunk_of(doc: Json, name: str = "w", index: int = 0) -> Json:
    chunk: Json = doc["fields"]["weights"]["tensors"][name]["chunks"][index]
    return chunk


def block_digests(t: Tree, chunk: Json, size: int) -> str:
    """The hex of the digests of ``chunk``'s blocks of ``size`` bytes, as a writer computes them."""
    begin, end = chunk["range"]
    hasher = BlockHasher(chunk["digest"].partition(":")[0], size)
    hasher.update(memoryview(t.read(chunk["path"]))[begin:end])
    return hasher.finish().digests


def set_blocks(name: str, value: Callable[[Tree, Json], object], index: int = 0) -> Mutation:
    """Give chunk ``index`` of tensor ``name`` the ``blocks`` member ``value(tree, chunk)``."""

    def run(t: Tree) -> None:
        def fn(doc: Json) -> None:
            chunk = chunk_of(doc, name, index)
            chunk["blocks"] = value(t, chunk)

        t.edit(fn)

    return run


def sized(size: int) -> Mutation:
    """Chunk w's blocks of ``size`` bytes, with their true digests."""
    return set_blocks("w", lambda t, c: {"size": size, "digests": block_digests(t, c, size)})


def edit_digests(fn: Callable[[str], object]) -> Mutation:
    return set_blocks("w", lambda t, c: {"size": c["blocks"]["size"], "digests": fn(c["blocks"]["digests"])})


def wrong_last_block(t: Tree) -> None:
    """Chunk w's last block digest is that of its bytes with one bit flipped; the chunk digest still matches."""

    def fn(doc: Json) -> None:
        chunk = chunk_of(doc)
        begin, end = chunk["range"]
        data = bytearray(t.read(DATA)[begin:end])
        data[BLOCK_BYTES] ^= 0x01
        hasher = BlockHasher(chunk["digest"].partition(":")[0], BLOCK_BYTES)
        hasher.update(memoryview(data))
        chunk["blocks"]["digests"] = chunk["blocks"]["digests"][:32] + hasher.finish().digests[32:]

    t.edit(fn)


def zstd_with_blocks(t: Tree) -> None:
    """The zstd vector's checkpoint; its compressed chunk w gets the true digests of its stored bytes' blocks."""
    to_zstd(t)
    set_blocks("w", lambda tree, c: {"size": BLOCK_BYTES, "digests": block_digests(tree, c, BLOCK_BYTES)})(t)


def _assert_blocks(t: Tree) -> None:
    """The base must have what the vectors edit: chunk w with two blocks (a guard against a changed writer)."""
    assert len(chunk_of(t.manifest())["blocks"]["digests"]) == 64


VECTORS: tuple[Invalid, ...] = (
    Invalid(
        "blocks-not-object",
        ("BLK-1",),
        "Chunk w's 'blocks' is its digests string, not an object.",
        chain(_assert_blocks, set_blocks("w", lambda t, c: c["blocks"]["digests"])),
        base="blocks",
    ),
    Invalid(
        "blocks-size-fraction",
        ("BLK-1",),
        "A chunk's blocks 'size' is written 4096.0: a number with a fraction part is no integer (spec/README.md).",
        replace_in_manifest('"size":4096}', '"size":4096.0}'),
        also=("MAN-7",),
        base="blocks",
    ),
    Invalid(
        "blocks-null",
        ("BLK-1",),
        "Chunk w's 'blocks' is null (not an object: a member that is present, not an absent one).",
        set_blocks("w", lambda t, c: None),
        base="blocks",
    ),
    Invalid(
        "blocks-size-not-power-of-two",
        ("BLK-1",),
        "Chunk w's blocks are of 6144 bytes (1.5 * 4096): one block, its true digest.",
        sized(6144),
        base="blocks",
    ),
    Invalid(
        "blocks-size-below-page",
        ("BLK-1",),
        "Chunk w's blocks are of 2048 bytes, a power of two below 4096: three blocks, their true digests.",
        sized(2048),
        base="blocks",
    ),
    Invalid(
        "blocks-size-above-max",
        ("BLK-1",),
        "Chunk w's blocks are of 2^31 bytes, a power of two above 2^30: one block, its true digest.",
        sized(1 << 31),
        base="blocks",
    ),
    Invalid(
        "blocks-digests-floor",
        ("BLK-2",),
        "Chunk w (5120 bytes, blocks of 4096) has the digest of its first block only: floor(n / B) blocks, not ceil.",
        edit_digests(lambda d: d[:32]),
        base="blocks",
    ),
    Invalid(
        "blocks-digests-uppercase",
        ("BLK-2",),
        "Chunk w's block digests in uppercase hex (the same values).",
        edit_digests(str.upper),
        base="blocks",
    ),
    Invalid(
        "blocks-digests-not-string",
        ("BLK-2",),
        "Chunk w's 'digests' is an array of one hex string per block.",
        edit_digests(lambda d: [d[:32], d[32:]]),
        base="blocks",
    ),
    Invalid(
        "blocks-on-zstd-chunk",
        ("BLK-3",),
        "The zstd vector's chunk w (zstd, three frames) has blocks of 4096 bytes with the true digests of its stored "
        "bytes.",
        zstd_with_blocks,
        base="zstd",
    ),
    Invalid(
        "block-digest-mismatch",
        ("BLK-6",),
        "Chunk w's last block digest is that of other bytes; its chunk digest and first block digest match.",
        wrong_last_block,
        base="blocks",
        scope="tensor",
    ),
)
