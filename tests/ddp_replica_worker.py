"""A data-parallel job on 2 "nodes" (A, B) with replicated memory snapshots (tests/test_ddp_replicas.py): DDP on
2 ranks (one a node), or with ``--hsdp`` FSDP2 on a (replicate=2, shard=2) mesh of 4 ranks (two a node), whose
replicate dimension spans the nodes.

A rank's partner holds the same state (DDP: all of it; HSDP: the same shards), so each rank writes its partner's
share into its copy directory from its own state and only what differs crosses the network. ``--diverge`` makes
rank 1's weights differ from its replica's before the last snapshot (as a bug or a non-deterministic kernel
would): the local copy then fails the manifest's digests and the real files are sent instead.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckptfmt.torch import CheckpointManager, ResumableSampler


def main() -> None:
    run_dir, shm, out = sys.argv[1], sys.argv[2], sys.argv[3]
    diverge = "--diverge" in sys.argv
    hsdp = "--hsdp" in sys.argv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = "AB"[rank * 2 // world]
    os.environ["CKPTFMT_NODE_KEY"] = node
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        model: nn.Module = fully_shard(inner, mesh=mesh)
    else:
        model = DistributedDataParallel(inner)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(run_dir, memory_every=1, memory_dir=os.path.join(shm, node), replicate=True)
    gen = torch.Generator().manual_seed(rank)
    sampler = ResumableSampler(64, seed=1)
    for step in range(1, 4):
        sampler.advance(4)
        model(torch.randn(4, 256, generator=gen)).sum().backward()
        opt.step()
        opt.zero_grad()
        if diverge and step == 3 and rank == 1:
            with torch.no_grad():
                model.module[0].weight[0, 0] += 1.0  # type: ignore[index, union-attr, operator]
        mgr.checkpoint_if_due(step, every=1000, model=model, optimizer=opt, config={"a": 1}, sampler=sampler)
        mgr.wait_replica()
    rep = mgr._memory.replicator if mgr._memory is not None else None
    assert rep is not None
    doc = {"sent": rep.bytes_sent, "received": rep.bytes_received, "skipped": rep.skipped_bytes}
    doc["failures"] = rep.failures
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(doc, f)
    mgr.close(persist=False)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without freeing the model: freeing DDP's reducer joins gloo's worker thread while holding the GIL,
    # which that thread may be waiting for (a hang seen in tests/accelerate_worker.py, whose leave() says more).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
