"""Block digests: a digest per fixed-size block of a raw chunk's stored bytes (spec/blocks.md, format 1.2).

A reader that needs only part of a chunk reads the blocks that part touches and checks each one, instead of
reading the whole chunk to check its digest. The chunk digest still covers every byte, so readers of 1.0 and
1.1, which ignore ``blocks`` (VER-5), keep verifying whole chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypedDict

from .digests import ALGORITHMS, base_algorithm, format_digest, hex_digest_function, new_hasher
from .free_hash import xxh3_blocks

MIN_BLOCK_BYTES = 1 << 12  # BLK-1: a page
MAX_BLOCK_BYTES = 1 << 30
# 64 KiB: a partial read costs at most 128 KiB more than it needs (a tensor saved on 4 ranks and loaded on 3 reads
# ~0.345 of it per rank with 1 MiB chunks), for 1/2048 of the data in the manifest (hex); block_bytes= trades them.
DEFAULT_BLOCK_BYTES = 1 << 16
# A block digest uses the flat algorithm of its chunk digest: the base of a tree one (spec/tree-digests.md).
HEX_DIGITS = ALGORITHMS
_LOWHEX = re.compile(r"[0-9a-f]*")


class BlocksDict(TypedDict):
    """A chunk's ``blocks`` member on disk."""

    size: int
    digests: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Blocks:
    """``digests`` is the hex of every block's digest, back to back, in the chunk digest's algorithm."""

    size: int
    digests: str

    def to_dict(self) -> BlocksDict:
        return {"size": self.size, "digests": self.digests}

    @classmethod
    def from_dict(cls, doc: BlocksDict) -> Blocks:
        """From a ``blocks`` member already checked (:func:`problem` found none)."""
        return cls(size=doc["size"], digests=doc["digests"])

    def count(self, nbytes: int) -> int:
        return -(-nbytes // self.size)

    def digest(self, algorithm: str, index: int) -> str:
        width = HEX_DIGITS[algorithm]
        return f"{base_algorithm(algorithm)}:{self.digests[index * width : (index + 1) * width]}"

    def covering(self, nbytes: int, lo: int, hi: int) -> tuple[int, int]:
        """The chunk-relative byte range ``[lo', hi')`` of the whole blocks that ``[lo, hi)`` touches."""
        if hi <= lo:
            return lo, lo
        return (lo // self.size) * self.size, min(nbytes, -(-hi // self.size) * self.size)


def valid_size(size: object) -> bool:
    """BLK-1: a power of two from 4 KiB to 1 GiB."""
    return type(size) is int and MIN_BLOCK_BYTES <= size <= MAX_BLOCK_BYTES and size & (size - 1) == 0


def problem(raw: object, *, nbytes: int, algorithm: str) -> tuple[str, str] | None:
    """Why a chunk's ``blocks`` member is malformed, as (message, rule), or None (BLK-1, BLK-2)."""
    if type(raw) is not dict:
        return "chunk 'blocks' must be a JSON object", "BLK-1"
    size, digests = raw.get("size"), raw.get("digests")
    if not valid_size(size):
        return (
            f"blocks 'size' must be a power of two from {MIN_BLOCK_BYTES} to {MAX_BLOCK_BYTES}, got {size!r}",
            "BLK-1",
        )
    assert isinstance(size, int)
    if type(digests) is not str:
        return "blocks 'digests' must be a string of hex digits", "BLK-2"
    want = -(-nbytes // size) * HEX_DIGITS[algorithm]
    if len(digests) != want or _LOWHEX.fullmatch(digests) is None:
        return (
            f"blocks 'digests' must be {want} lowercase hex digits ({-(-nbytes // size)} blocks of {size} bytes "
            f"under {algorithm}), got {min(len(digests), 10**9)} characters"
            + ("" if _LOWHEX.fullmatch(digests) else " with a non-hex one"),
            "BLK-2",
        )
    return None


class BlockHasher:
    """The writer's side: feed a chunk's bytes in order, get its ``Blocks``. Each block is hashed as its last
    byte arrives, so the caller's slices may cut blocks anywhere."""

    def __init__(self, algorithm: str, size: int) -> None:
        self.algorithm = base_algorithm(algorithm)
        self.size = size
        self._hasher = new_hasher(self.algorithm)
        self._filled = 0
        self._parts: list[str] = []
        self._whole = hex_digest_function(self.algorithm)
        self._free = self.algorithm == "xxh3-128"

    def update(self, data: memoryview) -> None:
        at, end, size = 0, len(data), self.size
        if self._filled:  # the rest of a block an earlier slice began
            at = min(size - self._filled, end)
            self._hasher.update(data[:at])
            self._filled += at
            if self._filled == size:
                self._finish_block()
        count = (end - at) // size
        found = xxh3_blocks(data, at, count, size) if count and self._free else None
        if found is not None:  # without the GIL (free_hash.py says why)
            self._parts.append(found)
            at += count * size
        whole = self._whole  # whole blocks in one call each: no hasher object per block (a tree's 64 KiB pieces)
        while end - at >= size:
            self._parts.append(whole(data[at : at + size]))
            at += size
        if at < end:
            self._hasher.update(data[at:])
            self._filled += end - at

    def _finish_block(self) -> None:
        self._parts.append(format_digest(self.algorithm, self._hasher).partition(":")[2])
        self._hasher = new_hasher(self.algorithm)
        self._filled = 0

    def finish(self) -> Blocks:
        if self._filled:
            self._finish_block()
        return Blocks(size=self.size, digests="".join(self._parts))
