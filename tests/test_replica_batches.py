"""ReplicaBatches: the exact data rule under torchft, as replica groups leave, fail a step, heal and rejoin.

The expectations are built from the stated rule alone: numpy's ``PCG64([seed, epoch])`` permutation, global batches
of ``batch_size * group_size`` consecutive samples, a tail shorter than a step's batches dropped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckptfmt.errors import ContextError, UsageError
from ckptfmt.torch import CheckpointManager, ReplicaBatches, ResumableSampler, StepRecord, TrainingState, data_position

N, SEED, B, G = 50, 7, 2, 2  # 50 samples, batches of 2 per rank, 2 ranks per replica group: global batches of 4


def perm(epoch: int, n: int = N, seed: int = SEED) -> list[int]:
    return list(np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n).tolist())


def group(**kwargs: Any) -> list[ReplicaBatches]:
    """One replica group: a ReplicaBatches per rank."""
    return [ReplicaBatches(N, batch_size=B, seed=SEED, group_rank=g, group_size=G, **kwargs) for g in range(G)]


@dataclass
class Job:
    """Replica groups by name, and what the job as a whole trained on: the samples handed to every participating
    rank in the steps that committed, in (step, replica rank, group rank) order."""

    groups: dict[str, list[ReplicaBatches]]
    consumed: list[int] = field(default_factory=list)
    commits: int = 0
    batches: int = 0

    def step(self, step: int, participants: list[str], *, healing: str | None = None, commits: bool = True) -> None:
        p = len(participants)
        assert set(self.groups) == {*participants, *([healing] if healing else [])}  # every live group takes part
        handed = [
            [ranks[g].indices(r, p) for g in range(G)] for r, ranks in enumerate(self.groups[n] for n in participants)
        ]
        assert all(len(batch) == B for batches in handed for batch in batches)
        if healing is not None:  # torchft zeroes its gradients: it is handed rank 0's batch, and consumes nothing
            assert [b.indices(None, p) for b in self.groups[healing]] == handed[0]
        if not commits:
            return
        for r, name in enumerate(participants):
            for b in self.groups[name]:
                b.commit(p, step=step, replica_rank=r)
        for b in self.groups[healing] if healing is not None else []:
            b.commit(p, step=step)
        self.consumed += [i for batches in handed for batch in batches for i in batch]
        self.commits, self.batches = self.commits + 1, self.batches + p

    def heal(self, name: str, sender: str) -> None:
        """A replacement of group ``name`` (a fresh process, at position 0) takes the state of ``sender``'s ranks."""
        self.groups[name] = group()
        for mine, theirs in zip(self.groups[name], self.groups[sender], strict=True):
            mine.load_state_dict(copy.deepcopy(theirs.state_dict()))


