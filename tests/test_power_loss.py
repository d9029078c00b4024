"""Simulated power loss (issue 9): the disk keeps only what was fsynced, at any moment of a run's saves.

See tests/crash/powerloss.py for the model. CI cuts the power at a sample of moments;
``CKPTFMT_RELIABILITY=full`` (or scripts/reliability.py) after every traced call.
"""

from __future__ import annotations

import random
from pathlib import Path

from crash import payload, powerloss, size

from ckptfmt.run import checkpoint_name


def test_power_cut_at_any_moment_leaves_nothing_loadable_but_wrong(tmp_path: Path) -> None:
    cuts = size(40, 10**9)
    figures = powerloss.power_loss(tmp_path, cuts=cuts)
    assert not figures.wrong, "\n".join(figures.wrong[:20])
    assert not figures.wrong_while_deleting, "\n".join(figures.wrong_while_deleting[:20])
    assert figures.cuts == min(cuts, figures.cuts) and figures.refused > 0 and figures.whole > 0


def test_partly_persisted_unsynced_changes_leave_nothing_loadable_but_wrong(tmp_path: Path) -> None:
    """A crash may also persist some changes nobody synced; none may make a checkpoint loadable but wrong."""
    figures = powerloss.power_loss(tmp_path, cuts=0, adversarial_every=size(60, 3), variants=size(2, 4), seed=1)
    assert figures.adversarial > 0
    assert not figures.wrong, "\n".join(figures.wrong[:20])


def _recorded(tmp_path: Path, adversarial_every: int = 0) -> powerloss.Recorder:
    recorder = powerloss.Recorder(tmp_path / "run", adversarial_every=adversarial_every)
    with powerloss.recording(recorder):
        powerloss.run_workload(recorder)
    return recorder


# Defect D1, found by this harness and fixed: commit() never fsyncs the directory holding the checkpoint root (here
# the run directory), so a power cut before the next fsync of that directory (set_latest) loses a checkpoint whose
# commit returned.
def test_power_cut_right_after_a_commit_returned_keeps_that_checkpoint(tmp_path: Path) -> None:
    recorder = _recorded(tmp_path)
    for event in recorder.events:
        if event.what != "committed":
            continue
        dest = tmp_path / f"after-commit-{event.step}"
        powerloss.materialize(recorder.states[event.index], dest)
        verdict = payload.judge(str(dest / checkpoint_name(event.step)), event.step)
        assert verdict.outcome == "whole", f"step {event.step}: {verdict}"


# Defect D2, found by this harness and fixed: RunDirectory.delete unlinks the manifest and then the data files with
# no fsync between,  so a crash may keep the manifest and lose data files: a checkpoint that opens but does not
# verify",
def test_retention_delete_is_never_seen_half_done(tmp_path: Path) -> None:
    recorder = _recorded(tmp_path)
    last = len(recorder.calls)  # step 1 was deleted by retention during the third save
    durable = recorder.states[last]
    step1 = durable.dirs[durable.root][checkpoint_name(1)][0]
    current = recorder.scan()
    # The worst order a crash may keep: step 1's manifest unlink lost (its directory as last synced), every
    # other unsynced change (the data files' unlinks, in their own directories) persisted.
    state = powerloss.adversarial(durable, current, _always(), keep=frozenset({step1}))
    state.dirs[durable.root] = durable.dirs[durable.root]
    powerloss.materialize(state, tmp_path / "cut")
    verdict = payload.judge(str(tmp_path / "cut" / checkpoint_name(1)), 1)
    assert verdict.outcome != "wrong", verdict.detail


def _always() -> random.Random:
    class Always(random.Random):
        def random(self) -> float:
            return 0.0  # every directory and file takes its current state

    return Always()
