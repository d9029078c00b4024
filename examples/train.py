"""A small but real trainer that checkpoints through ckptfmt's CheckpointManager and resumes bit for bit.

    python examples/train.py --run-dir runs/tiny --steps 24 --every 4
        [--async] [--threads N] [--workers N] [--withhold {rng,data,optimizer}]
        [--kill-after-checkpoint-step N] [--losses-out FILE] [--step-sleep SECONDS]
    torchrun --nproc-per-node 4 --max-restarts 1 examples/train.py --run-dir runs/tiny ...

Under ``torchrun`` (WORLD_SIZE > 1) the model is sharded with FSDP2 (``fully_shard``) over gloo on CPU
(NCCL where CUDA is available), every rank reads its share of each global batch, and every rank makes the
same CheckpointManager calls: each writes its own shards of one checkpoint. Restarted on another number
of ranks, the run continues the same global sample order. ``--kill-rank R`` makes only rank R die at
``--kill-after-checkpoint-step`` (and only in torchrun's first attempt, so a restart can resume);
``--samples-out`` records the dataset indices each rank trained on, step by step.

A one-block GPT-style language model (token and position embeddings, causal self-attention, an MLP,
dropout, a head tied to the embedding) learns a synthetic, seeded Markov-chain language. Batches come
from a shuffling :class:`ResumableDataLoader` (``--workers`` > 0 uses worker processes), whose position is
what it handed to the loop — the loop calls no ``advance()``; a numpy ``Generator`` corrupts a few input
tokens per batch, so data order, dropout and the augmentation all draw on state that a checkpoint must
carry. AdamW with a warmup-then-cosine learning rate. Started again with the same ``--run-dir``, it resumes
from the newest good checkpoint.

Test hooks: ``--kill-after-checkpoint-step N`` SIGKILLs the process as soon as the checkpoint at
step N is durable; ``--withhold FIELD`` resumes without that field (a negative control: the resumed
run must then diverge); ``--step-sleep`` makes each step slow enough to be interrupted mid-step;
``--losses-out`` records every step's loss (rewritten atomically after each step, so it survives
a SIGKILL).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a restarted worker's import time is measured from here

import argparse
import json
import logging
import math
import os
import random
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from ckptfmt.tier import default_memory_dir
from ckptfmt.torch import CheckpointManager, DatasetIdentity, ResumableDataLoader, prewarm


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the numbers a run produces (operational flags such as --threads are not here)."""

    seed: int = 1234
    vocab: int = 32
    context: int = 16
    d_model: int = 32
    dropout: float = 0.1
    samples: int = 256
    shard_size: int = 32
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 4
    steps: int = 24
    augment_prob: float = 0.05


# ---------------------------------------------------------------- data


class MarkovText(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``samples`` token sequences drawn from a seeded random Markov chain; item i is (tokens, next tokens)."""

    def __init__(self, cfg: TrainConfig) -> None:
        gen = np.random.default_rng([cfg.seed, 0xDA7A])
        transitions = gen.dirichlet(np.full(cfg.vocab, 0.2), size=cfg.vocab)
        seqs = np.empty((cfg.samples, cfg.context + 1), dtype=np.int64)
        seqs[:, 0] = gen.integers(0, cfg.vocab, cfg.samples)
        for t in range(1, cfg.context + 1):
            u = gen.random(cfg.samples)[:, None]
            seqs[:, t] = (np.cumsum(transitions[seqs[:, t - 1]], axis=1) < u).sum(axis=1).clip(0, cfg.vocab - 1)
        self.data = torch.from_numpy(seqs)
        self.identity = DatasetIdentity(
            name="markov-text",
            version=f"seed={cfg.seed},vocab={cfg.vocab},context={cfg.context}",
            shards=tuple(f"shard-{i:03d}" for i in range(math.ceil(cfg.samples / cfg.shard_size))),
        )

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.data[index]
        return seq[:-1], seq[1:]


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A dataset whose items also carry their index (to record which samples a run trained on)."""

    def __init__(self, inner: MarkovText) -> None:
        self.inner = inner
        self.identity = inner.identity

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*self.inner[index], index)


