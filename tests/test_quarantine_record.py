"""The quarantine record of the data field (spec/fields.md FLD-13, FLD-14): samplers leave quarantined samples out of
the global order exactly, on any world size and across a resume; the record round-trips through a checkpoint, hostile
records are refused naming the member, and ``ckpt inspect`` shows it."""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import ckptfmt
from ckptfmt.errors import ContextError, UsageError
from ckptfmt.fields import check_standard_field
from ckptfmt.quarantine import REASONS, QuarantineEntry
from ckptfmt.torch import (
    CheckpointManager,
    ReplicaBatches,
    ResumableDataLoader,
    ResumableSampler,
    TrainingState,
    data_position,
)

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import PROVENANCE, run_cli

N, SEED = 96, 7


def perm(epoch: int, n: int = N) -> list[int]:
    return list(np.random.Generator(np.random.PCG64([SEED, epoch])).permutation(n).tolist())


def _take(it: Iterator[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def step(samplers: list[ResumableSampler], global_batch: int) -> list[int]:
    """One synchronous step of ``global_batch`` samples over all ranks (a fresh iterator each, as after a rollback);
    the global order consumed: rank r's i-th sample is the (i * world_size + r)-th."""
    world = len(samplers)
    per_rank = global_batch // world
    batches = [_take(iter(s), per_rank) for s in samplers]
    out = [b[i] for i in range(per_rank) for b in batches if i < len(b)]
    for s in samplers:
        s.advance(per_rank)
    return out


def ranks(world: int, **kwargs: Any) -> list[ResumableSampler]:
    return [ResumableSampler(N, seed=SEED, rank=r, world_size=world, **kwargs) for r in range(world)]


def record_dicts(entries: tuple[QuarantineEntry, ...]) -> list[str]:
    """Entries comparable with NaN values in them (NaN != NaN)."""
    return [repr(sorted({**e.to_dict(), "values": sorted(e.values.items())}.items())) for e in entries]


# ---------------------------------------------------------------- the order


def test_quarantined_samples_leave_the_next_plan_exactly_mid_epoch_and_across_the_epoch_boundary() -> None:
    (s,) = ranks(1)
    head = step([s], 30)
    assert head == perm(0)[:30]
    it = iter(s)
    ahead, behind = perm(0)[40:43], perm(0)[3:5]  # not yet consumed, and already consumed this epoch
    s.quarantine_samples([*ahead, *behind], step=5, reason="nonfinite", values={"loss": math.nan})
    assert _take(it, 20) == perm(0)[30:50]  # the iterator in flight keeps its order
    del it
    assert len(s) == N - 30 - len(ahead)
    rest = _take(iter(s), N)
    assert rest == [i for i in perm(0)[30:] if i not in ahead]  # exactly those left out, nothing else
    s.advance(len(rest))
    assert s.epoch == 1
    bad = {*ahead, *behind}
    assert list(s) == [i for i in perm(1) if i not in bad]  # the next epoch leaves out all of them
    assert s.upcoming(4) == [i for i in perm(1) if i not in bad][:4]


def test_samples_and_shards_together_and_the_record_keeps_first_entries() -> None:
    (s,) = ranks(1, shard_size=10)
    s.quarantine(2, step=3, reason="spike", values={"loss": 9.5})
    s.quarantine_samples([5, 25, 70], step=4, reason="predicate")  # 25 is in shard 2 already: recorded all the same
    s.quarantine_samples([70, 71], step=6, reason="manual")  # 70 keeps its first entry
    s.quarantine_samples([70], step=7, reason="manual")  # nothing new: no entry
    s.quarantine(2, step=8, reason="spike")  # shard 2 has its entry already
    assert [(e.step, e.samples, e.shard, e.reason) for e in s.quarantine_record] == [
        (3, (), "2", "spike"),
        (4, (5, 25, 70), None, "predicate"),
        (6, (71,), None, "manual"),
    ]
    bad = {5, 70, 71} | set(range(20, 30))
    assert list(s) == [i for i in perm(0) if i not in bad]
    state = s.state_dict()
    assert state["quarantined_shards"] == ["2"]
    assert state["quarantine"][0] == {
        "step": 3,
        "samples": [],
        "shard": "2",
        "reason": "spike",
        "values": {"loss": 9.5},
    }


def test_a_resume_on_other_world_sizes_skips_exactly_the_same_samples_and_repeats_none() -> None:
    """1 rank, then 2, then 3, against one uninterrupted rank: the same global order, quarantines applied at the
    same steps; every sample of an epoch consumed once unless quarantined before its turn."""
    late = [perm(0)[60], perm(0)[70], perm(0)[80], perm(0)[90]]
    quarantines = {2: [perm(0)[20], perm(0)[3], perm(0)[50]], 6: late, 20: [perm(1)[60]]}
    # epoch 0 keeps 90 samples (perm(0)[3] was consumed before its quarantine): 15 steps of 6 on every world size
    plan = [(1, 4), (2, 10), (3, 15)]  # (world size, steps) of the interrupted run

    def run(world_of_step: list[int]) -> list[list[int]]:
        steps: list[list[int]] = []
        samplers = ranks(world_of_step[0])
        for i, world in enumerate(world_of_step):
            if len(samplers) != world:  # a resume on another world size, from the data field
                state = samplers[0].state_dict()
                assert all(s.state_dict() == state for s in samplers)  # the position is global
                samplers = ranks(world)
                for s in samplers:
                    s.load_state_dict(copy.deepcopy(state))
            for s in samplers:
                if i in quarantines:
                    s.quarantine_samples(quarantines[i], step=i, reason="nonfinite")
            steps.append(step(samplers, 6))
        return steps

    worlds = [w for w, n in plan for _ in range(n)]
    resumed, reference = run(worlds), run([1] * len(worlds))
    assert resumed == reference
    assert all(len(batch) == 6 for batch in resumed)
    epoch0 = [i for batch in resumed[:15] for i in batch]
    epoch1 = [i for batch in resumed[15:] for i in batch]
    assert epoch0 == [i for i in perm(0) if i not in {perm(0)[20], perm(0)[50], *late}]  # none repeated or skipped
    bad = {i for q in quarantines.values() for i in q}
    assert epoch1 == [i for i in perm(1) if i not in bad][:84]


def test_a_resume_into_the_iterator_in_flight_keeps_its_order_as_the_original_did() -> None:
    """plan_record: samples quarantined after the epoch's iterator was made are left out from the next one on, by
    the original run and by a run resumed mid-epoch from it."""
    data = list(range(N))

    def loader(world: int = 1, rank: int = 0) -> ResumableDataLoader[int]:
        return ResumableDataLoader(_Items(data), batch_size=4, seed=SEED, rank=rank, world_size=world)

    original = loader()
    it = iter(original)
    got = [int(x) for _ in range(3) for x in next(it)]
    later = perm(0)[40:42]
    original.quarantine_samples(later, step=3, reason="spike", values={"loss": 12.0})
    state = original.state_dict()
    assert state["sampler"]["plan_record"] == 0 and state["quarantine"][0]["samples"] == sorted(later)
    rest = [int(x) for batch in it for x in batch]
    second = [int(x) for batch in original for x in batch]
    assert got + rest == perm(0)  # the epoch in flight kept its order
    assert second == [i for i in perm(1) if i not in later]
    resumed = loader()
    resumed.load_state_dict(copy.deepcopy(state))
    again = [int(x) for batch in resumed for x in batch]
    assert again == rest
    assert [int(x) for batch in resumed for x in batch] == second


def test_last_batch_samples_is_the_global_batch_every_rank_computes_alike() -> None:
    data = list(range(N))
    loaders = [ResumableDataLoader(_Items(data), batch_size=5, seed=SEED, rank=r, world_size=2) for r in range(2)]
    assert loaders[0].last_batch_samples() == []
    iters = [iter(x) for x in loaders]
    for k in range(N // 10 + 1):
        batches = [[int(x) for x in next(i)] for i in iters]
        handed = [b[j] for j in range(len(batches[0])) for b in batches]  # round-robin: global order
        assert loaders[0].last_batch_samples() == loaders[1].last_batch_samples() == handed
        assert handed == perm(0)[10 * k : 10 * k + 10]  # the last batch is short (96 = 9 * 10 + 6)
    loaders[0].load_state_dict(loaders[1].state_dict())
    assert loaders[0].last_batch_samples() == []


class _Items(Dataset[int]):
    def __init__(self, items: list[int]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return self.items[index]


def test_replica_batches_delegate_and_the_step_in_flight_keeps_what_it_was_handed() -> None:
    b = ReplicaBatches(N, batch_size=2, seed=SEED, group_size=1)
    first = b.indices(0, 2)
    b.quarantine_samples([perm(0)[2], perm(0)[6]], step=1, reason="nonfinite", values={"grad_norm": math.inf})
    b.commit(2, step=1, replica_rank=0)  # the step took perm[0:4] as handed, quarantine or not
    assert first == perm(0)[0:2]
    assert b.indices(0, 2) == [perm(0)[4], perm(0)[5]]  # perm[2] was consumed by the step, its record stands
    assert b.indices(1, 2) == [perm(0)[7], perm(0)[8]]  # perm[6] is left out
    state = b.state_dict()
    assert state["quarantine"] == [b.quarantine_record[0].to_dict()]
    assert b.quarantine_record[0].samples == tuple(sorted([perm(0)[2], perm(0)[6]]))
    resumed = ReplicaBatches(N, batch_size=2, seed=SEED, group_size=1)
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.indices(1, 2) == b.indices(1, 2) and record_dicts(resumed.quarantine_record) == record_dicts(
        b.quarantine_record
    )
    bad = copy.deepcopy(state)
    bad["quarantine"][0]["samples"] = [N]
    with pytest.raises(ContextError, match=r"quarantine\[0\]\.samples"):
        resumed.check_state_dict(bad)


# ---------------------------------------------------------------- the data field


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_round_trip_through_the_checkpoint_manager(tmp_path: Path) -> None:
    model, opt = _model()
    (s,) = ranks(1, shard_size=12)
    step([s], 12)
    s.quarantine_samples([1, 2, 95], step=2, reason="nonfinite", values={"loss": math.nan, "grad_norm": -math.inf})
    s.quarantine(5, step=3, reason="window")
    step([s], 12)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, TrainingState(model=model, optimizer=opt, sampler=s, config={}))
    model2, opt2 = _model()
    resumed = ResumableSampler(N, seed=SEED, rank=1, world_size=2, shard_size=12)
    with CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore_latest(TrainingState(model=model2, optimizer=opt2, sampler=resumed, config={})) == 3
    assert record_dicts(resumed.quarantine_record) == record_dicts(s.quarantine_record)
    values = resumed.quarantine_record[0].values
    assert math.isnan(values["loss"]) and values["grad_norm"] == -math.inf
    assert resumed.upcoming(N) == s.upcoming(N)
    assert not {1, 2, 95} & set(resumed.upcoming(N, from_next_epoch=True))
    assert list(resumed) == s.upcoming(N)[1::2]  # rank 1 of 2: every other sample of the same global order


def _state() -> dict[str, Any]:
    (s,) = ranks(1, shard_size=10)
    step([s], 6)
    s.quarantine_samples([3, 9], step=1, reason="nonfinite", values={"loss": 1e30})
    s.quarantine(4, step=2, reason="spike")
    return s.state_dict()


def _entry(index: int, key: str, value: object) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        if value is KeyError:
            del state["quarantine"][index][key]
        else:
            state["quarantine"][index][key] = value

    return mutate


def _whole(value: object) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        state["quarantine"] = value

    return mutate


def _more(entry: dict[str, Any]) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        state["quarantine"].append(entry)

    return mutate


def _plan_record(value: object) -> Any:
    def mutate(state: dict[str, Any]) -> None:
        state["sampler"]["plan_record"] = value

    return mutate


HOSTILE = [
    (_whole("x"), "quarantine must be an array"),
    (_whole({"step": 1}), "quarantine must be an array"),
    (_whole([{"step": 0, "samples": [1], "reason": "manual"}] * (2 * N + 1)), "more than"),
    (_whole([7]), r"quarantine\[0\] must be a map"),
    (_entry(0, "step", -1), r"quarantine\[0\]\.step"),
    (_entry(0, "step", True), r"quarantine\[0\]\.step"),
    (_entry(0, "step", 1.0), r"quarantine\[0\]\.step"),
    (_entry(0, "step", 1 << 63), r"quarantine\[0\]\.step"),
    (_entry(0, "step", KeyError), r"quarantine\[0\]\.step"),
    (_entry(0, "reason", KeyError), r"quarantine\[0\]\.reason"),
    (_entry(0, "reason", ""), r"quarantine\[0\]\.reason"),
    (_entry(0, "reason", "x" * 300), r"quarantine\[0\]\.reason"),
    (_entry(0, "samples", KeyError), r"quarantine\[0\]\.samples"),
    (_entry(0, "samples", [9, 3]), r"quarantine\[0\]\.samples.*ascending"),
    (_entry(0, "samples", [3, 3]), r"quarantine\[0\]\.samples.*ascending"),
    (_entry(0, "samples", [-1, 3]), r"quarantine\[0\]\.samples.*outside"),
    (_entry(0, "samples", [3, N]), r"quarantine\[0\]\.samples.*outside"),
    (_entry(0, "samples", [3, 1 << 70, 5]), r"quarantine\[0\]\.samples.*outside"),
    (_entry(0, "samples", [3.0]), r"quarantine\[0\]\.samples.*integers"),
    (_entry(0, "samples", [True]), r"quarantine\[0\]\.samples.*integers"),
    (_entry(0, "samples", list(range(N + 1))), r"quarantine\[0\]\.samples.*at most"),
    (_entry(0, "samples", []), r"quarantine\[0\] names no sample and no shard"),
    (_entry(0, "values", [1.0]), r"quarantine\[0\]\.values"),
    (_entry(0, "values", {"loss": "nan"}), r"quarantine\[0\]\.values\['loss'\]"),
    (_entry(0, "values", {"loss": None}), r"quarantine\[0\]\.values\['loss'\]"),
    (_entry(0, "values", {str(i): 1.0 for i in range(65)}), r"quarantine\[0\]\.values"),
    (_entry(0, "values", {"": 1.0}), r"quarantine\[0\]\.values"),
    (_entry(1, "shard", "5"), r"quarantine\[1\]\.shard '5' is not in quarantined_shards"),
    (_entry(1, "shard", 4), r"quarantine\[1\]\.shard"),
    (_more({"step": 9, "samples": [9], "reason": "manual", "values": {}}), r"quarantine\[2\]\.samples: sample 9"),
    (_more({"step": 9, "samples": [], "shard": "4", "reason": "manual"}), r"quarantine\[2\]\.shard '4' is in an"),
    (_plan_record(3), "plan_record"),
    (_plan_record(-1), "plan_record"),
    (_plan_record("0"), "plan_record"),
]


@pytest.mark.parametrize(("mutate", "member"), HOSTILE)
def test_a_hostile_record_is_refused_naming_the_member_and_changes_nothing(mutate: Any, member: str) -> None:
    state = _state()
    (s,) = ranks(1, shard_size=10)
    step([s], 12)
    s.quarantine_samples([50], step=1, reason="manual")
    before, upcoming = s.state_dict(), s.upcoming(N)
    bad = copy.deepcopy(state)
    mutate(bad)
    with pytest.raises(ContextError, match=member) as err:
        s.load_state_dict(bad)
    assert err.value.field == "data"
    with pytest.raises(ContextError, match=member):
        data_position.check_restorable(s, bad)  # refused before any field of a restore is applied
    assert s.state_dict() == before and s.upcoming(N) == upcoming
    s.load_state_dict(copy.deepcopy(state))  # the unmutated state is taken: the refusal was the mutation's
    assert s.state_dict() == state


def test_unknown_members_and_reasons_are_taken_and_the_old_call_still_works() -> None:
    state = _state()
    state["quarantine"][0]["note"] = "a member a later version defines"
    state["quarantine"][0]["reason"] = "a-later-reason"
    (s,) = ranks(1, shard_size=10)
    s.load_state_dict(state)
    assert s.quarantine_record[0].reason == "a-later-reason"
    s.quarantine("7")  # no step, no reason: left out, not recorded
    assert s.state_dict()["quarantined_shards"] == ["4", "7"] and len(s.quarantine_record) == 2
    assert "quarantine" not in ResumableSampler(N).state_dict()  # no record, no member: earlier data fields unchanged


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.quarantine_samples([], step=1, reason="manual"), "at least one"),
        (lambda s: s.quarantine_samples([N], step=1, reason="manual"), "in \\[0, 96\\)"),
        (lambda s: s.quarantine_samples([-1], step=1, reason="manual"), "in \\[0, 96\\)"),
        (lambda s: s.quarantine_samples([1.5], step=1, reason="manual"), "integer"),
        (lambda s: s.quarantine_samples([1], step=-1, reason="manual"), "step"),
        (lambda s: s.quarantine_samples([1], step=1, reason="oops"), "reason must be one of"),
        (lambda s: s.quarantine_samples([1], step=1, reason="manual", values={"loss": "x"}), "real number"),
        (lambda s: s.quarantine_samples([1], step=1, reason="manual", values={"loss": True}), "real number"),
        (lambda s: s.quarantine(1, step=1), "both step= and reason="),
        (lambda s: s.quarantine("x", step=1, reason="manual"), "no shard"),
        (lambda s: s.quarantine(10, step=1, reason="manual"), "no shard"),
    ],
)
def test_the_api_refuses_what_a_writer_must_not_write_and_changes_nothing(call: Any, message: str) -> None:
    (s,) = ranks(1, shard_size=10)
    before = s.state_dict()
    with pytest.raises(UsageError, match=message):
        call(s)
    assert s.state_dict() == before and s.quarantine_record == ()


