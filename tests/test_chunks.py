"""Chunk geometry: coverage_problem (exact tiling) and intersect, checked against a brute-force oracle."""

from __future__ import annotations

import time
from itertools import pairwise, product
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt import chunks
from ckptfmt.chunks import Box, coverage_problem, intersect

CASES: list[tuple[str, tuple[int, ...], list[Box], str | None]] = [
    ("whole", (4, 4), [((0, 0), (4, 4))], None),
    ("rows", (4, 4), [((0, 0), (1, 4)), ((1, 0), (3, 4))], None),
    ("grid", (4, 6), [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)], None),
    (
        "non-grid",
        (3, 3),
        [((0, 0), (1, 2)), ((0, 2), (2, 1)), ((1, 0), (2, 1)), ((1, 1), (1, 1)), ((2, 1), (1, 2))],
        None,
    ),
    ("0-d", (), [((), ())], None),
    ("empty", (0, 5), [((0, 0), (0, 5))], None),
    ("empty 1-d", (0,), [((0,), (0,))], None),
    ("no chunks", (2,), [], "has no chunks"),
    ("gap", (4,), [((0,), (1,)), ((2,), (2,))], "gap"),
    ("overlap", (4,), [((0,), (3,)), ((2,), (2,))], "overlap"),
    ("same volume, overlap and gap", (4,), [((0,), (2,)), ((1,), (2,))], "overlap"),
    ("duplicate", (2, 2), [((0, 0), (2, 2)), ((0, 0), (2, 2))], "overlap"),
    ("out of bounds", (4,), [((0,), (2,)), ((2,), (3,))], "outside"),
    ("negative offset", (4,), [((-1,), (2,)), ((1,), (3,))], "outside"),
    ("negative shape", (4,), [((0,), (-1,)), ((0,), (4,))], "outside"),
    ("rank mismatch", (4, 4), [((0,), (4,))], "rank"),
    ("empty chunk in a non-empty tensor", (2,), [((0,), (2,)), ((1,), (0,))], None),
    ("empty chunk at the far edge", (2, 3), [((0, 0), (2, 3)), ((2, 1), (0, 2))], None),
    ("empty chunk out of bounds", (2,), [((0,), (2,)), ((3,), (0,))], "outside"),
    ("two 0-d chunks", (), [((), ()), ((), ())], "overlap"),
    ("empty tensor, two chunks", (0, 2), [((0, 0), (0, 1)), ((0, 1), (0, 1))], "exactly one chunk"),
    ("empty tensor, wrong shape", (0, 2), [((0, 0), (0, 1))], "exactly one chunk"),
    ("empty tensor, off origin", (2, 0), [((1, 0), (2, 0))], "exactly one chunk"),
    ("overlap far apart in a long list", (10, 1), [((i, 0), (1, 1)) for i in range(9)] + [((3, 0), (1, 1))], "overlap"),
]


