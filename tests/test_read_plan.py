"""The read plan (ckptfmt/read_plan.py), without I/O, and run through the executor.

For random chunk grids, regions and block sizes: the planned ranges cover exactly the bytes a region needs
plus at most one block at each edge, and reading them equals ``read_tensor`` sliced (issue 24).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.blocks import Blocks
from ckptfmt.manifest import ChunkRecord, TensorRecord
from ckptfmt.read_plan import Target, contiguous, flat_index, plan_read, whole

DIGEST = "xxh3-128:" + "0" * 32


def _grid(shape: tuple[int, ...], cuts: list[list[int]], block: int | None, itemsize: int) -> TensorRecord:
    """A tensor of ``shape`` cut at ``cuts`` per dimension, each chunk in a file of its own at byte 64."""
    chunks = []
    bounds = [[0, *c, d] for c, d in zip(cuts, shape, strict=True)]
    for n, cell in enumerate(itertools.product(*[list(itertools.pairwise(b)) for b in bounds])):
        offsets = tuple(lo for lo, _ in cell)
        size = tuple(hi - lo for lo, hi in cell)
        nbytes = int(np.prod(size)) * itemsize
        blocks = None
        if block is not None and nbytes > block:
            blocks = Blocks(size=block, digests="0" * 32 * -(-nbytes // block))
        chunks.append(
            ChunkRecord(
                path=f"f{n}",
                key="k",
                offsets=offsets,
                shape=size,
                begin=64,
                end=64 + nbytes,
                digest=DIGEST,
                blocks=blocks,
            )
        )
    return TensorRecord(dtype="F32", shape=shape, chunks=tuple(chunks))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[TensorRecord, Target, int | None]:
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, (5000, 200, 40)[rank - 1])) for _ in range(rank))
    cuts = [sorted(draw(st.sets(st.integers(1, d - 1), max_size=2))) if d > 1 else [] for d in shape]
    block = draw(st.sampled_from([None, 4096]))
    record = _grid(shape, cuts, block, 4)
    offsets = tuple(draw(st.integers(0, d - 1)) for d in shape)
    size = tuple(draw(st.integers(1, d - o)) for o, d in zip(offsets, shape, strict=True))
    return record, Target("w", "t", "F32", offsets, size), block


@given(layouts())
@settings(max_examples=200, deadline=None)
def test_planned_ranges_cover_the_needed_bytes_plus_at_most_a_block_per_edge(
    case: tuple[TensorRecord, Target, int | None],
) -> None:
    record, target, _ = case
    plan = plan_read({("w", "t"): record}, [target])
    touched = 0
    for piece in plan.pieces:
        chunk = piece.chunk
        box = [
            (max(o, t), min(o + s, t + n))
            for o, s, t, n in zip(chunk.offsets, chunk.shape, target.offsets, target.shape, strict=True)
        ]
        assert all(lo < hi for lo, hi in box)
        touched += 1
        first = [lo - o for (lo, _), o in zip(box, chunk.offsets, strict=True)]
        last = [hi - 1 - o for (_, hi), o in zip(box, chunk.offsets, strict=True)]
        need_lo = chunk.begin + flat_index(first, chunk.shape) * 4
        need_hi = chunk.begin + (flat_index(last, chunk.shape) + 1) * 4
        assert piece.begin <= need_lo and need_hi <= piece.end  # every needed byte is read
        if chunk.blocks is None:
            assert (piece.begin, piece.end) == (chunk.begin, chunk.end) and piece.check == "chunk"
        else:
            b = chunk.blocks.size
            assert piece.begin - need_lo > -b and piece.end - need_hi < b  # at most one block more per edge
            assert (piece.begin - chunk.begin) % b == 0
            assert piece.end == chunk.end or (piece.end - chunk.begin) % b == 0
            assert piece.check in ("blocks", "chunk")
            assert piece.check == "chunk" or (piece.begin, piece.end) != (chunk.begin, chunk.end)
    overlapping = [
        c
        for c in record.chunks
        if all(
            o < t + n and t < o + s for o, s, t, n in zip(c.offsets, c.shape, target.offsets, target.shape, strict=True)
        )
    ]
    assert touched == len(overlapping)


def test_unverified_partial_reads_fetch_only_the_needed_run() -> None:
    record = _grid((64, 64), [[32], []], None, 4)
    plan = plan_read({("w", "t"): record}, [Target("w", "t", "F32", (10, 0), (4, 64))], verify=False)
    (piece,) = plan.pieces
    assert (piece.begin, piece.end) == (64 + 10 * 256, 64 + 14 * 256) and piece.check == "none"
    assert piece.direct == (piece.begin, piece.end, 0)


def test_contiguity_of_a_box() -> None:
    assert contiguous((3, 8), (10, 8)) and contiguous((1, 1, 5), (4, 4, 8)) and contiguous((1, 4, 8), (4, 4, 8))
    assert not contiguous((2, 4), (10, 8)) and not contiguous((2, 1, 8), (4, 4, 8))


@st.composite
def written(draw: st.DrawFn) -> tuple[tuple[int, ...], list[list[int]], tuple[int, ...], tuple[int, ...]]:
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, (3000, 120, 24)[rank - 1])) for _ in range(rank))
    cuts = [sorted(draw(st.sets(st.integers(1, d - 1), max_size=2))) if d > 1 else [] for d in shape]
    offsets = tuple(draw(st.integers(0, d - 1)) for d in shape)
    size = tuple(draw(st.integers(1, d - o)) for o, d in zip(offsets, shape, strict=True))
    return shape, cuts, offsets, size


@given(written(), st.sampled_from([4096, None]), st.booleans())
@settings(max_examples=40, deadline=None)
def test_reading_a_region_through_the_executor_equals_the_tensor_sliced(
    case: tuple[tuple[int, ...], list[list[int]], tuple[int, ...], tuple[int, ...]], block: int | None, verify: bool
) -> None:
    import tempfile

    shape, cuts, offsets, size = case
    full = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32) * 1000
    with tempfile.TemporaryDirectory() as tmp:
        with ckptfmt.open_writer(tmp, profile="weights", overwrite=True, block_bytes=block) as w:
            bounds = [[0, *c, d] for c, d in zip(cuts, shape, strict=True)]
            for cell in itertools.product(*[list(itertools.pairwise(b)) for b in bounds]):
                lo = tuple(a for a, _ in cell)
                region = tuple(slice(a, b) for a, b in cell)
                w.write_tensor("weights", "t", full[region], global_shape=shape, offsets=lo)
            w.write_context(
                "provenance",
                {"writer": {"name": "t", "version": "1"}, "created_at": "2026-12-01T00:00:00Z", "host": "h", "step": 0},
            )
        with ckptfmt.open(tmp) as ckpt:
            got = ckpt.read_slice("weights", "t", offsets, size, verify=verify)
            want = ckpt.read_tensor("weights", "t")[tuple(slice(o, o + s) for o, s in zip(offsets, size, strict=True))]
    assert np.array_equal(got, want)
    assert np.array_equal(want, full[tuple(slice(o, o + s) for o, s in zip(offsets, size, strict=True))])


def test_several_targets_of_one_plan_fill_their_own_arrays(tmp_path: Path) -> None:
    a = np.arange(600_000, dtype=np.float32).reshape(600, 1000)
    with ckptfmt.open_writer(tmp_path, profile="weights") as w:
        w.write_tensor("weights", "a", a)
        w.write_context(
            "provenance",
            {"writer": {"name": "t", "version": "1"}, "created_at": "2026-12-01T00:00:00Z", "host": "h", "step": 0},
        )
    with ckptfmt.open(tmp_path) as ckpt:
        record = ckpt.tensor("weights", "a")
        targets = [
            whole("weights", "a", record),
            Target("weights", "a", "F32", (100, 0), (7, 1000)),
            Target("weights", "a", "F32", (5, 3), (20, 9)),
        ]
        full, rows, box = ckpt.read_regions(targets)
    assert np.array_equal(full, a) and np.array_equal(rows, a[100:107]) and np.array_equal(box, a[5:25, 3:12])
