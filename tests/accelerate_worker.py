"""One process of a two-process Accelerate run on CPU (gloo): ``python accelerate_worker.py URL``.

Each process stands for a node with a local disk of its own: its TMPDIR, which no other process may touch
(``CKPTFMT_TEST_FOREIGN`` lists the other processes' directories; an audit hook makes every file operation
there fail as it would on another machine). Each process trains an epoch of a tiny model with dropout whose
generators part ways by process, saves through ``save_state`` to URL (shared storage), trains a second epoch,
then loads the checkpoint back with its generators scrambled and trains that epoch again: it must get its own
generators back and end bit-identical. With ``--main-cannot-write`` the main process's import fails, and every
process must raise a library error at once (none may wait for the others).
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any, NoReturn

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from ckptfmt.errors import CheckpointError
from ckptfmt.integrations.accelerate import load_state, save_state


def guard_foreign_paths() -> None:
    """Every file operation on a path under another process's local disk fails, as it would on another node."""
    foreign = [os.path.realpath(p) + os.sep for p in os.environ["CKPTFMT_TEST_FOREIGN"].split(os.pathsep) if p]
    events = {"open", "os.mkdir", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.replace", "shutil.rmtree"}

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in events:
            return
        for arg in args[:2]:
            if isinstance(arg, (str, bytes, os.PathLike)) and not isinstance(arg, int):
                path = os.path.realpath(os.fsdecode(arg)) + os.sep
                if any(path.startswith(root) for root in foreign):
                    raise FileNotFoundError(f"{event} {os.fsdecode(arg)}: another node's local disk")

    sys.addaudithook(hook)


def epoch(accelerator: Any, model: Any, optimizer: Any, loader: Any, rank: int) -> None:
    for x, y in loader:
        torch.rand(1 + rank)  # draws that differ by process: the generators part ways
        random.random() if rank else None
        np.random.rand(1 + rank)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def rng_state() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def main() -> NoReturn:
    url = sys.argv[1]
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    rank = accelerator.process_index
    guard_foreign_paths()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))

    epoch(accelerator, model, optimizer, loader, rank)
    if "--main-cannot-write" in sys.argv:  # URL is below a regular file: the main process's import fails
        try:
            save_state(accelerator, url, step=len(loader), data={"epoch": 1, "global_sample_offset": 16})
        except CheckpointError as exc:
            print(f"process {rank} refused: {type(exc).__name__}: {exc}", flush=True)
            accelerator.wait_for_everyone()  # a trainer that carries on: every process is in step again
            leave()
        raise AssertionError("the save did not fail")
    saved = rng_state()
    save_state(accelerator, url, step=len(loader), data={"epoch": 1, "global_sample_offset": 16})
    epoch(accelerator, model, optimizer, loader, rank)
    full = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    torch.manual_seed(1234 + rank)
    random.seed(1234)
    np.random.seed(1234)
    assert load_state(accelerator, url) == {"epoch": 1, "global_sample_offset": 16, "step": len(loader)}
    restored = rng_state()
    assert torch.equal(restored[0], saved[0]) and restored[1] == saved[1] and np.array_equal(restored[2], saved[2])
    epoch(accelerator, model, optimizer, loader, rank)
    for name, tensor in accelerator.unwrap_model(model).state_dict().items():
        assert torch.equal(tensor, full[name]), name
    accelerator.end_training()
    leave()


def leave() -> NoReturn:
    """Exit without freeing the run's objects. Freeing DDP's reducer (when ``main`` returns) joins gloo's worker
    thread while holding the GIL, and that thread may be freeing a finished work's state, which needs the GIL: both
    ranks hung there in about one run in five (torch 2.13, seen with py-spy), after every check had passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
