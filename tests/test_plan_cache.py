"""The plan cache (ckptfmt/plan_cache.py): a writer that takes its plan from the last writer's writes exactly the
checkpoint a writer that plans writes, whatever calls it makes, matching the recorded ones or not."""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import ckptfmt
from ckptfmt.errors import UsageError
from ckptfmt.plan_cache import PlanCache
from ckptfmt.writer import CheckpointWriter

_urls = itertools.count()

# A call: ("declare", field) or ("tensor", field, name, rows, cols, sharded). A sharded tensor is written as two
# chunks of rows, each a call of its own (global shape and offsets given).
Op = tuple[Any, ...]


def _write(ops: list[Op], cache: PlanCache | None, *, target: int, seed: int, after_flush: list[Op] = ()) -> bytes:
    """Write ``ops`` (then flush, then ``after_flush``) and commit; the checkpoint's manifest and data files."""
    url = f"memory://plan-cache/{next(_urls)}"
    rng = np.random.default_rng(seed)
    writer = CheckpointWriter(
        ckptfmt.open_store(url), profile="weights", target_file_size=target, workers=1, plan_cache=cache
    )
    for group, batch in enumerate(([*ops, ("declare", "weights")], after_flush)):  # the profile's field
        for op in batch:
            if op[0] == "declare":
                writer.write_tensors(op[1], {})
                continue
            _, field, name, rows, cols, sharded = op
            array = rng.standard_normal((rows, cols)).astype(np.float32)
            if not sharded or rows < 2:
                writer.write_tensor(field, name, array)
                continue
            half = rows // 2
            for lo, hi in ((0, half), (half, rows)):
                writer.write_tensor(field, name, array[lo:hi], global_shape=(rows, cols), offsets=(lo, 0))
        if group == 0:
            writer.flush()
    writer.write_context("provenance", {"created_at": "2026-01-02T03:04:05Z"})  # the manifests compare equal
    writer.commit()
    store = ckptfmt.open_store(url)
    return b"".join(name.encode() + store.read(name) for name in sorted(store.list()))


ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("declare"), st.sampled_from(["weights", "optimizer"])),
        st.tuples(
            st.just("tensor"),
            st.sampled_from(["weights", "optimizer"]),
            st.sampled_from(["a", "b", "c", "d", "e"]),
            st.integers(1, 6),
            st.integers(1, 5),
            st.booleans(),
        ),
    ),
    max_size=8,
)


def _valid(ops: list[Op]) -> list[Op]:
    """Each tensor written once (a second call with a name is dropped)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for op in ops:
        if op[0] == "tensor":
            if (op[1], op[2]) in seen:
                continue
            seen.add((op[1], op[2]))
        out.append(op)
    return out


@settings(max_examples=30, deadline=None)
@given(ops_strategy, ops_strategy, ops_strategy, st.sampled_from([1, 64, 200, 1 << 20]))
def test_a_writer_with_a_cache_writes_what_a_writer_that_plans_writes(
    first: list[Op], second: list[Op], later: list[Op], target: int
) -> None:
    first, second = _valid(first), _valid(second)
    later = [op for op in _valid(second + later)[len(second) :]]
    cache = PlanCache()
    # recorded; replayed or left where the calls differ; replayed (its manifest made a template); template filled
    for seed, ops in enumerate((first, second, second, second)):
        expected = _write(ops, None, target=target, seed=seed)
        assert _write(ops, cache, target=target, seed=seed) == expected
    # calls after a flush, which a replayed writer hands to its planner
    expected = _write(second, None, target=target, seed=3, after_flush=later)
    assert _write(second, cache, target=target, seed=3, after_flush=later) == expected


def test_the_same_calls_take_the_recorded_plan() -> None:
    ops: list[Op] = [("declare", "weights")] + [("tensor", "weights", n, 4, 3, n == "c") for n in "abcde"]
    cache = PlanCache()
    for seed in range(3):
        assert _write(ops, cache, target=64, seed=seed) == _write(ops, None, target=64, seed=seed)
    assert (cache.planned, cache.replayed) == (1, 2)
    changed = [*ops[:-1], ("tensor", "weights", "e", 5, 3, False)]  # one shape differs: planned again
    assert _write(changed, cache, target=64, seed=0) == _write(changed, None, target=64, seed=0)
    assert (cache.planned, cache.replayed) == (2, 2)


def test_a_call_the_planner_refuses_is_refused_with_a_cache_too() -> None:
    cache = PlanCache()
    ops: list[Op] = [("tensor", "weights", "a", 2, 2, False)]
    _write(ops, cache, target=64, seed=0)
    with pytest.raises(UsageError, match="already written"):
        _write(ops + ops, cache, target=64, seed=0)
    assert _write(ops, cache, target=64, seed=0) == _write(ops, None, target=64, seed=0)


def test_a_codec_or_a_base_leaves_the_cache_alone() -> None:
    cache = PlanCache()
    writer = CheckpointWriter(
        ckptfmt.open_store("memory://plan-cache/zstd"), profile="weights", codec="zstd", plan_cache=cache
    )
    writer.write_tensor("weights", "w", np.ones((64, 64), np.float32))
    writer.write_context("provenance", {})
    writer.commit()
    assert cache.recorded is None and cache.planned == 0