# ---------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        t = x.shape[1]
        scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        x = x + self.proj(self.attn_drop(scores.softmax(-1)) @ v)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.block = Block(cfg.d_model, cfg.dropout)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once in the checkpoint
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens) + self.pos[: tokens.shape[1]])
        return self.head(self.ln(self.block(x)))


# ---------------------------------------------------------------- training


@dataclass
class Trainer:
    cfg: TrainConfig
    model: TinyGPT
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.SequentialLR
    loader: ResumableDataLoader[tuple[torch.Tensor, torch.Tensor]]
    augment: np.random.Generator

    def state(self) -> dict[str, Any]:
        """What the manager saves and restores: the seven fields plus the scheduler."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "loader": self.loader,
            "generators": {"augment": self.augment},
        }

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless batches; each pass over the loader continues where the last batch it handed out left off."""
        while True:
            yield from self.loader

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, sleep: float = 0.0) -> float:
        """One optimizer step; the loss averaged over ranks."""
        mask = torch.from_numpy(self.augment.random(tuple(inputs.shape)) < self.cfg.augment_prob)
        noise = torch.from_numpy(self.augment.integers(0, self.cfg.vocab, tuple(inputs.shape)))
        inputs = torch.where(mask, noise, inputs)
        self.model.train()
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, self.cfg.vocab), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if sleep:
            time.sleep(sleep)  # a slow step, so a signal can land in the middle of one
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            total = loss.detach().clone()
            dist.all_reduce(total)
            return float(total.item()) / dist.get_world_size()
        return float(loss.item())


PG_TIMEOUT: float | None = None  # --pg-timeout: how long a collective waits for a silent peer


def distributed() -> tuple[int, int]:
    """Join the torchrun job (gloo on CPU, NCCL with CUDA) when there is one: (rank, world size)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    if not dist.is_initialized():
        # Each torchrun attempt rendezvouses under its own key prefix: with torch 2.13 a restarted gloo group
        # otherwise reads the dead attempt's addresses from torchrun's store ("connectFullMesh failed").
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            store=dist.PrefixStore(f"train-attempt-{attempt}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            **({"timeout": timedelta(seconds=PG_TIMEOUT)} if PG_TIMEOUT else {}),
        )
    return dist.get_rank(), dist.get_world_size()


def build(cfg: TrainConfig, *, workers: int = 0, indexed: bool = False) -> Trainer:
    """A fresh trainer: every generator seeded from ``cfg.seed``, as a new process would have it."""
    rank, world = distributed()
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank; dropout differs by rank below
    np.random.seed((cfg.seed + rank) % 2**32)
    dataset: Any = Indexed(MarkovText(cfg)) if indexed else MarkovText(cfg)
    model = TinyGPT(cfg)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            model = model.cuda()
        fully_shard(model, mesh=init_device_mesh(device, (world,)))  # parameters become DTensor shards
        torch.manual_seed(cfg.seed * 1000 + rank)  # each rank its own dropout masks, as in real jobs
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=cfg.warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, cfg.steps - cfg.warmup_steps))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[cfg.warmup_steps])
    # Its state is the samples it handed out (not what workers prefetched), and it never draws from torch's
    # global generator, which a resumed run would otherwise advance at another step than the original did.
    loader = ResumableDataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        seed=cfg.seed,
        num_workers=workers,
        shard_size=cfg.shard_size,
        dataset_identity=dataset.identity,
    )
    augment = np.random.default_rng([cfg.seed, 0xA06, rank])
    return Trainer(cfg, model, optimizer, scheduler, loader, augment)


class SampleLog:
    """The dataset indices of each step's batch on this rank, as JSON rewritten after every step."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        earlier = json.loads(self.path.read_text())["steps"] if self.path and self.path.exists() else {}
        self.steps: dict[str, list[int]] = dict(earlier)

    def add(self, step: int, indices: list[int]) -> None:
        self.steps[str(step)] = indices
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"steps": self.steps}))
            os.replace(tmp, self.path)