@pytest.mark.parametrize(("shape", "boxes", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_coverage_problem(shape: tuple[int, ...], boxes: list[Box], expected: str | None) -> None:
    problem = coverage_problem(shape, boxes)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_intersect() -> None:
    assert intersect(((0, 0), (2, 2)), ((1, 1), (2, 2))) == ((1, 1), (1, 1))
    assert intersect(((0, 0), (2, 2)), ((2, 0), (2, 2))) is None  # touching is not overlapping
    assert intersect(((0,), (5,)), ((1,), (2,))) == ((1,), (2,))
    assert intersect(((), ()), ((), ())) == ((), ())
    assert intersect(((0,), (0,)), ((0,), (3,))) is None


def oracle(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """True iff the boxes tile ``shape`` exactly, by counting every element (small shapes only)."""
    if int(np.prod(shape)) == 0:
        return len(boxes) == 1 and not any(boxes[0][0]) and tuple(boxes[0][1]) == tuple(shape)
    count = np.zeros(shape, dtype=np.int64)
    for offsets, size in boxes:
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, size, shape, strict=True)):
            return False
        # an empty chunk holds (and overlaps) nothing
        count[tuple(slice(o, o + s) for o, s in zip(offsets, size, strict=True))] += 1
    return bool(boxes) and bool((count == 1).all())


@st.composite
def random_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    n = draw(st.integers(0, 6))
    boxes = []
    for _ in range(n):
        offsets = tuple(draw(st.integers(0, max(g, 1))) for g in shape)
        size = tuple(draw(st.integers(0, max(g, 1))) for g in shape)
        boxes.append((offsets, size))
    return shape, boxes


@settings(max_examples=500, deadline=None)
@given(random_boxes())
def test_coverage_agrees_with_the_oracle_on_random_boxes(case: tuple[tuple[int, ...], list[Box]]) -> None:
    shape, boxes = case
    assert (coverage_problem(shape, boxes) is None) == oracle(shape, boxes)


@st.composite
def grids(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    per_dim = []
    for g in shape:
        cuts = sorted(set(draw(st.lists(st.integers(1, g - 1), max_size=3)) if g > 1 else []))
        edges = [0, *cuts, g]
        per_dim.append([(lo, hi - lo) for lo, hi in pairwise(edges)])
    boxes = [(tuple(o for o, _ in c), tuple(s for _, s in c)) for c in product(*per_dim)]
    return shape, draw(st.permutations(boxes))


@settings(max_examples=300, deadline=None)
@given(grids(), st.data())
def test_grids_tile_and_any_removal_or_duplication_breaks_them(
    case: tuple[tuple[int, ...], list[Box]], data: st.DataObject
) -> None:
    shape, boxes = case
    assert coverage_problem(shape, boxes) is None
    i = data.draw(st.integers(0, len(boxes) - 1))
    assert coverage_problem(shape, boxes[:i] + boxes[i + 1 :]) is not None
    assert coverage_problem(shape, [*boxes, boxes[i]]) is not None


def _pair(problem: str | None) -> tuple[int, int]:
    assert problem is not None and "overlap" in problem, problem
    words = problem.split()
    return int(words[1]), int(words[3])


@settings(max_examples=300, deadline=None)
@given(random_boxes())
def test_the_sweep_fallback_agrees_with_the_oracle(case: tuple[tuple[int, ...], list[Box]]) -> None:
    shape, boxes = case
    with patch.object(chunks, "MAX_GRID_CELLS", 0), patch.object(chunks, "SWEEP_BUDGET_PER_CHUNK", 0):
        problem = coverage_problem(shape, boxes)  # every layout takes the last resort
    assert (problem is None) == oracle(shape, boxes)
    if problem is not None and "overlap" in problem and shape:
        a, b = _pair(problem)
        assert intersect(boxes[a], boxes[b]) is not None


@settings(max_examples=300, deadline=None)
@given(random_boxes())
def test_the_grid_agrees_with_the_oracle(case: tuple[tuple[int, ...], list[Box]]) -> None:
    shape, boxes = case
    with patch.object(chunks, "SWEEP_BUDGET_PER_CHUNK", 0):
        problem = coverage_problem(shape, boxes)
    assert (problem is None) == oracle(shape, boxes)
    if problem is not None and "overlap" in problem and shape:
        a, b = _pair(problem)
        assert intersect(boxes[a], boxes[b]) is not None


@settings(max_examples=300, deadline=None)
@given(random_boxes())
def test_a_reported_overlap_names_two_chunks_that_overlap(case: tuple[tuple[int, ...], list[Box]]) -> None:
    shape, boxes = case
    problem = coverage_problem(shape, boxes)
    if problem is not None and "overlap" in problem and shape:
        a, b = _pair(problem)
        assert a < b and intersect(boxes[a], boxes[b]) is not None


N = 100_000


def _columns(n: int) -> tuple[tuple[int, ...], list[Box]]:
    """n chunks all spanning the same rows, tiling along dim 1 (quadratic for a dim-0 sweep)."""
    return (4, n), [((0, i), (4, 1)) for i in range(n)]


def _staircase(m: int) -> tuple[tuple[int, ...], list[Box]]:
    """2m chunks, row i cut at column i + 1: m x (m + 1) boundary cells, too many for the grid."""
    boxes: list[Box] = []
    for i in range(m):
        boxes += [((i, 0), (1, i + 1)), ((i, i + 1), (1, m - i))]
    return (m, m + 1), boxes


def _staircase_3d(m: int) -> tuple[tuple[int, ...], list[Box]]:
    boxes: list[Box] = []
    for i in range(m):
        boxes += [((i, 0, 0), (1, i + 1, 1)), ((i, 0, 1), (1, i + 1, 1)), ((i, i + 1, 0), (1, m - i, 2))]
    return (m, m + 1, 2), boxes


LAYOUTS = {
    "columns": _columns(N),
    "columns-3d": ((2, N // 4, 4), [((0, i, j), (2, 1, 1)) for i in range(N // 4) for j in range(4)]),
    "staircase": _staircase(N // 2),
    "staircase-3d": _staircase_3d(N // 3),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_adversarial_100k_chunk_layouts_are_checked_exactly(name: str) -> None:
    shape, boxes = LAYOUTS[name]
    started = time.perf_counter()
    assert coverage_problem(shape, boxes) is None
    last = boxes[-1]
    # overlap: a copy of the first chunk at the end; gap: the last chunk dropped; out of bounds: shifted
    assert _pair(coverage_problem(shape, [*boxes, boxes[0]])) == (0, len(boxes))
    gap = coverage_problem(shape, boxes[:-1])
    assert gap is not None and "gap" in gap
    shifted = ((last[0][0] + 1, *last[0][1:]), last[1])
    outside = coverage_problem(shape, [*boxes[:-1], shifted])
    assert outside is not None and "outside" in outside
    print(f"{name}: {len(boxes)} chunks, 4 checks in {time.perf_counter() - started:.2f} s")
