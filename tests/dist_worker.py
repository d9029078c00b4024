"""One rank of a multi-process test: ``python dist_worker.py SCENARIO OUT_DIR`` under RANK/WORLD_SIZE/MASTER_*.

Scenarios (each rank runs the same code, as a trainer would):
- ``save``: an FSDP2 (``fully_shard``) model and AdamW, two training steps with per-rank data, then
  ``ckptfmt.torch.save`` to OUT_DIR/ckpt; the full (gathered) weights and optimizer state go to
  OUT_DIR/reference-*.safetensors from rank 0, for the test to compare against.
- ``load``: a freshly initialized FSDP2 model on this world size, ``ckptfmt.torch.load`` from
  OUT_DIR/ckpt, and the gathered state to OUT_DIR/loaded-<world>-*.safetensors from rank 0.
- ``tp``: a 2-D mesh (2-way FSDP x 2-way tensor parallel, 4 ranks) loading the same checkpoint.
- ``incremental``: the ``save`` checkpoint loaded, the last layer trained one step, saved to OUT_DIR/ckpt-inc
  with OUT_DIR/ckpt as its base (spec/references.md); the gathered state to OUT_DIR/incremental-*.safetensors.
- ``die``: every rank starts a save of its shards; rank 1 is SIGKILLed before the commit. The others
  must raise (not hang); rank 0 records the error in OUT_DIR/errors-<rank>.txt.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptfmt
import ckptfmt.torch as ct
from ckptfmt.torch.collective import TorchCollective
from ckptfmt.torch.sharding import local_region


def build(mesh: Any, tp_mesh: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    flat = {f"{fqn}/{key}": t for fqn, entry in optim.get("state", {}).items() for key, t in entry.items()}
    return weights, flat


def dump(out: Path, prefix: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    weights, optim = gathered(model, optimizer)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{prefix}-weights.safetensors"))
        save_file(
            {k: v.contiguous().reshape(v.shape) for k, v in optim.items()}, str(out / f"{prefix}-optim.safetensors")
        )


def config() -> dict[str, Any]:
    return {"model": "mlp", "layers": [6, 10, 3]}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world, rank = dist.get_world_size(), dist.get_rank()
    url = str(out / "ckpt")
    sampler = ct.ResumableSampler(64, seed=7, rank=rank, world_size=world)
    if scenario == "tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, optimizer = build(mesh["dp"], mesh["tp"])
    else:
        model, optimizer = build(init_device_mesh("cpu", (world,)))
    if scenario == "save":
        torch.manual_seed(99 + rank)  # per-rank data
        for _ in range(2):
            model(torch.randn(4, 6)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        ct.save(url, step=2, model=model, optimizer=optimizer, config=config(), sampler=sampler)
        dump(out, "reference", model, optimizer)
    elif scenario in ("load", "tp"):
        restored = ct.load(url, model=model, optimizer=optimizer, config=config(), sampler=sampler)
        assert restored.step == 2, restored
        dump(out, f"loaded-{scenario}-{world}", model, optimizer)
    elif scenario == "incremental":
        # the 4-rank checkpoint, loaded, then one step that trains only the last layer; saved beside it with
        # it as the base: each rank references its own unchanged shards (first layer, and its Adam moments)
        ct.load(url, model=model, optimizer=optimizer, config=config(), sampler=sampler)
        model[0].requires_grad_(False)
        torch.manual_seed(5 + rank)
        model(torch.randn(4, 6)).pow(2).sum().backward()
        optimizer.step()
        ct.save(url + "-inc", step=3, model=model, optimizer=optimizer, config=config(), sampler=sampler, base=url)
        dump(out, "incremental", model, optimizer)
    elif scenario == "die":
        writer = ckptfmt.open_writer(url + "-die", profile="weights", collective=TorchCollective())
        for name, tensor in model.state_dict().items():
            shard = tensor.to_local()
            offsets, _ = local_region(tensor)
            writer.write_tensor("weights", name, shard, global_shape=tuple(tensor.shape), offsets=offsets)
        writer.flush()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            writer.commit()
            (out / f"errors-{rank}.txt").write_text("committed")
        except ckptfmt.CheckpointError as exc:
            (out / f"errors-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        os._exit(0)  # the group is broken: skip destroy_process_group, which would wait for rank 1
    dist.barrier()
    # Leave without tearing the group down: every rank is past the barrier, and gloo's teardown at interpreter
    # exit has been seen to abort ("terminate called without an active exception") after all work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