def test_values_keep_nan_and_infinities_and_numpy_scalars() -> None:
    (s,) = ranks(1)
    s.quarantine_samples(np.array([4, 2]), step=1, reason="nonfinite", values={"loss": np.float32("nan"), "n": 3})
    (entry,) = s.quarantine_record
    assert entry.samples == (2, 4) and math.isnan(entry.values["loss"]) and entry.values["n"] == 3.0
    assert type(entry.values["n"]) is float
    assert set(REASONS) == {"nonfinite", "spike", "predicate", "window", "manual"}
    with pytest.raises(TypeError):
        entry.values["loss"] = 1.0  # type: ignore[index]


def test_the_writer_check_holds_writers_to_fld_13_and_readers_stay_lenient() -> None:
    good = _state()
    check_standard_field("data", good, writing=True)
    for bad, message in (
        ({**good, "quarantine": [{**good["quarantine"][0], "reason": "oops"}]}, "reason must be one of"),
        ({**good, "quarantine": [{**good["quarantine"][0], "values": {"loss": 1}}]}, "values must be floats"),
        ({**good, "quarantine": [{k: v for k, v in good["quarantine"][0].items() if k != "values"}]}, "'values'"),
        ({**good, "quarantined_shards": []}, "not in quarantined_shards"),
        ({**good, "quarantine": "x"}, "array"),
    ):
        with pytest.raises(ContextError, match=message):
            check_standard_field("data", bad, writing=True)
        check_standard_field("data", bad)  # what a reader runs: the optional member is the writer's responsibility