class LossLog:
    """Per-step losses as JSON, rewritten atomically after every step (so a SIGKILL leaves a valid file).

    A restarted process (torchrun's next attempt) keeps what the file holds; a step done again after a
    resume replaces its earlier entry.
    """

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        earlier = json.loads(self.path.read_text())["losses"] if self.path and self.path.exists() else []
        self.losses: dict[int, float] = {int(s): float(v) for s, v in earlier}

    def add(self, step: int, loss: float) -> None:
        self.losses[step] = loss
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"losses": [[s, self.losses[s]] for s in sorted(self.losses)]}))
            os.replace(tmp, self.path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="run directory (local path or fsspec URL)")
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="total optimizer steps of the run")
    p.add_argument("--every", type=int, default=4, help="checkpoint every this many steps")
    p.add_argument("--async", dest="async_save", action="store_true", help="persist checkpoints in the background")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument(
        "--threads-at",
        metavar="STEP:N",
        help="switch to N torch threads once STEP steps are done (a reference for resuming under another count)",
    )
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (default 0)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--withhold", choices=["rng", "data", "optimizer"], help="resume without this field")
    p.add_argument("--kill-after-checkpoint-step", type=int, metavar="N", help="SIGKILL self once step N is durable")
    p.add_argument("--losses-out", metavar="FILE", help="write per-step losses as JSON")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS", help="sleep inside each step")
    p.add_argument("--quiet", action="store_true", help="no per-step output")
    p.add_argument("--kill-rank", type=int, metavar="R", help="with --kill-after-checkpoint-step: only rank R dies")
    p.add_argument("--samples-out", metavar="PREFIX", help="write each rank's sample indices to PREFIX.rank<R>.json")
    p.add_argument("--memory-every", type=int, default=0, help="a memory snapshot every this many steps (0: off)")
    p.add_argument("--memory-dir", help="the memory tier's directory (default $CKPTFMT_MEMORY_DIR, else per user)")
    p.add_argument("--kill-at-step", type=int, metavar="N", help="SIGKILL self once step N's memory snapshot is in")
    p.add_argument("--replicate", action="store_true", help="copy each memory snapshot to a rank on another node")
    p.add_argument("--peer-timeout", type=float, default=300.0, help="seconds before a silent peer fails a copy")
    p.add_argument(
        "--node-of-rank",
        metavar="A,A,B,B",
        help="play several nodes on one host: rank R's node key ($CKPTFMT_NODE_KEY) and memory directory "
        "(<memory-dir>/<key>) are the R-th name",
    )
    p.add_argument(
        "--domain-of-rank",
        metavar="rack-a,rack-a,rack-b",
        help="with --node-of-rank: rank R's failure domain ($CKPTFMT_FAILURE_DOMAIN) is the R-th label",
    )
    p.add_argument("--replicas", type=int, default=1, help="with --replicate: copies of each rank's files")
    p.add_argument(
        "--lose-node-at-step",
        type=int,
        metavar="N",
        help="once step N's snapshot and replica are in, every rank (of --lost-node only, if given) dies (SIGKILL)",
    )
    p.add_argument("--lost-node", metavar="KEY", help="with --lose-node-at-step: only the ranks of this node die")
    p.add_argument("--pg-timeout", type=float, metavar="SECONDS", help="the process group's timeout (a hung peer)")
    p.add_argument(
        "--hang-at-step", type=int, metavar="N", help="after step N, rank --kill-rank stops (SIGSTOP): a hung peer"
    )
    p.add_argument("--stop-at-step", type=int, metavar="N", help="end after step N (saved) as if the run were done")
    p.add_argument("--report-out", metavar="PREFIX", help="write each rank's restore report to PREFIX.rank<R>.json")
    p.add_argument(
        "--replica-sync", action="store_true", help="wait for each replica before the next step (pins a test's steps)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    imported = time.time()
    args = parse_args(argv)
    global PG_TIMEOUT
    PG_TIMEOUT = args.pg_timeout
    warm = prewarm()  # what the first step and the restore import lazily, imported while the process group forms
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(steps=args.steps)
    trainer = build(cfg, workers=args.workers, indexed=bool(args.samples_out))
    rank, world = distributed()
    log = LossLog(args.losses_out if rank == 0 else None)
    seen = SampleLog(f"{args.samples_out}.rank{rank}.json" if args.samples_out else None)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_here = args.kill_rank in (None, rank) and attempt == 0
    memory_dir = args.memory_dir
    if args.node_of_rank:
        node = args.node_of_rank.split(",")[rank]
        os.environ["CKPTFMT_NODE_KEY"] = node
        memory_dir = os.path.join(memory_dir or default_memory_dir(), node)
    if args.domain_of_rank:
        os.environ["CKPTFMT_FAILURE_DOMAIN"] = args.domain_of_rank.split(",")[rank]
    mgr = CheckpointManager(
        args.run_dir,
        keep_last=args.keep_last,
        async_save=args.async_save,
        memory_every=args.memory_every,
        memory_dir=memory_dir,
        replicate=args.replicate,
        replicas=args.replicas,
        peer_timeout=args.peer_timeout,
    )
    skip = (args.withhold,) if args.withhold else ()
    if warm is not None:
        warm.join()
    ready = time.time()
    step = mgr.restore_latest(**trainer.state(), config=cfg, skip_fields=skip) or 0
    restored = time.time()
    say = (lambda *a: None) if args.quiet or rank != 0 else (lambda *a: print(*a, flush=True))
    tier = f", from {mgr.last_restore.tier}" if mgr.last_restore is not None else ""
    say(
        f"{'resumed at' if step else 'starting at'} step {step} "
        f"(ranks={world}, threads={args.threads}, workers={args.workers}, attempt={attempt}{tier})"
    )
    if mgr.last_restore is not None:
        say(f"restore report: {json.dumps(mgr.last_restore.to_dict())}")
        if args.report_out:
            Path(f"{args.report_out}.rank{rank}.json").write_text(json.dumps(mgr.last_restore.to_dict()))
    batches = trainer.batches()
    saved_at = step
    first_step = True
    switch_step, switch_threads = (int(v) for v in args.threads_at.split(":")) if args.threads_at else (-1, 0)
    end = min(cfg.steps, args.stop_at_step) if args.stop_at_step else cfg.steps
    while step < end:
        if step == switch_step:
            torch.set_num_threads(switch_threads)
        batch = next(batches)
        inputs, targets = batch[0], batch[1]
        loss = trainer.step(inputs, targets, sleep=args.step_sleep)
        step += 1
        log.add(step, loss)
        if len(batch) == 3:
            seen.add(step, batch[2].tolist())
        if first_step:
            first_step = False
            say(f"first step of attempt {attempt} done at {time.time():.3f}")
            say(
                f"attempt {attempt} timings: process started at {STARTED:.3f}, imports done at "
                f"{imported:.3f}, process group and model ready at {ready:.3f}, restored at {restored:.3f}"
            )
        say(f"step {step} loss {loss:.6f}")
        if mgr.checkpoint_if_due(step, every=args.every, **trainer.state(), config=cfg):
            saved_at = step
            if step == args.kill_after_checkpoint_step and kill_here:
                mgr.wait()  # durable first: the point is to be killed *after* a checkpoint
                print(f"rank {rank}: checkpoint at step {step} is durable; SIGKILL at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if args.replica_sync:
            mgr.wait_replica()
        node_dies = args.lost_node in (None, os.environ.get("CKPTFMT_NODE_KEY"))
        if step == args.lose_node_at_step and attempt == 0 and node_dies:
            replica = mgr.wait_replica()  # this step's snapshot in every slot, and its copies on the other node
            copied = replica.step if replica is not None else None
            print(f"rank {rank}: replica of step {copied} is in; node lost at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.hang_at_step and kill_here:
            mgr.wait_replica()
            print(f"rank {rank}: SIGSTOP at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == args.kill_at_step and kill_here:
            mgr.wait_memory()  # this step's snapshot is in its slot; the durable one may be far behind
            print(f"rank {rank}: memory snapshot of step {step} is in; SIGKILL at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if saved_at != step:
        mgr.save(step, **trainer.state(), config=cfg)  # the final state, so runs can be diffed
    mgr.close()
    say(f"done at step {step}; latest checkpoint {mgr.last_checkpoint_id}")
    shut_down()
    return 0


def shut_down() -> None:
    """Leave the process group before the interpreter exits: every rank past a barrier, then the group
    destroyed. A gloo group still alive at exit can abort in its threads' destructors ("terminate called
    without an active exception", SIGABRT) after all the work is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
