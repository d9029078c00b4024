"""The read plan: which stored bytes fill which regions of which tensors, and what checks them. No I/O.

One rank asks for :class:`Target` regions (a whole tensor, a row range, its shard of a tensor saved on another
number of ranks). :func:`plan_read` turns them into :class:`Piece` records, one per (target, chunk) overlap:
the file range to read, how it reaches the target and what verifies it.

- A raw chunk needed whole is read whole and checked against its chunk digest.
- A raw chunk needed in part is read over the whole blocks that part touches and checked block by block
  (spec/blocks.md); a chunk without block digests is read whole to be checked (or, unverified, only over
  the bytes needed).
- An encoded chunk is read over the frames the part touches; the codec checks each frame (COD-5).

Where the needed bytes are contiguous both in the chunk and in the target, the piece is *direct*: those bytes
are read straight into the target, and only the block edges around them go to scratch. Otherwise the read
lands in a staging buffer and is copied out with the chunk's strides. The executor (``read_executor``) runs a
plan; this module only computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from . import chunks as geometry
from . import dtypes
from .codecs import FrameSpan, get_codec
from .errors import CheckpointError, UsageError
from .manifest import RAW, ChunkRecord, TensorRecord

Shape = tuple[int, ...]
Check = Literal["chunk", "blocks", "frames", "none"]


@dataclass(frozen=True, slots=True)
class Target:
    """One array a plan fills: the region ``[offsets, offsets + shape)`` of a tensor."""

    field: str
    tensor: str
    dtype: str
    offsets: Shape
    shape: Shape


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """The part of one chunk that one target needs, and how it gets there.

    ``[begin, end)`` is the absolute file range read. ``direct`` is ``(lo, hi, at)`` when the file bytes
    ``[lo, hi)`` land in the target from its byte ``at`` (``[begin, lo)`` and ``[hi, end)`` are scratch);
    otherwise the read is staged and ``source`` (chunk-local) is copied to ``dest`` (target-local) from the
    staged raw bytes, which start at the chunk's raw byte ``raw_at``.
    """

    target: int
    chunk: ChunkRecord
    begin: int
    end: int
    check: Check
    first_block: int = 0
    direct: tuple[int, int, int] | None = None
    source: tuple[slice, ...] = ()
    dest: tuple[slice, ...] = ()
    raw_at: int = 0
    span: FrameSpan | None = None  # an encoded chunk: the frames read, relative to the chunk

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class ReadPlan:
    targets: tuple[Target, ...]
    pieces: tuple[Piece, ...]  # sorted by (path, begin)

    @property
    def nbytes(self) -> int:
        """Stored bytes the plan reads."""
        return sum(p.nbytes for p in self.pieces)

    def by_file(self) -> dict[str, list[Piece]]:
        out: dict[str, list[Piece]] = {}
        for piece in self.pieces:
            out.setdefault(piece.chunk.path, []).append(piece)
        return out


def whole(field: str, name: str, record: TensorRecord) -> Target:
    return Target(field, name, record.dtype, (0,) * len(record.shape), tuple(record.shape))


def plan_read(
    tensors: Mapping[tuple[str, str], TensorRecord], targets: Sequence[Target], *, verify: bool = True
) -> ReadPlan:
    """The pieces that fill ``targets`` from the chunks of ``tensors`` ((field, name) -> record).

    Raises UsageError for a region outside its tensor and the codec's or dtype's refusal (located) for a
    chunk that cannot be read; nothing is allocated or read here.
    """
    pieces: list[Piece] = []
    for index, target in enumerate(targets):
        record = tensors[(target.field, target.tensor)]
        _check_region(target, record)
        try:
            itemsize = dtypes.to_numpy(record.dtype).itemsize
            for overlap_chunk, overlap in _overlaps(record, target):
                pieces.append(_piece(index, target, overlap_chunk, overlap, itemsize, verify=verify))
        except CheckpointError as exc:
            exc.locate(field=target.field, tensor=target.tensor)
            raise
    pieces.sort(key=lambda p: (p.chunk.path, p.begin, p.target))
    return ReadPlan(tuple(targets), tuple(pieces))


def _check_region(target: Target, record: TensorRecord) -> None:
    rank = len(record.shape)
    if (
        len(target.offsets) != rank
        or len(target.shape) != rank
        or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(target.offsets, target.shape, record.shape, strict=True))
    ):
        raise UsageError(
            f"region {list(target.offsets)}+{list(target.shape)} is outside shape {list(record.shape)}",
            field=target.field,
            tensor=target.tensor,
        )


def _overlaps(record: TensorRecord, target: Target) -> list[tuple[ChunkRecord, geometry.Box]]:
    if any(s == 0 for s in target.shape):
        return []
    region: geometry.Box = (target.offsets, target.shape)
    out = []
    for chunk in record.chunks:
        overlap = geometry.intersect(region, (chunk.offsets, chunk.shape))
        if overlap is not None:
            out.append((chunk, overlap))
    return out


def flat_index(index: Sequence[int], shape: Sequence[int]) -> int:
    """The C-order position of ``index`` in an array of ``shape``."""
    flat = 0
    for i, d in zip(index, shape, strict=True):
        flat = flat * d + i
    return flat


def contiguous(size: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether a box of ``size`` is one contiguous run of an array of ``shape`` (C order), wherever it starts."""
    dims = [i for i, (s, d) in enumerate(zip(size, shape, strict=True)) if s != d]
    return not dims or all(size[i] == 1 for i in range(dims[-1]))


