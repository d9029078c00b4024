"""Checking stored bytes against a chunk's digests: the one span hasher of the read side.

A :class:`Span` is a byte range of a data file and the digest its bytes must hash to: the chunk digest (DIG-4),
or the block digests of the whole blocks it covers (BLK-5, BLK-6). Fed all its bytes, in order,
:meth:`Span.mismatch` says whether they hash to it, as the :class:`~ckptfmt.errors.DigestMismatchError` that a
reader raises and verification reports.

:class:`SpanHasher` feeds one file's bytes, as a stream hands them out, to every span that holds them, and hands
each span on as its last byte passes. The read executor's check (``ReadExecutor.check``, which raises the first
mismatch) and verification (``verify``, which reports every one) both stream through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .blocks import HEX_DIGITS, BlockHasher, Blocks
from .digests import Hasher, algorithm_of, format_digest, is_tree, new_hasher
from .errors import DigestMismatchError
from .manifest import ChunkRecord
from .tree_digests import LEAF_BYTES, chunk_digest_from_pieces


class Span:
    """The bytes ``[begin, end)`` of ``chunk``'s file, checked against its chunk digest, or, when ``first_block``
    is given, against its block digests from that block on (``[begin, end)`` then covers whole blocks).

    ``rule``: the requirement a block mismatch breaks (BLK-5 for a read, BLK-6 for verification); ``field`` and
    ``tensor`` locate the error."""

    __slots__ = ("begin", "chunk", "end", "field", "first_block", "hasher", "rule", "tensor")

    def __init__(
        self,
        chunk: ChunkRecord,
        begin: int | None = None,
        end: int | None = None,
        *,
        first_block: int | None = None,
        rule: str = "BLK-5",
        field: str | None = None,
        tensor: str | None = None,
    ) -> None:
        self.chunk = chunk
        self.begin = chunk.begin if begin is None else begin
        self.end = chunk.end if end is None else end
        self.first_block = first_block
        self.rule = rule
        self.field = field
        self.tensor = tensor
        algorithm = algorithm_of(chunk.digest)
        self.hasher: Hasher | BlockHasher
        if first_block is None and is_tree(algorithm):
            self.hasher = BlockHasher(algorithm, LEAF_BYTES)  # a chunk tree digest derives from its pieces'
        elif first_block is None:
            self.hasher = new_hasher(algorithm)
        else:
            assert chunk.blocks is not None, "block digests checked for a chunk without blocks"
            self.hasher = BlockHasher(algorithm, chunk.blocks.size)

    def mismatch(self) -> DigestMismatchError | None:
        """Once every byte of the span is in: the error naming the first digest they do not hash to, or None."""
        chunk, algorithm = self.chunk, algorithm_of(self.chunk.digest)
        if isinstance(self.hasher, BlockHasher):
            found = self.hasher.finish()
            if self.first_block is not None:
                return block_mismatch(chunk, found, self.first_block, self.rule, self.field, self.tensor)
            actual = chunk_digest_from_pieces(algorithm, chunk.nbytes, found.digests)
        else:
            actual = format_digest(algorithm, self.hasher)
        return digest_mismatch(chunk, actual, self.field, self.tensor)

    def check(self, *views: memoryview) -> None:
        """Raise the mismatch of the span's bytes, ``views`` back to back, if there is one."""
        for view in views:
            self.hasher.update(view)
        error = self.mismatch()
        if error is not None:
            raise error


def digest_mismatch(
    chunk: ChunkRecord, actual: str | None, field: str | None, tensor: str | None
) -> DigestMismatchError | None:
    """DIG-4: the error for a chunk whose bytes hash to ``actual``, or None when that is its digest."""
    if actual == chunk.digest:
        return None
    return DigestMismatchError(
        f"chunk {chunk.key!r} bytes [{chunk.begin}, {chunk.end}) hash to {actual}, manifest says {chunk.digest}",
        path=chunk.path,
        field=field,
        tensor=tensor,
        requirement="DIG-4",
    )


def block_mismatch(
    chunk: ChunkRecord, found: Blocks, first: int, rule: str, field: str | None, tensor: str | None
) -> DigestMismatchError | None:
    """The first of ``found`` (digests of ``chunk``'s blocks from block ``first`` on) that differs from the
    manifest's, as the error naming it, or None."""
    blocks = chunk.blocks
    assert blocks is not None
    algorithm = algorithm_of(chunk.digest)
    width = HEX_DIGITS[algorithm]
    for i in range(len(found.digests) // width):
        index = first + i
        if found.digests[i * width : (i + 1) * width] != blocks.digests[index * width : (index + 1) * width]:
            at = chunk.begin + index * blocks.size
            return DigestMismatchError(
                f"chunk {chunk.key!r} block {index} (bytes [{at}, {min(at + blocks.size, chunk.end)})) hashes to "
                f"{found.digest(algorithm, i)}, manifest says {blocks.digest(algorithm, index)}",
                path=chunk.path,
                field=field,
                tensor=tensor,
                requirement=rule,
            )
    return None


class SpanHasher:
    """Feeds one file's bytes to the spans that hold them, in one pass.

    :meth:`update` takes the bytes as a stream hands them out: in file order, skipping ranges no span needs. Each
    span is handed to ``done`` as its last byte passes, spans in order of their ``begin``; :meth:`close` hands on
    those the stream never reached (an empty chunk at the very end of a file) once it is over."""

    def __init__(self, spans: Iterable[Span], done: Callable[[Span], None]) -> None:
        self._spans = sorted(spans, key=lambda s: s.begin)  # stable: spans of one range keep the order given
        self._done = done
        self._next = 0  # the first span not opened yet
        self._open: list[Span] = []

    def update(self, at: int, view: memoryview) -> None:
        end = at + len(view)
        while self._next < len(self._spans) and self._spans[self._next].begin < end:
            self._open.append(self._spans[self._next])
            self._next += 1
        still_open = []
        for span in self._open:
            lo, hi = max(span.begin, at), min(span.end, end)
            if hi > lo:
                span.hasher.update(view[lo - at : hi - at])
            if span.end <= end:
                self._done(span)
            else:
                still_open.append(span)
        self._open = still_open

    def close(self) -> None:
        rest, self._open = [*self._open, *self._spans[self._next :]], []
        self._next = len(self._spans)
        for span in rest:
            self._done(span)


def check_chunk(chunk: ChunkRecord, *views: memoryview) -> None:
    """DIG-4: raise DigestMismatchError unless the chunk's bytes (``views``, back to back) hash to its digest."""
    Span(chunk).check(*views)
