"""Data-parallel replicas are not copied again (spec/memory.md, replicas): in a DDP job every rank holds the whole
model, and in HSDP a rank's partner on the other node holds the same shards, so a rank writes its partner's share
into its copy directory from its own state and only what differs from the manifest crosses the network; a local
copy that differs (diverged replicas) is replaced by the real files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import warm_server

from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.reader import Checkpoint
from ckptfmt.storage.overlay import OverlayStore
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier.binding import SlotBinding
from ckptfmt.tier.holdings import complete, node_holdings
from ckptfmt.tier.ring import MemoryTier
from tests.concurrent_runs import Jobs

pytestmark = pytest.mark.slow  # multi-process: left out by -m "not slow" (README)

WORKER = Path(__file__).resolve().parent / "ddp_replica_worker.py"


def job(tmp: Path, *flags: str, ranks: int = 2) -> dict[str, Any]:
    """torchrun and its workers forked warm (tests/warm_server.py)."""
    args = [str(tmp / "run"), str(tmp / "shm"), str(tmp / "out"), *flags]
    proc = subprocess.run(
        warm_server.shared().torchrun(["--standalone", f"--nproc-per-node={ranks}"], WORKER, *args),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"tmp": tmp, "ranks": [json.loads((tmp / f"out.rank{r}.json").read_text()) for r in range(ranks)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    base = tmp_path_factory.mktemp("ddp-replicas")
    jobs = Jobs(workers=2)
    jobs.add("hsdp", lambda: job(base / "hsdp", "--hsdp", ranks=4))
    jobs.add("diverged", lambda: job(base / "diverged", "--diverge"))
    return jobs.run()


def node_alone(tmp: Path, node: str) -> Checkpoint:
    """The newest checkpoint as node ``node`` alone holds it (its slot and its copies), verified whole."""
    tier = MemoryTier(tmp / "shm" / node, str(tmp / "run"))
    slot = next(tier.root.glob("slot-*"))  # the job's run id (torchrun's, random under --standalone)
    run_id = SlotBinding.from_metadata(parse_manifest((slot / "manifest.json").read_bytes()).metadata).run_id
    held, manifests = node_holdings(tier, node=node, run_id=run_id, run_dir=str(tmp / "run"), slot_count=2)
    (step, cid), *_ = complete(held, manifests)
    assert step == 3
    layers = [(h.kind, SlotStore(h.path)) for h in held if h.checkpoint_id == cid]
    return Checkpoint(OverlayStore(layers), parse_manifest(manifests[cid]), manifests[cid])


def test_a_diverged_ddp_replica_is_not_trusted_the_real_files_are_sent(runs: Jobs) -> None:
    """2 DDP ranks; rank 1's weights differ from rank 0's at step 3. What each rank rebuilt of the other's share
    still matches the manifest wherever that tensor is not (those files stay local), and fails its digests where it
    is: that file, the 256 KiB weight among them, is sent instead."""
    rank0, rank1 = runs["diverged"]["ranks"]
    assert rank0["failures"] == rank1["failures"] == []
    assert rank0["skipped"] > 0 and rank1["skipped"] > 0  # rebuilt locally, not sent
    assert rank0["sent"] + rank1["sent"] > 256 * 256 * 4  # the diverged weight's file crossed
    for node in "AB":
        assert node_alone(runs["diverged"]["tmp"], node).verify().ok  # either node alone holds the whole checkpoint


def test_hsdp_replicas_across_nodes_are_not_copied_again(runs: Jobs) -> None:
    """FSDP2 on a (replicate=2, shard=2) mesh, the replicate dimension across the nodes: each rank's partner is its
    replica, so every rank rebuilds its partner's shards and only rank 0's context blobs cross."""
    ranks = runs["hsdp"]["ranks"]
    assert all(r["failures"] == [] for r in ranks), ranks
    assert all(r["skipped"] > 0 for r in ranks), ranks
    assert [r["sent"] for r in ranks[1:]] == [0, 0, 0] and ranks[0]["sent"] < ranks[0]["skipped"], ranks
    for node in "AB":
        assert node_alone(runs["hsdp"]["tmp"], node).verify().ok
