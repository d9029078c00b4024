"""One rank of a DCP save or load through ckptfmt's storage layer: ``python dcp_worker.py MODE OUT_DIR`` under
RANK/WORLD_SIZE/MASTER_* (gloo). An FSDP2 model (every Linear and the root ``fully_shard``-ed) and AdamW, their
state from ``get_state_dict``.

- ``save``: two training steps, then ``dcp.save`` through ``ckptfmt.dcp.StorageWriter`` (OUT_DIR/ckptfmt) and
  through DCP's ``FileSystemWriter`` (OUT_DIR/dcp); rank 0 writes OUT_DIR/saved.json, the digest of the full state.
- ``async`` / ``async-process``: the ``save`` state through ``dcp.async_save`` (DCP's thread executor, or its
  background process, which initializes its own process group) into OUT_DIR/ckptfmt, staged, then waited for;
- ``die``: every rank starts a ``dcp.save`` through ckptfmt into OUT_DIR/dying; rank 1 is SIGKILLed once its data
  files are written, before it reports them; rank 0 writes OUT_DIR/die.json with the error it got;
- ``fail``: the same, but rank 1 raises (a full disk) once its data files are written; every rank writes
  OUT_DIR/fail-<rank>.json with the error it got, then saves again to the same place, which must succeed;
- ``load``: a model of other weights, ``dcp.load`` through ``ckptfmt.dcp.StorageReader``, then again through
  ``FileSystemReader``; rank 0 writes OUT_DIR/loaded-<world>.json with the digest of the full state after each.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptfmt.dcp import StorageReader, StorageWriter


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=full)  # every rank together; the full state on rank 0 only
    if not msd:
        return ""
    h = hashlib.sha256()
    for key in sorted(msd):
        h.update(key.encode() + msd[key].contiguous().numpy().tobytes())
    for name in sorted(osd["state"]):
        for key, value in sorted(osd["state"][name].items()):
            h.update(f"{name}.{key}".encode() + value.contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "die":
        import signal

        from torch.distributed.checkpoint.api import CheckpointException

        import ckptfmt.writer

        if rank == 1:

            def die(self: Any) -> str:
                self.flush()  # its data files are written: it dies before the coordinator hears of them
                os.kill(os.getpid(), signal.SIGKILL)
                raise AssertionError("unreachable")

            ckptfmt.writer.CheckpointWriter.hand_over = die  # type: ignore[method-assign]
        model, optimizer = build(1234)
        try:
            dcp.save(state(model, optimizer), storage_writer=StorageWriter(out / "dying"))
            result = {"error": None}
        except CheckpointException as exc:
            result = {"error": [f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()]}
        except RuntimeError as exc:  # DCP's own gather of the results, with a rank gone (gloo's error)
            result = {"error": [f"{type(exc).__name__}: {exc}"]}
        (out / "die.json").write_text(json.dumps(result))
        os._exit(0)
    if mode == "fail":
        from torch.distributed.checkpoint.api import CheckpointException

        import ckptfmt.writer
        from ckptfmt.errors import StorageError

        real = ckptfmt.writer.CheckpointWriter.hand_over
        if rank == 1:

            def fail(self: Any) -> Any:
                self.flush()  # its data files are written: the failure must delete them
                raise StorageError("No space left on device (injected)", path="weights/full")

            ckptfmt.writer.CheckpointWriter.hand_over = fail  # type: ignore[method-assign]
        model, optimizer = build(1234)
        try:
            dcp.save(state(model, optimizer), storage_writer=StorageWriter(out / "failing"))
            errors: list[str] = []
        except CheckpointException as exc:
            errors = [f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()]
        dist.barrier()  # every rank has failed before any looks at the store
        left = sorted(str(p.relative_to(out / "failing")) for p in (out / "failing").rglob("*") if p.is_file())
        ckptfmt.writer.CheckpointWriter.hand_over = real  # type: ignore[method-assign]
        dcp.save(state(model, optimizer), storage_writer=StorageWriter(out / "failing"))  # the lock was given back
        (out / f"fail-{rank}.json").write_text(json.dumps({"errors": errors, "left": left}))
        dist.destroy_process_group()
        return
    if mode in ("async", "async-process"):
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if mode == "async-process" else AsyncCheckpointerType.THREAD
        model, optimizer = build(1234)
        pending = dcp.async_save(
            state(model, optimizer), storage_writer=StorageWriter(out / "ckptfmt"), async_checkpointer_type=kind
        )
        pending.result()
        result = {"saved": digest(model, optimizer)}
        name = "saved.json"
    elif mode == "save":
        model, optimizer = build(1234)
        dcp.save(state(model, optimizer), storage_writer=StorageWriter(out / "ckptfmt"))
        dcp.save(state(model, optimizer), storage_writer=FileSystemWriter(str(out / "dcp")))
        result = {"saved": digest(model, optimizer)}
        name = "saved.json"
    else:
        result = {}
        readers: list[tuple[str, Any]] = [("ours", StorageReader(out / "ckptfmt"))]
        if (out / "dcp").exists():
            readers.append(("theirs", FileSystemReader(str(out / "dcp"))))
        for label, reader in readers:
            model, optimizer = build(99)
            target = state(model, optimizer)
            dcp.load(target, storage_reader=reader)
            set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
            result[label] = digest(model, optimizer)
        name = f"loaded-{world}.json"
    if rank == 0:
        (out / name).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":  # DCP's background process re-imports this module: nothing runs at import
    main()
