"""One rank of a guarded run: ``python guard_worker.py OUT_DIR [options]`` under RANK/WORLD_SIZE/MASTER_* (gloo).

A linear model under DDP, AdamW, a shuffling ResumableDataLoader (each rank its share of every global batch), a
memory snapshot every step, ``mgr.guard`` between backward and optimizer step. Options:

- ``--nan-sample I``: the rank whose batch holds dataset index I has a NaN loss, on every attempt (bad data);
- ``--transient STEP:RANK``: that rank's gradients are corrupted (made infinite) at STEP, after their all-reduce,
  on the first attempt only (a transient fault: a flaky GPU); the guard sees it in the gradient norm;
- ``--quarantined I,J,...``: these samples are out of the order from the start (the clean run to compare with);
- ``--total N``: train to step N (resuming from the run directory's newest checkpoint, if any);
- ``--policy batch|shard``, ``--shard-size N``;
- ``--durable-every N``: a durable save every N steps (default: at ``--total``);
- ``--die-after N``: every rank SIGKILLs itself once step N's durable save is done (the result file is up to date).

Rank 0 writes OUT_DIR/result-<world>.json: the final parameters' digest, the guard's events, the data field's
quarantine record, and the global batch of every committed step (``loader.last_batch_samples()``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from ckptfmt.torch import CheckpointManager, MemoryOptions, ResumableDataLoader, TrainingState
from ckptfmt.torch.guard import GuardOptions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--nan-sample", type=int, default=None)
    p.add_argument("--transient", default=None)
    p.add_argument("--quarantined", default="")
    p.add_argument("--total", type=int, default=12)
    p.add_argument("--policy", default="batch")
    p.add_argument("--shard-size", type=int, default=None)
    p.add_argument("--durable-every", type=int, default=None)
    p.add_argument("--die-after", type=int, default=None)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    torch.manual_seed(0)
    n = 240
    x = torch.randn(n, 8)
    y = x.sum(1, keepdim=True)
    index = torch.arange(n)
    loader: ResumableDataLoader[Any] = ResumableDataLoader(
        TensorDataset(x, y, index), batch_size=4, seed=3, shuffle=True, shard_size=args.shard_size
    )
    quarantined = [int(i) for i in args.quarantined.split(",") if i]
    if quarantined:
        loader.resumable_sampler.quarantine_samples(quarantined, step=0, reason="manual")
    model = nn.Linear(8, 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState(model=model, optimizer=optimizer, loader=loader, config={"run": "guard"})
    mgr = CheckpointManager(
        out / "run",
        memory=MemoryOptions(every=1, memory_dir=out / f"memory-{world}"),
        guard=GuardOptions(policy=args.policy),
        preemption_signals=(),
    )
    step = mgr.restore_latest(state) or 0
    if step == 0:
        mgr.checkpoint_if_due(0, state, every=10**6)  # the state before step 1, for a first step that trips
    transient = tuple(int(v) for v in args.transient.split(":")) if args.transient else None
    attempts: dict[int, int] = {}
    batches: dict[int, list[int]] = {}
    while step < args.total:
        for xb, yb, ib in loader:
            loss = nn.functional.mse_loss(ddp(xb), yb)
            attempts[step + 1] = attempts.get(step + 1, 0) + 1
            if args.nan_sample is not None and args.nan_sample in ib.tolist():
                loss = loss * math.nan
            loss.backward()
            if transient is not None and (step + 1, rank) == transient and attempts[step + 1] == 1:
                model.weight.grad.mul_(math.inf)  # type: ignore[union-attr]
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
            verdict = mgr.guard(step + 1, state, loss=loss, grad_norm=norm)
            if verdict.rolled_back:
                step = verdict.step
                break
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            batches[step] = loader.last_batch_samples()
            mgr.checkpoint_if_due(step, state, every=args.durable_every or args.total)
            if step == args.die_after:
                mgr.wait()
                report(out, world, rank, model, mgr, loader, batches, step)
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.total:
                break
    mgr.wait()
    report(out, world, rank, model, mgr, loader, batches, step)
    mgr.close()
    dist.destroy_process_group()
    os._exit(0)  # no gloo teardown races at interpreter exit


def report(
    out: Path,
    world: int,
    rank: int,
    model: nn.Module,
    mgr: CheckpointManager,
    loader: ResumableDataLoader[Any],
    batches: dict[int, list[int]],
    step: int,
) -> None:
    if rank == 0:
        digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.parameters())).hexdigest()
        result = {
            "digest": digest,
            "step": step,
            "events": [
                {
                    "step": e.step,
                    "kind": e.kind,
                    "ranks": list(e.ranks),
                    "samples": list(e.samples),
                    "shards": list(e.shards),
                    "reason": e.reason,
                }
                for e in mgr.guard_events
            ],
            "record": loader.state_dict().get("quarantine", []),
            "batches": {str(k): v for k, v in batches.items()},
        }
        (out / f"result-{world}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