# ---------------------------------------------------------------- ckpt inspect


def _write(url: str, data: dict[str, Any]) -> None:
    with ckptfmt.open_writer(url, profile="training") as w:
        w.write_tensors("weights", {"w": np.zeros(2, np.float32)})
        w.write_tensors("optimizer", {"w.m": np.zeros(2, np.float32)})
        w.write_context("rng", {"generators": {}})
        w.write_context("data", data)
        w.write_config({"seed": 0})
        w.write_context("topology", {"world_size": 1})
        w.write_context("provenance", PROVENANCE)


def test_ckpt_inspect_shows_the_record_in_text_and_json(tmp_path: Path) -> None:
    (s,) = ranks(1, shard_size=10)
    s.quarantine_samples(list(range(20, 32)), step=12, reason="nonfinite", values={"loss": math.nan})
    s.quarantine(3, step=30, reason="spike", values={"loss": 9.5, "mean": 2.25})
    url = str(tmp_path / "ckpt")
    _write(url, s.state_dict())
    doc = run_cli("inspect", url, "--json").json()
    assert doc["context"]["data"]["quarantined_shards"] == ["3"]
    assert doc["context"]["data"]["quarantine"] == [
        {
            "step": 12,
            "samples": list(range(20, 32)),
            "reason": "nonfinite",
            "values": {"loss": "nan"},
            "from": {"epoch": 0, "position": 0},  # in effect from the start of the sampler's next pass
        },
        {"step": 30, "samples": [], "shard": "3", "reason": "spike", "values": {"loss": 9.5, "mean": 2.25}},
    ]
    run = run_cli("inspect", url)
    assert run.exit_code == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("quarantine ")]
    assert lines == [
        "quarantine   step 12  nonfinite  samples 20, 21, 22, 23, 24, 25, 26, 27, … (12 in all)  loss=nan",
        "quarantine   step 30  spike  shard 3  loss=9.5 mean=2.25",
    ]
    assert "quarantined_shards=[3]" in run.stdout and "quarantine=" not in run.stdout


def test_the_conformance_writer_check_names_fld_13(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parent.parent
    sys.path.append(str(root))  # conformance/ is a top-level directory of the repository
    from conformance.writer_checks import run_checks

    good = _state()
    bad = {**good, "quarantine": [{**good["quarantine"][0], "reason": "oops"}, good["quarantine"][1]]}
    _write(str(tmp_path / "good"), good)
    # a writer that skips its own check, as one under test might
    monkeypatch.setattr("ckptfmt.writer.check_standard_field", lambda name, value, **options: None)
    _write(str(tmp_path / "bad"), bad)
    assert run_checks(tmp_path / "good", "") == []
    assert run_checks(tmp_path / "bad", "") == [
        ("FLD-13", "quarantine[0].reason must be one of " + ", ".join(REASONS) + ", got 'oops'")
    ]
