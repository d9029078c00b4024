"""No restart under torchft, end to end on loopback: a lighthouse, replica groups as processes (the example).

One group dies mid-step (SIGKILL): the survivor keeps its process and every step, the quorum shrinks, a replacement
on a new node (an empty memory directory) heals from the survivor's memory through ckptfmt's transport, and from then
on both hold bit-identical parameters and optimizer state; the job's samples are the global order's prefix, none
twice and none skipped. A byte flipped in the offered snapshot is refused and the heal retried; a job that loses
every group resumes from each group's memory tier. Timing figures are bench/no_restart.py's, not asserted here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torchft")

from torchft_cluster import WORKER, Cluster, cluster, steps_by_number

pytestmark = pytest.mark.slow
SEED, BATCH = 1234, 8  # examples/torchft_train.py's ReplicaBatches
UNBOUNDED = 10**6  # steps: the test stops the groups (Cluster.stop) once it saw what it waits for


def global_order(samples: int) -> list[int]:
    # ckptfmt.torch.ResumableSampler's order for epoch 0, which ReplicaBatches cuts into global batches
    return [int(i) for i in np.random.Generator(np.random.PCG64([SEED, 0])).permutation(samples)]


def consumed(job: Cluster, groups: list[int]) -> list[int]:
    """The samples of every committed step, step by step and rank by rank, from every group's log."""
    by_step: dict[int, dict[int, list[int]]] = {}
    participants: dict[int, int] = {}
    for group in groups:
        for record in job.records(group):
            if record["event"] != "step" or record["rank"] is None:
                continue
            ranks = by_step.setdefault(record["step"], {})
            assert ranks.get(record["rank"], record["indices"]) == record["indices"], "two groups, one rank, one step"
            ranks[record["rank"]] = record["indices"]
            assert participants.setdefault(record["step"], record["participants"]) == record["participants"]
    out: list[int] = []
    for step in sorted(by_step):
        assert sorted(by_step[step]) == list(range(participants[step])), f"step {step}: a participant's log is missing"
        for rank in range(participants[step]):
            out.extend(by_step[step][rank])
    return out


def after(job: Cluster, group: int, pid: int, step: int) -> list[dict[str, Any]]:
    return [r for r in job.records(group) if r["event"] == "step" and r["pid"] == pid and r["step"] > step]


def test_a_lost_group_costs_the_survivor_no_restart_and_its_replacement_heals_bit_identical(tmp_path: Path) -> None:
    with cluster(tmp_path, steps=UNBOUNDED, step_sleep=0.08) as job:
        survivor = job.start(0)
        job.start(1, "--die-at-step", "12")
        died = job.wait_for(1, lambda r: r["event"] == "die")
        replacement = job.start(1, generation=1)  # a new node: its memory directory is empty
        healed = job.wait_for(1, lambda r: r["event"] == "healed" and r["pid"] == replacement.pid)
        job.until(lambda: len(after(job, 1, replacement.pid, healed["step"])) >= 5, "five steps after the heal")
        job.stop()
        assert survivor.wait(timeout=120) == 0 and replacement.wait(timeout=120) == 0, job.output(0) + job.output(1)

        mine = [r for r in job.records(0) if r["event"] == "step"]
        assert {r["pid"] for r in mine} == {survivor.pid}  # never restarted
        numbers = [r["step"] for r in mine]  # from its first step (it may have synced from group 1 at the start)
        assert numbers == list(range(numbers[0], numbers[-1] + 1))  # no step lost
        after_death = [r for r in mine if r["t"] > died["t"]]
        assert after_death[0]["participants"] == 1  # the quorum shrank around the dead group
        assert any(r["participants"] == 2 for r in after_death)  # and grew again with its replacement

        assert healed["pid"] == replacement.pid and healed["tier"] == "healed"
        assert healed["bytes_read"] > 0
        assert "(memory)" in healed["sources"]["*"] or "(live)" in healed["sources"]["*"]
        ours = steps_by_number(mine)
        theirs = after(job, 1, replacement.pid, healed["step"])
        assert len(theirs) >= 5 and all(r["digest"] == ours[r["step"]]["digest"] for r in theirs)

        samples = consumed(job, [0, 1])
        assert len(samples) == len(set(samples))  # none seen twice
        assert samples == global_order(4096)[: len(samples)]  # and none skipped: the global order's prefix


def test_a_byte_flipped_in_the_served_snapshot_is_refused_and_the_heal_retried(tmp_path: Path) -> None:
    with cluster(tmp_path, steps=UNBOUNDED, step_sleep=0.08) as job:
        survivor = job.start(0, "--flip-first-offer", script=WORKER)
        job.wait_for(0, lambda r: r["event"] == "step" and r["step"] >= 5)
        joiner = job.start(1)
        healed = job.wait_for(1, lambda r: r["event"] == "healed")
        job.until(lambda: len(after(job, 1, joiner.pid, healed["step"])) >= 5, "five steps after the heal")
        job.stop()
        assert survivor.wait(timeout=120) == 0 and joiner.wait(timeout=120) == 0, job.output(0) + job.output(1)
        assert "flipped the last byte" in job.output(0)
        assert healed["refusals"], "the damaged offer must have been refused"
        assert "does not match its manifest digest" in healed["refusals"][0]
        ours = steps_by_number(job.records(0))
        theirs = after(job, 1, joiner.pid, healed["step"])
        assert len(theirs) >= 5 and all(r["digest"] == ours[r["step"]]["digest"] for r in theirs)


def test_a_job_that_loses_every_group_resumes_from_their_memory(tmp_path: Path) -> None:
    with cluster(tmp_path, steps=20, step_sleep=0.02) as job:
        first = [job.start(0), job.start(1)]
        assert [p.wait(timeout=120) for p in first] == [0, 0], job.output(0) + job.output(1)
        ended = {g: steps_by_number(job.records(g))[20]["digest"] for g in (0, 1)}
        assert ended[0] == ended[1]
        again = [job.start(g, steps=UNBOUNDED) for g in (0, 1)]  # the same nodes: their memory directories survive
        job.until(
            lambda: all(len(after(job, g, again[g].pid, 20)) >= 5 for g in (0, 1)), "five steps each after the restart"
        )
        job.stop()
        assert [p.wait(timeout=120) for p in again] == [0, 0], job.output(0) + job.output(1)
        for group in (0, 1):
            start = next(r for r in job.records(group) if r["event"] == "start" and r["pid"] == again[group].pid)
            assert start["resumed"] == 20 and start["restored"]["tier"] == "memory"
        # a group that came up later healed from the other: from then on both hold the same state
        ours = {r["step"]: r["digest"] for r in after(job, 0, again[0].pid, 20)}
        theirs = {r["step"]: r["digest"] for r in after(job, 1, again[1].pid, 20)}
        common = sorted(set(ours) & set(theirs))
        assert common and all(ours[s] == theirs[s] for s in common)