def test_groups_leave_fail_heal_and_rejoin_and_the_job_sees_each_sample_once() -> None:
    job = Job({name: group() for name in "ABC"})
    job.step(1, ["A", "B", "C"])  # 12 samples of epoch 0 each step
    job.step(2, ["A", "B", "C"])
    job.step(3, ["A", "B", "C"], commits=False)  # C dies mid-step: nothing is consumed
    del job.groups["C"]
    job.step(3, ["A", "B"])  # the survivors take the step again, without C
    job.step(4, ["A", "B"])
    job.heal("C", sender="A")  # a replacement heals from A, and sits this step out
    job.step(5, ["A", "B"], healing="C")  # 48 of 50 taken
    job.step(6, ["A", "B", "C"])  # 2 left < 3 global batches: epoch 0's tail is dropped, epoch 1 starts
    del job.groups["B"]
    job.step(7, ["A", "C"])
    job.heal("B", sender="C")
    job.step(8, ["A", "C"], healing="B")
    job.step(9, ["A", "B", "C"])  # 40 of epoch 1 taken
    job.step(10, ["A", "B", "C"], commits=False)  # would drop a tail of 10, but C dies and the step does not commit
    del job.groups["C"]
    job.step(10, ["A", "B"])  # 8 fit: the tail shrinks to 2
    job.heal("C", sender="B")
    job.step(11, ["A", "B"], healing="C")  # a tail of 2 dropped, epoch 2
    job.step(12, ["A", "B", "C"])
    assert job.consumed == perm(0)[:48] + perm(1)[:48] + perm(2)[:20]
    for epoch, taken in enumerate((job.consumed[:48], job.consumed[48:96])):
        dropped = set(perm(epoch)[48:])
        assert len(set(taken)) == 48 and len(dropped) == 2  # none twice, and exactly the tail left out
        assert set(taken) | dropped == set(range(N)) and not set(taken) & dropped
    positions = {
        (b.state_dict()["epoch"], b.state_dict()["sampler"]["position"]) for r in job.groups.values() for b in r
    }
    assert positions == {(2, 20)}  # the same on every rank of every group
    for ranks in job.groups.values():
        for b in ranks:
            assert b.committed_batches == job.batches == 3 + 3 + 2 + 2 + 2 + 3 + 2 + 2 + 3 + 2 + 2 + 3
    a, b_ = job.groups["A"][0], job.groups["B"][0]
    assert [r.step for r in a.record] == list(range(1, 13)) and len(a.record) == job.commits
    assert a.record[4] == StepRecord(step=5, participants=2, replica_rank=0, first_batch=10)
    assert b_.record[7] == StepRecord(step=8, participants=2, replica_rank=None, first_batch=17)  # B was healing
    assert b_.record[6].replica_rank == 1  # taken over from its sender, C


def test_a_step_that_does_not_commit_moves_nothing() -> None:
    b = group()[1]
    before = b.state_dict()
    first = b.indices(0, 3)
    assert b.indices(0, 3) == first and b.state_dict() == before
    assert b.indices(1, 2) == perm(0)[6:8] and b.indices(None, 2) == first == perm(0)[2:4]


def test_the_tail_is_decided_by_position_and_participants_alone() -> None:
    b = ReplicaBatches(N, batch_size=B, seed=SEED, group_size=G)
    for step in range(1, 12):
        b.commit(1, step=step)  # 44 taken, 6 left
    assert b.indices(0, 1) == perm(0)[44:46]  # one global batch fits
    assert b.indices(0, 2) == perm(1)[:2]  # two do not: from the next epoch
    b.commit(2, step=12)
    assert b.state_dict()["epoch"] == 1 and b.state_dict()["global_sample_offset"] == 8
    with pytest.raises(UsageError, match="more than an epoch holds"):
        b.indices(0, 13)


def test_commit_and_indices_refuse_what_would_break_the_rule() -> None:
    b = group()[0]
    b.commit(2, step=5, replica_rank=1)
    with pytest.raises(UsageError, match="each step commits once"):
        b.commit(2, step=5)
    for replica_rank, participants in ((2, 2), (-1, 2), (0, 0), (None, 0)):
        with pytest.raises(UsageError):
            b.indices(replica_rank, participants)
    with pytest.raises(UsageError, match="no shard"):
        b.quarantine("x")
    assert b.committed_batches == 2 and len(b.record) == 1


def test_trim_record_drops_what_a_durable_save_holds() -> None:
    b = group()[0]
    for step in (1, 2, 3, 4):
        b.commit(3, step=step, replica_rank=2)
    b.trim_record(2)
    assert b.record == (
        StepRecord(step=3, participants=3, replica_rank=2, first_batch=6),
        StepRecord(step=4, participants=3, replica_rank=2, first_batch=9),
    )
    fresh = group()[0]
    fresh.load_state_dict(b.state_dict())  # a trimmed record still follows on up to committed_batches
    assert fresh.record == b.record and fresh.committed_batches == 12