def _piece(
    index: int, target: Target, chunk: ChunkRecord, overlap: geometry.Box, itemsize: int, *, verify: bool
) -> Piece:
    lo, size = overlap
    local = tuple(o - c for o, c in zip(lo, chunk.offsets, strict=True))
    placed = tuple(o - t for o, t in zip(lo, target.offsets, strict=True))
    source = tuple(slice(a, a + s) for a, s in zip(local, size, strict=True))
    dest = tuple(slice(a, a + s) for a, s in zip(placed, size, strict=True))
    # The raw bytes the overlap needs, from its first element to its last, in the chunk's C order.
    last = tuple(a + s - 1 for a, s in zip(local, size, strict=True))
    need_lo = flat_index(local, chunk.shape) * itemsize
    need_hi = (flat_index(last, chunk.shape) + 1) * itemsize
    raw_size = chunk.nbytes
    if chunk.codec.name != RAW:
        codec = get_codec(chunk.codec.name, path=chunk.path, field=target.field, tensor=target.tensor)
        count = 1
        for d in chunk.shape:
            count *= d
        try:
            span = codec.plan_frames(
                chunk.codec, stored_size=chunk.nbytes, raw_size=count * itemsize, raw_begin=need_lo, raw_end=need_hi
            )
        except CheckpointError as exc:
            exc.locate(path=chunk.path)
            raise
        return Piece(
            target=index,
            chunk=chunk,
            begin=chunk.begin + span.stored_begin,
            end=chunk.begin + span.stored_end,
            check="frames",
            source=source,
            dest=dest,
            raw_at=span.raw_begin,
            span=span,
        )
    if need_lo == 0 and need_hi == raw_size:
        check: Check = "chunk" if verify else "none"
        read_lo, read_hi, first_block = 0, raw_size, 0
    elif verify and chunk.blocks is not None:
        read_lo, read_hi = chunk.blocks.covering(raw_size, need_lo, need_hi)
        first_block = read_lo // chunk.blocks.size
        check = "chunk" if (read_lo, read_hi) == (0, raw_size) else "blocks"
    elif verify:
        check, read_lo, read_hi, first_block = "chunk", 0, raw_size, 0
    else:
        check, read_lo, read_hi, first_block = "none", need_lo, need_hi, 0
    begin, end = chunk.begin + read_lo, chunk.begin + read_hi
    direct = None
    if contiguous(size, chunk.shape) and contiguous(size, target.shape):
        direct = (chunk.begin + need_lo, chunk.begin + need_hi, flat_index(placed, target.shape) * itemsize)
    return Piece(
        target=index,
        chunk=chunk,
        begin=begin,
        end=end,
        check=check,
        first_block=first_block,
        direct=direct,
        source=() if direct else source,
        dest=() if direct else dest,
        raw_at=0 if direct else read_lo,
    )
