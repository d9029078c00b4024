"""Lose a whole rack, keep every replicated step (spec/memory.md, MEM-19): six nodes of one rank in three racks.

A node is a set of ranks with its own ``CKPTFMT_NODE_KEY`` and memory directory (``--node-of-rank``), and a rack a
failure-domain label (``--domain-of-rank``: ``CKPTFMT_FAILURE_DOMAIN``). Each job snapshots every step, replicates
each, and every rank dies after step 3; then the memory of a rack's nodes is deleted (the rack lost power).

- One replica, placed by domain: the four survivors restore step 3 (0 replicated steps lost), the very checkpoint
  the job committed (its id, every chunk verified against its digests).
- One replica, placed by node order alone (no labels): each node's copy is on its rack neighbour, lost with it; the
  survivors cannot restore step 3, nor any step (the negative control: the test can fail).
- Two replicas: two racks lost, and the two survivors of the third still restore step 3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import warm_server

from ckptfmt.tier.ring import read_slot
from tests.concurrent_runs import Jobs

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

CKPT = Path(sys.executable).with_name("ckpt")
TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
STEPS, LOST_AT = 6, 3
NODES = ["n0", "n1", "n2", "n3", "n4", "n5"]
RACKS = ["rack-a", "rack-a", "rack-b", "rack-b", "rack-c", "rack-c"]
JOB = "ckptfmt-rack-loss-test"


def torchrun(tmp: Path, job: str, ranks: list[int], *args: str, ok: bool = True) -> str:
    """The ranks of nodes ``NODES[r]`` for ``r`` in ``ranks`` (one a node), as job ``job`` (one run id across its
    restart, as a relaunched job keeps it)."""
    options = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={JOB}-{job}"]
    options += ["--nnodes=1", f"--nproc-per-node={len(ranks)}", "--max-restarts=0", "--monitor-interval=0.2"]
    nodes = ["--node-of-rank", ",".join(NODES[r] for r in ranks)]
    script = ["--steps", str(STEPS), "--every", "100", "--memory-every", "1", "--replicate", *nodes, *args]
    script += ["--run-dir", str(tmp / job / "run"), "--memory-dir", str(tmp / job / "shm")]
    cmd = warm_server.shared().torchrun(options, TRAIN, *script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    if ok:
        assert proc.returncode == 0, f"{job}: " + proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def scenario(tmp: Path, job: str, lost: list[str], *args: str) -> dict[str, Any]:
    """Six nodes train and all die after step 3's replica; the ``lost`` racks' memory goes; the rest restart."""
    first = torchrun(tmp, job, list(range(6)), *args, "--replica-sync", "--lose-node-at-step", str(LOST_AT), ok=False)
    held = {}  # the step-3 snapshot's checkpoint id, read from a surviving node's own slot
    for slot in (tmp / job / "shm").glob("*/run-*/slot-*"):
        found = read_slot(slot)
        if found.step == LOST_AT:
            held[found.path.split(os.sep)[-3]] = found.checkpoint_id
    for r, rack in enumerate(RACKS):
        if rack in lost:
            shutil.rmtree(tmp / job / "shm" / NODES[r])  # the rack lost power, and its nodes' memory with it
    survivors = [r for r, rack in enumerate(RACKS) if rack not in lost]
    domains = ["--domain-of-rank", ",".join(RACKS[r] for r in survivors)] if "--domain-of-rank" in args else []
    rest = [a for a in args if a not in ("--domain-of-rank", ",".join(RACKS))]
    then = torchrun(tmp, job, survivors, *rest, *domains, "--stop-at-step", str(LOST_AT + 1))
    report = re.search(r"restore report: (\{.*\})", then)
    ls = subprocess.run([CKPT, "ls", "--json", str(tmp / job / "run")], capture_output=True, text=True, check=False)
    text = subprocess.run([CKPT, "ls", str(tmp / job / "run")], capture_output=True, text=True, check=False)
    return {
        "ls_text": text.stdout + text.stderr,
        "ls": json.loads(ls.stdout) if ls.returncode == 0 else ls.stderr,
        "first": first,
        "then": then,
        "held": held,
        "resumed": int(re.findall(r"(?:resumed at|starting at) step (\d+)", then)[0]),
        "report": json.loads(report.group(1)) if report else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rack-loss")
    labels = ("--domain-of-rank", ",".join(RACKS))
    jobs = Jobs(workers=2)  # two cores: two six-rank jobs side by side at most
    jobs.add("domains", lambda: scenario(tmp, "domains", ["rack-a"], *labels))
    jobs.add("order", lambda: scenario(tmp, "order", ["rack-a"]))
    jobs.add("two", lambda: scenario(tmp, "two", ["rack-a", "rack-b"], *labels, "--replicas", "2"))
    jobs.run()
    return {name: jobs[name] for name in ("domains", "order", "two")}


def assert_restored_step_3(got: dict[str, Any]) -> None:
    assert re.findall(r"replica of step (\d+) is in", got["first"]) == [str(LOST_AT)] * 6, got["first"][-3000:]
    assert got["resumed"] == LOST_AT, got["then"][-3000:]
    report = got["report"]
    assert report["tier"] in ("memory", "peer") and report["skipped"] == [], report  # 0 replicated steps lost
    assert set(got["held"].values()) == {report["checkpoint_id"]}, (got["held"], report)  # the very checkpoint


def test_one_replica_placed_by_domain_survives_a_rack(runs: dict[str, dict[str, Any]]) -> None:
    assert_restored_step_3(runs["domains"])


def test_one_replica_placed_by_node_order_loses_the_rack_s_steps(runs: dict[str, dict[str, Any]]) -> None:
    got = runs["order"]
    assert re.findall(r"replica of step (\d+) is in", got["first"]) == [str(LOST_AT)] * 6, got["first"][-3000:]
    assert got["resumed"] == 0, got["then"][-3000:]  # every copy of n0's and n1's files was in their own rack


def test_two_replicas_survive_two_racks(runs: dict[str, dict[str, Any]]) -> None:
    assert_restored_step_3(runs["two"])
    assert set(runs["two"]["held"]) >= {"n4", "n5"}


def test_ckpt_ls_shows_which_domains_hold_each_rank_s_files(runs: dict[str, dict[str, Any]]) -> None:
    """The survivors' final save (step 4, on racks c alone, two replicas where only one other node exists)."""
    shown = runs["two"]["ls"]["replicas"]
    assert shown["replicas"] == 2 and shown["step"] == LOST_AT + 1, shown
    assert [(r["node"], r["domain"], r["copies"]) for r in shown["ranks"]] == [
        ("n4", "rack-c", ["rack-c"]),
        ("n5", "rack-c", ["rack-c"]),
    ], shown
    assert "rank 1: rack-c (node n5); copies in rack-c" in runs["two"]["ls_text"], runs["two"]["ls_text"]
    shown = runs["domains"]["ls"]["replicas"]
    assert [r["copies"] for r in shown["ranks"]] == [["rack-c"], ["rack-c"], ["rack-b"], ["rack-b"]], shown
