"""Lose a node, keep every replicated step (spec/memory.md, MEM-9 to MEM-12): two nodes of two FSDP2 ranks over gloo.

A node here is a set of ranks with its own ``CKPTFMT_NODE_KEY`` and memory directory (``--node-of-rank``).

- Four ranks on nodes A and B, a memory snapshot every step, each replicated to the other node. After step 5
  every rank dies and node B's memory directory is deleted: the node is gone.
- The survivors (two ranks on A) restore step 5 (0 replicated steps lost) from A's own slot and the copies of
  B's files that A holds, reshard 4 -> 2, and train to step 8.
- Node B comes back with empty memory, its ranks now first in rank order: four ranks restore step 8, B's ranks
  getting their files from A's memory over gloo (every byte checked), and train to step 12.
- B's files of step 5 damaged in the only copy left: every survivor passes over the memory step and takes the
  durable save of step 5.

A reference resumes the durable save of step 5 through the same world sizes from durable checkpoints only; the two
must agree bit for bit: every later step's loss, and the final checkpoint's weights, optimizer state, RNG and data
position.
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

from tests.concurrent_runs import Jobs

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
CKPT = Path(sys.executable).with_name("ckpt")
STEPS, LOST_AT, BACK_AT = 12, 5, 8
JOB = "ckptfmt-node-loss-test"


def torchrun(tmp: Path, name: str, nproc: int, *args: str, ok: bool = True) -> str:
    """``name`` without its digits is the job (one run id, as a relaunched job keeps it): ``mem``, ``ref``. Forked
    warm (tests/warm_server.py), the reference's processes from a server of their own: another string-hash seed."""
    job = f"{JOB}-{name.rstrip('0123456789')}"
    options = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={job}"]
    options += ["--nnodes=1", f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.2"]
    script = ["--steps", str(STEPS), "--every", "100", "--keep-last", "100", *args]
    cmd = warm_server.shared("other" if name.startswith("ref") else "default").torchrun(options, TRAIN, *script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    if ok:
        assert proc.returncode == 0, f"{name}: " + proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("node-loss")
    shm = tmp / "shm"
    mem = ["--run-dir", str(tmp / "run"), "--losses-out", str(tmp / "run.json"), "--memory-every", "1", "--every", "5"]
    mem += ["--memory-dir", str(shm), "--replicate", "--replica-sync"]
    ref = ["--run-dir", str(tmp / "ref"), "--losses-out", str(tmp / "ref.json")]

    def lost() -> str:
        out = torchrun(tmp, "mem1", 4, *mem, "--node-of-rank", "A,A,B,B", "--lose-node-at-step", str(LOST_AT), ok=False)
        shutil.rmtree(shm / "B")  # the node is gone, and its memory with it
        return out

    def damaged(_: str) -> str:
        """Node B's files of step 5 bad in the only copy left (and step 4's too): every survivor passes over the
        memory step, alike, and restores the durable save of step 5. Read-only: it stops before training."""
        # on a copy of node A's memory (slots are found by run directory, not by where the memory directory is):
        # the survivors' restore reads the undamaged one
        copy = tmp / "shm-damaged"
        shutil.copytree(shm / "A", copy / "A")
        for pattern in ("peer-00002-0", "peer-00003-1"):
            (where,) = list(copy.glob(f"A/run-*/{pattern}"))
            target = next(where.glob("optimizer/r0000*-00000.safetensors"))
            data = target.read_bytes()
            target.write_bytes(data[:-9] + bytes([data[-9] ^ 4]) + data[-8:])
        damaged_mem = [
            *mem[: mem.index("--memory-dir")],
            "--memory-dir",
            str(copy),
            *mem[mem.index("--memory-dir") + 2 :],
        ]
        return torchrun(tmp, "mem2", 2, *damaged_mem, "--node-of-rank", "A,A", "--stop-at-step", "1")

    def survivors(_: str) -> str:
        survivors = ["--node-of-rank", "A,A", "--stop-at-step", str(BACK_AT), "--report-out", str(tmp / "survivors")]
        return torchrun(tmp, "mem2", 2, *mem, *survivors)

    def back(*_: str) -> str:
        # node B returns ahead of A in rank order: shards are found by what they are, not by who held them
        return torchrun(tmp, "mem3", 4, *mem, "--node-of-rank", "B,B,A,A")

    def reference(_: str) -> str:
        """From the durable save of step 5 (the run made it from its memory snapshot: the same checkpoint id), the
        same world sizes at the same steps, from disk only."""
        name = f"step-{LOST_AT:09d}"
        shutil.copytree(tmp / "run" / name, tmp / "ref" / name)
        return torchrun(tmp, "ref2", 2, *ref, "--stop-at-step", str(BACK_AT))

    jobs = Jobs(workers=3)  # most of a launch is single-threaded start-up: three side by side on two cores
    jobs.add("lost", lost)
    jobs.add("damaged", damaged, "lost")
    jobs.add("ref2", reference, "lost")
    jobs.add("survivors", survivors, "damaged")  # not meanwhile: the survivors' durable save of step 8 would be newer
    jobs.add("back", back, "survivors", "damaged")
    jobs.add("ref3", lambda _: torchrun(tmp, "ref3", 4, *ref), "ref2")
    jobs.run()
    return {"tmp": tmp, **{name: jobs[name] for name in ("lost", "damaged", "survivors", "back", "ref3")}}


def report(out: str) -> dict[str, Any]:
    found = re.search(r"restore report: (\{.*\})", out)
    assert found is not None, out[-3000:]
    return dict(json.loads(found.group(1)))


def test_the_survivors_restore_the_last_replicated_step_from_memory(runs: dict[str, Any]) -> None:
    replicated = {int(s) for s in re.findall(r"replica of step (\d+) is in", runs["lost"])}
    assert replicated == {LOST_AT}, runs["lost"][-3000:]
    got = report(runs["survivors"])
    assert got["step"] == LOST_AT and got["skipped"] == [], got  # 0 replicated steps lost
    ranks = [json.loads((runs["tmp"] / f"survivors.rank{r}.json").read_text()) for r in range(2)]
    # FSDP 4 -> 2: rank 1 holds what saved ranks 2 and 3 (node B) held; it reads them from the copies on A
    assert ranks[1]["tier"] == "peer", ranks[1]
    assert ranks[1]["sources"]["weights/r00002-00000.safetensors"] == "peer-copy", ranks[1]
    assert ranks[0]["sources"]["weights/r00000-00000.safetensors"] == "memory", ranks[0]
    assert all(r["bytes_between_nodes"] == 0 for r in ranks)  # nothing crossed the network: A had it all


def test_a_bad_copy_makes_every_rank_take_the_next_holder_and_both_bad_the_durable_checkpoint(
    runs: dict[str, Any],
) -> None:
    got = report(runs["damaged"])
    assert got["tier"] == "durable" and got["step"] == LOST_AT, got
    assert [s.split(" (")[0] for s in got["skipped"]] == [f"memory step {LOST_AT}"], got  # passed over by every rank
    assert "DigestMismatchError" in runs["damaged"]  # the rank that read the bad copy said why


def test_the_returning_node_is_filled_from_the_others_memory(runs: dict[str, Any]) -> None:
    got = report(runs["back"])
    assert got["step"] == BACK_AT and got["bytes_between_nodes"] > 0, got
    record = json.loads((runs["tmp"] / "run" / "last-restore.json").read_text())
    ranks = record["ranks"]
    assert [r["tier"] for r in ranks] == ["peer", "peer", "memory", "memory"], ranks  # B's ranks (0, 1) fetched
    assert any(v.startswith("peer:rank ") for v in ranks[0]["sources"].values()), ranks[0]
    assert not list((runs["tmp"] / "shm" / "B").glob("run-*/fetched-*"))  # read, then deleted: memory is not leaked


def test_the_run_after_a_node_loss_is_bit_identical_to_one_resumed_from_disk(runs: dict[str, Any]) -> None:
    tmp: Path = runs["tmp"]
    after = [loss for loss in json.loads((tmp / "run.json").read_text())["losses"] if loss[0] > LOST_AT]
    assert after == json.loads((tmp / "ref.json").read_text())["losses"]  # steps 6-12, every bit
    final = f"step-{STEPS:09d}"
    ignore = ["--ignore", "provenance", "--ignore", "metadata.ckptfmt.memory.*"]
    diff = subprocess.run(
        [str(CKPT), "diff", *ignore, str(tmp / "ref" / final), str(tmp / "run" / final)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr
