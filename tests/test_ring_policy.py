"""The ring policy alone (ckptfmt/tier/ring.py RingPolicy, spec/memory.md MEM-2): which slot the next snapshot
rewrites, without threads, files or torch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptfmt.errors import UsageError
from ckptfmt.tier.ring import RingPolicy, SlotRef


def ring(steps: dict[int, int | None], *, slots: int = 2) -> RingPolicy:
    policy = RingPolicy(slot_count=slots + 1 if slots == 2 else slots, ring_slots=slots)
    policy.load(steps)
    return policy


def test_an_empty_slot_first_then_the_oldest() -> None:
    assert ring({0: None, 1: None}).pick(newest=None, spare=True) == 0
    assert ring({0: 4, 1: None}).pick(newest=0, spare=True) == 1
    assert ring({0: 4, 1: 6, 2: 5}, slots=3).pick(newest=None, spare=False) == 0


def test_never_the_newest_committed_slot_nor_a_held_one() -> None:
    policy = ring({0: 5, 1: 6}, slots=2)
    assert policy.pick(newest=1, spare=False) == 0  # the oldest, not the newest
    policy = ring({0: 5, 1: 6})
    policy.hold(0)
    assert policy.pick(newest=1, spare=False) is None  # MEM-2: the snapshot is skipped, neither is rewritten
    assert policy.steps == {0: 5, 1: 6, 2: None}


def test_the_spare_slot_of_a_ring_of_two_only_while_one_is_held_and_only_where_it_fits() -> None:
    policy = ring({0: 5, 1: 6})
    assert policy.pick(newest=1, spare=True) == 0  # nothing held: the ring itself
    policy = ring({0: 5, 1: 6})
    policy.hold(0)
    assert policy.pick(newest=1, spare=True) == 2
    policy.release(0)
    assert not policy.is_held(0)


def test_a_picked_slot_holds_nothing_until_committed() -> None:
    policy = ring({0: 5, 1: 6})
    slot = policy.pick(newest=1, spare=False)
    assert slot == 0 and policy.step_of(0) is None
    policy.committed(0, 7)
    assert policy.newest_committed() == (0, 7)


def test_a_slot_whose_write_failed_is_written_last() -> None:
    policy = ring({0: None, 1: None, 2: None}, slots=3)
    policy.failed(0)
    assert policy.pick(newest=None, spare=False) == 1
    policy.succeeded(0)
    assert policy.pick(newest=1, spare=False) == 0


def test_after_a_restore_newer_slots_and_the_same_step_elsewhere_return_to_the_ring() -> None:
    policy = ring({0: 4, 1: 6, 2: 5}, slots=3)
    policy.drop_after(5, keep=2)
    assert policy.steps == {0: 4, 1: None, 2: 5}
    policy.drop_after(4, keep=None)  # restored from the run directory: no slot is that snapshot
    assert policy.steps == {0: None, 1: None, 2: None}


def test_misuse_is_refused() -> None:
    with pytest.raises(UsageError):
        RingPolicy(slot_count=2, ring_slots=3)
    with pytest.raises(UsageError, match="not loaded"):
        RingPolicy(slot_count=3, ring_slots=2).pick(newest=None, spare=True)


def test_slot_ref_names_its_parts_and_still_unpacks() -> None:
    ref = SlotRef(1, 7, "sha256:" + "0" * 64)
    slot, step, ckpt = ref
    assert (ref.slot, ref.step, ref.checkpoint_id) == (slot, step, ckpt) and ref[1] == 7


@given(
    steps=st.lists(st.one_of(st.none(), st.integers(0, 50)), min_size=3, max_size=3),
    held=st.sets(st.integers(0, 2)),
    spare=st.booleans(),
)
def test_mem_2_whatever_the_ring_holds(steps: list[int | None], held: set[int], spare: bool) -> None:
    """Never the newest committed slot, never a held one, the spare only where it fits; None only when no slot
    qualifies."""
    policy = ring(dict(enumerate(steps)))
    for slot in held:
        policy.hold(slot)
    newest_pair = policy.newest_committed()
    newest = newest_pair[0] if newest_pair is not None else None
    picked = policy.pick(newest=newest, spare=spare)
    allowed = {s for s in range(3) if s not in held and s != newest and (s < 2 or spare)}
    if picked is None:
        assert not allowed
    else:
        assert picked in allowed
        empty = [s for s in allowed if steps[s] is None and s < 2]
        if empty:
            assert picked in empty
