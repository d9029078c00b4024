"""Chunk geometry: do a tensor's chunks tile its global shape, and which chunks does a region touch.

The tiling check must stay near-linear for any layout a hostile manifest can describe (100,000+
chunks): every pairwise scheme is quadratic on some layout. So it paints a grid instead: the distinct
chunk boundaries of each dimension cut the tensor into cells, each chunk claims its block of cells,
and a cell claimed twice names an overlap, a cell never claimed a gap. Work and memory are bounded by
the number of cells, which is about the number of chunks for every regular sharding; for the irregular
layouts where it would be large, a sweep with an ordered active set takes over (O(n log n) in rank 2).
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)

MAX_GRID_CELLS = 1 << 22  # 16 MiB of int32 owners; beyond this the sweep is used
SWEEP_BUDGET_PER_CHUNK = 8  # comparisons per chunk the first, simple sweep may spend before giving up


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
        overlap = _first_overlap(global_shape, boxes)
        if overlap is not None:
            a, b = overlap
            return f"chunks {a} and {b} overlap"
    if volume != total:
        return f"chunks cover {volume} of {total} elements (gap)"
    return None


def _first_overlap(global_shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Two chunks that share an element (lower index first), or None. Boxes are in bounds."""
    if not global_shape:  # 0-d: more than one chunk always overlaps
        return (0, 1)
    nonempty = [i for i, (_, shape) in enumerate(boxes) if all(shape)]
    if len(nonempty) < 2:
        return None
    rank = len(global_shape)
    # along the dimension where chunks are thinnest, few are active at once: the common row or column
    # shardings finish here in linear time, and a layout that would make it quadratic stops early
    dim = min(range(rank), key=lambda d: sum(boxes[i][1][d] for i in nonempty) / global_shape[d])
    found = _sweep(boxes, nonempty, dim, budget=SWEEP_BUDGET_PER_CHUNK * (len(nonempty) + 8))
    if found is not False:
        return found
    if max(global_shape) < 1 << 62:  # the grid works in int64
        found = _grid_overlap(global_shape, boxes, nonempty)
        if found is not False:
            return found
    # a dimension every chunk spans whole cannot separate two chunks: drop it
    keep = [d for d in range(rank) if any(boxes[i][1][d] != global_shape[d] for i in nonempty)]
    if not keep:
        return (nonempty[0], nonempty[1])
    if len(keep) < rank:
        boxes = [(tuple(o[d] for d in keep), tuple(s[d] for d in keep)) for o, s in boxes]
    if len(keep) == 1:
        return _sweep_1d(boxes, nonempty)
    if len(keep) == 2:
        return _sweep_2d(boxes, nonempty)
    # rank >= 3 with an irregular boundary grid of more than MAX_GRID_CELLS cells: quadratic in the
    # worst case (many long chunks staggered in three dimensions), linear for thin ones
    found = _sweep(boxes, nonempty, keep.index(dim) if dim in keep else 0, budget=None)
    assert found is not False
    return found


def _grid_overlap(
    global_shape: Sequence[int], boxes: Sequence[Box], nonempty: list[int]
) -> tuple[int, int] | Literal[False] | None:
    """Paint the boundary grid; False when the grid would exceed MAX_GRID_CELLS."""
    rank = len(global_shape)
    starts = np.array([boxes[i][0] for i in nonempty], dtype=np.int64).reshape(len(nonempty), rank)
    ends = starts + np.array([boxes[i][1] for i in nonempty], dtype=np.int64).reshape(len(nonempty), rank)
    lo = np.empty_like(starts)
    hi = np.empty_like(ends)
    cells = 1
    dims = []
    for d in range(rank):
        bounds = np.unique(np.concatenate((starts[:, d], ends[:, d])))
        dims.append(len(bounds) - 1)
        cells *= len(bounds) - 1
        if cells > MAX_GRID_CELLS:
            return False
        lo[:, d] = np.searchsorted(bounds, starts[:, d])
        hi[:, d] = np.searchsorted(bounds, ends[:, d])
    if bool(((hi - lo) == 1).all()):  # each chunk is one cell (every regular grid): no loop needed
        flat = np.asarray(np.ravel_multi_index(tuple(lo.T), dims), dtype=np.int64)
        order = np.argsort(flat, kind="stable")
        repeats = np.flatnonzero(flat[order][1:] == flat[order][:-1])
        if not len(repeats):
            return None
        k = int(repeats[np.argmin(order[repeats + 1])])  # the duplicate with the lowest later index
        a, b = nonempty[int(order[k])], nonempty[int(order[k + 1])]
        return (min(a, b), max(a, b))
    owner = np.zeros(dims, dtype=np.int32)  # chunk index + 1 per cell, 0 = unclaimed
    # each cell is claimed at most once before the first overlap stops the loop: work <= 2 x cells
    for k, i in enumerate(nonempty):
        region = tuple(slice(int(a), int(b)) for a, b in zip(lo[k], hi[k], strict=True))
        block = owner[region]
        if block.any():
            other = int(block[block != 0].min()) - 1
            return (min(i, other), max(i, other))
        block[...] = i + 1
    return None


def _sweep_1d(boxes: Sequence[Box], nonempty: list[int]) -> tuple[int, int] | None:
    order = sorted(nonempty, key=lambda i: boxes[i][0][0])
    for i, j in itertools.pairwise(order):
        if boxes[i][0][0] + boxes[i][1][0] > boxes[j][0][0]:
            return (min(i, j), max(i, j))
    return None


def _sweep_2d(boxes: Sequence[Box], nonempty: list[int]) -> tuple[int, int] | None:
    """Sweep along dim 0 keeping the active chunks' dim-1 intervals sorted; while no overlap has been
    found they are disjoint, so a new chunk need only be checked against its two neighbours."""
    order = sorted(nonempty, key=lambda i: boxes[i][0][0])
    expiry: list[tuple[int, int]] = []  # (row end, chunk) of active chunks
    starts: list[int] = []  # dim-1 starts of active chunks, sorted
    ids: list[int] = []
    for i in order:
        (row, col), _ = boxes[i]
        while expiry and expiry[0][0] <= row:
            _, gone = heapq.heappop(expiry)
            at = bisect_left(starts, boxes[gone][0][1])
            del starts[at], ids[at]
        at = bisect_left(starts, col)
        for j in (ids[at - 1] if at else None, ids[at] if at < len(ids) else None):
            if j is not None and intersect(boxes[i], boxes[j]) is not None:
                return (min(i, j), max(i, j))
        starts.insert(at, col)
        ids.insert(at, i)
        heapq.heappush(expiry, (row + boxes[i][1][0], i))
    return None


def _sweep(
    boxes: Sequence[Box], nonempty: list[int], dim: int, budget: int | None
) -> tuple[int, int] | Literal[False] | None:
    """Sweep along ``dim``, comparing only chunks whose spans along it intersect; False once more than
    ``budget`` comparisons would be needed."""
    order = sorted(nonempty, key=lambda i: boxes[i][0][dim])
    active: list[int] = []
    for i in order:
        start = boxes[i][0][dim]
        active = [j for j in active if boxes[j][0][dim] + boxes[j][1][dim] > start]
        if budget is not None:
            budget -= 2 * len(active) + 1
            if budget < 0:
                return False
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
