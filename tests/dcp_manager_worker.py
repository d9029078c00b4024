"""One rank of a DCP trainer under the checkpoint manager: ``python dcp_manager_worker.py OUT_DIR TOTAL [DIE_AFTER]``
under RANK/WORLD_SIZE/MASTER_* (gloo). An FSDP2 model and AdamW, their state from ``get_state_dict``, with the
data loader and a plain ``train`` dict: the state dict a DCP trainer hands ``dcp.save``, given to the manager as
``ckptfmt.dcp.training_state(states, ...)``, a memory snapshot every step.

The run restores from OUT_DIR/run's newest snapshot if any, trains to TOTAL; with DIE_AFTER, every rank SIGKILLs
itself once that step's snapshot is committed. Rank 0 writes OUT_DIR/result.json: the digest of the full model and
optimizer state, the step it restored, and the ``train`` dict.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

from ckptfmt.dcp import training_state
from ckptfmt.torch import CheckpointManager, MemoryOptions, ResumableDataLoader


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=full)  # every rank together; the full state on rank 0
    h = hashlib.sha256()
    for key in sorted(msd):
        h.update(key.encode() + msd[key].contiguous().numpy().tobytes())
    for name in sorted(osd.get("state", {})):
        for key, value in sorted(osd["state"][name].items()):
            h.update(f"{name}.{key}".encode() + value.contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out, total = Path(sys.argv[1]), int(sys.argv[2])
    die_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    loader: ResumableDataLoader[Any] = ResumableDataLoader(
        TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, seed=3, shuffle=True
    )
    torch.manual_seed(1 if die_after is None and (out / "run").exists() else 0)  # a resumed run starts elsewhere
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train: dict[str, Any] = {"step": 0, "seen": []}
    msd, osd = get_state_dict(model, optimizer)
    states = {"model": msd, "optim": osd, "dataloader": loader, "train": train}
    state = training_state(states, model=model, optimizer=optimizer, config={"run": "dcp"})
    mgr = CheckpointManager(
        out / "run", memory=MemoryOptions(every=1, memory_dir=out / "memory"), preemption_signals=()
    )
    restored = mgr.restore_latest(state) or 0
    step = restored
    while step < total:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            train["step"] = step
            train["seen"] = [*train["seen"], loader.last_batch_samples()[0]]
            mgr.checkpoint_if_due(step, state, every=10**6)
            if step == die_after:
                mgr.wait_memory()
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= total:
                break
    result = {"digest": digest(model, optimizer), "restored": restored, "train": train}
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))
    mgr.close(persist=False)
    dist.destroy_process_group()
    os._exit(0)  # no gloo teardown races at interpreter exit


if __name__ == "__main__":
    main()
