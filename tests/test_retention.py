"""The retention plan (ckptfmt/retention.py) on made-up listings: no storage, every rule on its own."""

from __future__ import annotations

from typing import Any

from ckptfmt.retention import plan_retention, referrers_first
from ckptfmt.run import Entry, checkpoint_name


def entry(step: int, status: Any = "committed", **kw: Any) -> Entry:
    return Entry(name=checkpoint_name(step), step=step, status=status, size=1, files=1, **kw)


def doomed(entries: list[Entry], **rules: Any) -> list[int | None]:
    return [e.step for e in plan_retention(entries, **rules).doomed]


RUN = [entry(s) for s in (60, 50, 40, 30, 20, 10)]  # newest first, as RunDirectory.entries lists them


def test_keep_last_keep_every_pins_latest_and_protect() -> None:
    assert doomed(RUN, keep_last=2) == [40, 30, 20, 10]
    assert doomed(RUN, keep_last=2, keep_every=20) == [30, 10]
    assert doomed(RUN, keep_last=1, pinned=[checkpoint_name(10)], latest=checkpoint_name(30)) == [50, 40, 20]
    assert doomed(RUN, keep_last=1, protect=[checkpoint_name(50)]) == [40, 30, 20, 10]
    assert doomed(RUN, keep_last=None) == []  # no rule: committed checkpoints stay


def test_a_kept_checkpoint_keeps_its_bases_transitively_and_says_who_needs_them() -> None:
    run = [
        entry(60, bases=(checkpoint_name(40),)),
        entry(50),
        entry(40, bases=(checkpoint_name(20),)),
        entry(30),
        entry(20),
    ]
    plan = plan_retention(run, keep_last=1)
    assert [e.step for e in plan.doomed] == [50, 30]
    assert plan.referenced == {checkpoint_name(40): (checkpoint_name(60),), checkpoint_name(20): (checkpoint_name(40),)}


def test_live_writers_invalid_manifests_and_foreign_remains_are_never_doomed() -> None:
    run = [
        entry(70, "writing", bases=(checkpoint_name(10),)),
        entry(65, "invalid manifest"),
        entry(62, "incomplete", foreign=("notes.txt",)),
        entry(61, "incomplete"),
        *RUN,
    ]
    assert doomed(run, keep_last=1) == [61, 50, 40, 30, 20]  # 10: a live writer's base


def test_an_unreadable_writer_lock_or_pointer_suspends_deleting_committed_checkpoints() -> None:
    run = [entry(70, "writing", error={"code": "checkpoint_error"}), entry(61, "incomplete"), *RUN]
    plan = plan_retention(run, keep_last=1)
    assert [e.step for e in plan.doomed] == [61] and plan.hold is not None and "writer lock" in plan.hold
    plan = plan_retention(RUN, keep_last=1, pinned=[checkpoint_name(10)], pointers_hold="pins.json is unreadable")
    assert plan.doomed == () and plan.hold == "pins.json is unreadable"


def test_referrers_come_before_their_bases() -> None:
    a, b = entry(10), entry(20, bases=(checkpoint_name(10),))
    c = entry(30, bases=(checkpoint_name(20),))
    assert [e.step for e in referrers_first([a, b, c])] == [30, 20, 10]
    cycle = [entry(1, bases=(checkpoint_name(2),)), entry(2, bases=(checkpoint_name(1),))]
    assert sorted(e.step for e in referrers_first(cycle)) == [1, 2]  # a hostile cycle still ends
