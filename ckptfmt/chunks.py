"""Chunk geometry: do a tensor's chunks tile its global shape, and which chunks does a region touch."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def coverage_problem(global_shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` do not tile ``global_shape`` exactly (gap, overlap, out of bounds), or None."""
    rank = len(global_shape)
    if not boxes:
        return "has no chunks"
    total = prod(global_shape)
    if total == 0:
        if len(boxes) != 1 or any(boxes[0][0]) or tuple(boxes[0][1]) != tuple(global_shape):
            return "an empty tensor must have exactly one chunk, at the origin, of the tensor's shape"
        return None
    volume = 0
    for i, (offsets, shape) in enumerate(boxes):
        if len(offsets) != rank or len(shape) != rank:
            return f"chunk {i} has rank {len(offsets)}/{len(shape)}, tensor has rank {rank}"
        for d in range(rank):
            if offsets[d] < 0 or shape[d] < 0 or offsets[d] + shape[d] > global_shape[d]:
                return f"chunk {i} at {list(offsets)} of shape {list(shape)} lies outside {list(global_shape)}"
        volume += prod(shape)  # an empty chunk is allowed: it holds and overlaps nothing
    if len(boxes) > 1:
        overlap = _first_overlap(boxes)
        if overlap is not None:
            a, b = overlap
            return f"chunks {a} and {b} overlap"
    if volume != total:
        return f"chunks cover {volume} of {total} elements (gap)"
    return None


def _first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """A sweep along dim 0: only chunks whose row spans intersect are compared pairwise."""
    if not boxes[0][0]:  # 0-d: more than one chunk always overlaps
        return (0, 1)
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        start = boxes[i][0][0]
        active = [j for j in active if boxes[j][0][0] + boxes[j][1][0] > start]
        for j in active:
            if intersect(boxes[i], boxes[j]) is not None:
                return (min(i, j), max(i, j))
        active.append(i)
    return None


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None if they do not share an element."""
    offsets = []
    shape = []
    for ao, ash, bo, bsh in zip(a[0], a[1], b[0], b[1], strict=True):
        lo = max(ao, bo)
        hi = min(ao + ash, bo + bsh)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)
