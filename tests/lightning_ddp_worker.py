"""One rank of a two-process Lightning DDP run on CPU (gloo): ``python lightning_ddp_worker.py OUT_DIR`` under
LOCAL_RANK/NODE_RANK/WORLD_SIZE/MASTER_* (Lightning's processes-created-externally mode).

Each rank trains a tiny module with dropout whose generators differ by rank, on a ResumableDataLoader: an
uninterrupted run, a run killed after step 7 (saves at steps 3 and 6 through ``CkptfmtCheckpointIO``), a
resume from step 6, and the same resume with every rank given rank 0's generators (what a checkpoint holding
rank 0's alone amounts to). It writes ``rank-<r>.json``: the batches each run saw and whether its weights are
the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import TensorDataset

from ckptfmt.integrations.lightning import CkptfmtCheckpointIO
from ckptfmt.torch import ResumableDataLoader
from ckptfmt.torch import rng as torch_rng

RANK = int(os.environ["LOCAL_RANK"])
SAVE_EVERY, KILL, RESUME_FROM = 3, 7, 6  # 4 steps an epoch: step 6 is batch 2 of epoch 1


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y, ids = batch
        self.seen.append(ids.tolist())
        # draws that differ by rank (as with per-rank sequence lengths or augmentations): the ranks' generators
        # part ways (Lightning seeds every rank alike at the start of fit)
        torch.rand(1 + RANK)
        random.random() if RANK else None
        np.random.rand(1 + RANK)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> ResumableDataLoader[Any]:
        # made here, where the process group exists: the loader takes this rank's share of the global order
        gen = torch.Generator().manual_seed(1)
        n = 32
        data = TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen), torch.arange(n))
        return ResumableDataLoader(data, batch_size=4, seed=7)


class Killed(Exception):
    pass


class KillAtStep(Callback):  # type: ignore[misc]
    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
        if trainer.global_step == KILL:
            raise Killed


def fit(root: Path, *, kill: bool = False, ckpt: Path | None = None, seed: int = 0) -> Net:
    pl.seed_everything(seed, verbose=False)
    model = Net()
    io = CkptfmtCheckpointIO()
    callbacks: list[Any] = [
        io.rng_callback,
        ModelCheckpoint(dirpath=root, every_n_train_steps=SAVE_EVERY, save_top_k=-1),
    ]
    if kill:
        callbacks.append(KillAtStep())
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        use_distributed_sampler=False,  # the ResumableDataLoader shards by rank itself
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[io],
        callbacks=callbacks,
    )
    try:
        trainer.fit(model, ckpt_path=str(ckpt) if ckpt else None)
    except Killed:
        pass
    return model


def main() -> None:
    out = Path(sys.argv[1])
    full = fit(out / "full")
    killed = fit(out / "killed", kill=True)
    ckpt = out / "killed" / f"epoch=1-step={RESUME_FROM}.ckpt"
    resumed = fit(out / "resumed", ckpt=ckpt, seed=123)
    # negative control: every rank resumes with rank 0's generators
    rank0 = torch_rng.for_this_rank
    torch_rng.for_this_rank = lambda field: {**field, "generators": field["ranks"][0]["generators"]}  # type: ignore[assignment]
    try:
        rank0_rng = fit(out / "rank0", ckpt=ckpt, seed=123)
    finally:
        torch_rng.for_this_rank = rank0  # type: ignore[assignment]

    def same(model: Net) -> bool:
        pairs = zip(model.state_dict().values(), full.state_dict().values(), strict=True)
        return all(torch.equal(a, b) for a, b in pairs)

    result = {
        "full": full.seen,
        "killed": killed.seen,
        "resumed": resumed.seen,
        "resumed_identical": same(resumed),
        "rank0_rng_identical": same(rank0_rng),
    }
    (out / f"rank-{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    # Lightning leaves its gloo group up; a rank exiting while its peer's group still talks to it died in gloo's
    # threads at exit ("terminate called without an active exception", once in a CI-load run): part together.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