def test_quarantine_leaves_a_shard_out_from_the_next_step_on() -> None:
    groups = [group(shard_size=10), group(shard_size=10)]
    everyone = [b for ranks in groups for b in ranks]
    handed: list[int] = []

    def step(number: int, quarantine_mid_step: str | None = None) -> None:
        batches = [b.indices(r, 2) for r, ranks in enumerate(groups) for b in ranks]
        for b in everyone if quarantine_mid_step else []:
            b.quarantine(quarantine_mid_step)  # the step in flight keeps what it was handed
        for r, ranks in enumerate(groups):
            for b in ranks:
                b.commit(2, step=number, replica_rank=r)
        handed.extend(i for batch in batches for i in batch)

    step(1)
    for b in everyone:
        b.quarantine(2)
    step(2)
    step(3, quarantine_mid_step="3")
    step(4)
    order = perm(0)
    after_first = [i for i in order[8:] if i // 10 != 2]
    after_third = [i for i in after_first[16:] if i // 10 != 3]
    assert any(i // 10 == 2 for i in order[8:16]) and any(i // 10 == 3 for i in handed[16:24])  # both matter here
    assert handed == order[:8] + after_first[:16] + after_third[:8]
    assert not any(i // 10 == 2 for i in handed[8:]) and not any(i // 10 == 3 for i in handed[24:])
    assert everyone[3].state_dict()["quarantined_shards"] == ["2", "3"]


# ---------------------------------------------------------------- state


def advanced() -> ReplicaBatches:
    b = ReplicaBatches(N, batch_size=B, seed=SEED, group_rank=1, group_size=G, shard_size=10)
    b.quarantine(4)
    for step, p in ((1, 3), (2, 3), (3, 2)):
        b.commit(p, step=step, replica_rank=p - 1)
    return b


def test_the_state_is_the_data_field() -> None:
    state = advanced().state_dict()
    assert state["epoch"] == 0 and state["global_sample_offset"] == 32 and state["quarantined_shards"] == ["4"]
    assert state["sampler"] == {
        "kind": "ckptfmt.replica_batches",
        "seed": SEED,
        "shuffle": True,
        "num_samples": N,
        "shard_size": 10,
        "position": state["sampler"]["position"],
        "batch_size": B,
        "group_size": G,
        "committed_batches": 8,
        "record": [[1, 3, 2, 0], [2, 3, 2, 3], [3, 2, 1, 6]],
    }
    assert state["sampler"]["position"] > 32  # shard 4's samples passed over are not counted as consumed


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_round_trip_through_the_checkpoint_manager(tmp_path: Path) -> None:
    model, opt = _model()
    b = ReplicaBatches(N, batch_size=B, seed=SEED, group_rank=1, group_size=G)
    for step in (1, 2, 3):
        x = torch.tensor([[float(i)] * 3 for i in b.indices(0, 2)])
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        b.commit(2, step=step, replica_rank=0)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, TrainingState(model=model, optimizer=opt, sampler=b, config={}))
    model2, opt2 = _model()
    resumed = ReplicaBatches(N, batch_size=B, seed=SEED, group_rank=1, group_size=G)
    with CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore_latest(TrainingState(model=model2, optimizer=opt2, sampler=resumed, config={})) == 3
    assert resumed.state_dict() == b.state_dict() and resumed.record == b.record
    assert resumed.indices(1, 3) == b.indices(1, 3) == perm(0)[30:32]
    other_rank = ReplicaBatches(N, batch_size=B, seed=SEED, group_rank=0, group_size=G)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.restore_latest(TrainingState(model=model2, optimizer=opt2, sampler=other_rank, config={}))
    assert other_rank.group_rank == 0 and other_rank.indices(1, 3) == perm(0)[28:30]  # its rank stays its own
    wrong = ReplicaBatches(N, batch_size=3, seed=SEED, group_rank=1, group_size=G)
    with CheckpointManager(tmp_path / "run") as mgr, pytest.raises(ContextError, match="batch_size"):
        mgr.restore_latest(TrainingState(model=model2, optimizer=opt2, sampler=wrong, config={}))
    assert wrong.committed_batches == 0


def test_a_refused_position_is_refused_before_anything_is_applied() -> None:
    b = advanced()
    data = b.state_dict()
    data["sampler"]["batch_size"] = 3
    with pytest.raises(ContextError, match="batch_size"):
        data_position.check_restorable(b, data)  # the check apply() runs first, before any field is applied
    data = {**b.state_dict(), "epoch": -1}  # ResumableSampler's part of the check runs there too
    with pytest.raises(ContextError, match="epoch"):
        data_position.check_restorable(b, data)
    resumable = ResumableSampler(N, seed=SEED).state_dict()
    with pytest.raises(ContextError, match=r"sampler\.kind"):
        data_position.check_restorable(b, resumable)
    with pytest.raises(ContextError, match="not written by a ResumableSampler"):
        data_position.check_restorable(ResumableSampler(N, seed=SEED), b.state_dict())


def _set(path: str, value: object) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = state
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value

    return mutate


def _record(entries: list[Any], committed: int = 8) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        state["sampler"]["record"], state["sampler"]["committed_batches"] = entries, committed

    return mutate


HOSTILE = [
    (_set("sampler", KeyError), "sampler.kind"),
    (_set("sampler.kind", "ckptfmt.resumable"), "sampler.kind"),
    (_set("sampler.seed", SEED + 1), "seed"),
    (_set("sampler.seed", KeyError), "seed"),
    (_set("sampler.shuffle", False), "shuffle"),
    (_set("sampler.num_samples", N + 1), "num_samples"),
    (_set("sampler.batch_size", B + 1), "batch_size"),
    (_set("sampler.batch_size", [B]), "batch_size"),
    (_set("sampler.group_size", G + 1), "group_size"),
    (_set("sampler.committed_batches", -1), "committed_batches"),
    (_set("sampler.committed_batches", "8"), "committed_batches"),
    (_set("sampler.committed_batches", 1 << 70), "committed_batches"),
    (_set("sampler.record", "x"), r"sampler\.record"),
    (_record([[1, 3, 2]]), r"sampler\.record\[0\]"),
    (_record([[1, 0, None, 8]]), r"sampler\.record\[0\]"),
    (_record([[1, 3, 3, 5]]), r"sampler\.record\[0\]"),
    (_record([[True, 3, 0, 5]]), r"sampler\.record\[0\]"),
    (_record([[1.0, 3, 0, 5]]), r"sampler\.record\[0\]"),
    (_record([[1, 3, 0, 2], [2, 3, 0, 6]]), r"sampler\.record\[1\]"),  # batches 5..5 missing
    (_record([[2, 3, 0, 2], [2, 3, 0, 5]]), r"sampler\.record\[1\]"),  # a step twice
    (_record([[1, 3, 0, 2]], committed=9), "committed_batches"),
    (_record([[i, 1, None, i] for i in range(100_001)], committed=100_001), "at most 100000"),
    (_set("epoch", -1), "epoch"),
    (_set("global_sample_offset", N + 1), "global_sample_offset"),
    (_set("sampler.position", 10**9), "sampler.position"),
    (_set("sampler.shard_size", 0), "shard_size"),
    (_set("quarantined_shards", ["abc"]), "quarantined_shards"),
    (_set("quarantined_shards", "4"), "quarantined_shards"),
]


@pytest.mark.parametrize(("mutate", "key"), HOSTILE)
def test_a_hostile_state_is_refused_naming_the_key_and_changes_nothing(mutate: Any, key: str) -> None:
    b = advanced()
    before, upcoming = b.state_dict(), b.indices(0, 2)
    bad = copy.deepcopy(before)
    mutate(bad)
    with pytest.raises(ContextError, match=key) as err:
        b.load_state_dict(bad)
    assert err.value.field == "data"
    assert b.state_dict() == before and b.indices(0, 2) == upcoming
    fresh = ReplicaBatches(N, batch_size=B, seed=SEED, group_rank=1, group_size=G, shard_size=10)
    fresh.load_state_dict(copy.deepcopy(before))  # the unmutated state is taken: the refusal was the mutation's
    assert fresh.state_dict() == before
