"""One torchft replica group that trains through ckptfmt: survivors keep training, a replacement heals from a peer.

    python -m torchft.torchx ... (or by hand, one process per replica group, beside a lighthouse):
    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 20 --join_timeout_ms 100 &
    python examples/torchft_train.py --lighthouse http://HOST:29510 --replica-id 0 --run-dir runs/ft --steps 200
    python examples/torchft_train.py --lighthouse http://HOST:29510 --replica-id 1 --run-dir runs/ft --steps 200

The loop is the one a torchft user writes: torchft's ``Manager``, its fault-tolerant allreduce and optimizer
wrapper, over its reconfigurable gloo process group. ckptfmt adds three things:

- ``CkptfmtTransport`` as the ``checkpoint_transport``, with ``transport.state_dict`` / ``load_state_dict`` as the
  state torchft moves: a group that joins or falls behind heals from a live peer through a verified ckptfmt
  checkpoint, the peer's newest memory snapshot when it holds the step (no pickle, every byte checked first);
- a ``CheckpointManager`` with the memory tier (a snapshot every committed step) and durable saves every
  ``--durable-every`` steps, per replica group (``<run-dir>/group-<id>``), going on while groups come and go;
- ``ReplicaBatches``: the data rule that keeps the job's sample stream exact when groups leave and join (each
  committed step with P groups consumes the next P global batches; a step that does not commit consumes none).

A group started when every group is gone resumes from its memory snapshot or durable save (``restore_latest``) and
tells torchft the step; one that starts beside live groups heals from them at its first quorum.

Test hooks: ``--die-at-step N`` SIGKILLs this process in the middle of step N (after its quorum, before its
gradients are reduced; or of its first step after N, if it joined later); ``--stop-file F`` ends the loop cleanly
after the first step at which F exists; ``--log FILE`` appends one JSON line per committed step (pid, step,
participants, the sample indices this group trained on, a digest of parameters and optimizer state) and one per
heal.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a replacement's start-up is measured from here

import argparse
import hashlib
import json
import logging
import os
import signal
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from ckptfmt.torch import CheckpointManager, MemoryOptions, ReplicaBatches, TrainingState
from ckptfmt.torch.ft_transport import CkptfmtTransport

# the timeouts that decide how long survivors stall when a group dies (every one is torchft's own)
TIMEOUT = timedelta(seconds=5)  # collectives, should_commit, the heal transfer
QUORUM_TIMEOUT = timedelta(seconds=10)
CONNECT_TIMEOUT = timedelta(seconds=10)
PG_TIMEOUT = timedelta(seconds=5)  # the gloo process group's own


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--memory-dir", default=None, help="this group's node memory (default: /dev/shm/ckptfmt-<uid>)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--durable-every", type=int, default=20)
    p.add_argument("--memory-every", type=int, default=1, help="a memory snapshot every N committed steps (0: off)")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step on top of the compute")
    p.add_argument("--host", default="127.0.0.1", help="the address peers heal from")
    p.add_argument("--die-at-step", type=int, default=None)
    p.add_argument("--stop-file", default=None, help="stop cleanly after the step at which this file exists")
    p.add_argument("--log", default=None)
    return p.parse_args(argv)


def dataset(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, width, generator=gen)
    return x, (x @ torch.randn(width, 1, generator=gen)).squeeze(1) + 0.1 * torch.randn(n, generator=gen)


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for group in optimizer.param_groups:  # in the optimizer's order of parameters: its state dict's is not fixed
        for p in group["params"]:
            for name, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(name.encode() + v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Log:
    def __init__(self, path: str | None) -> None:
        self.path = path

    def write(self, **record: Any) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()


def average_gradients(ft: Any, model: nn.Module) -> None:
    """The gradients averaged over the quorum's groups, in one bucket. (torchft's DistributedDataParallel does this
    in its comm hook; on CPU with gloo its hook asserts when a peer dies mid-allreduce, taking the survivor down.)"""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    ft.allreduce(flat).wait()  # an error is recorded by torchft: this step does not commit
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def make_transport(manager: CheckpointManager, state: TrainingState, args: argparse.Namespace) -> CkptfmtTransport:
    return CkptfmtTransport(manager=manager, state=state, host=args.host, timeout=TIMEOUT)


def main(argv: list[str] | None = None, transport_factory: Any = make_transport) -> None:
    import torchft
    from torch.distributed import TCPStore

    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    log = Log(args.log)
    torch.manual_seed(0)  # every group builds the same model (torchft also syncs it at step 0)
    x, y = dataset(args.samples, args.width)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh(), nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = ReplicaBatches(args.samples, batch_size=args.batch_size, seed=1234)
    state = TrainingState(model=model, optimizer=optimizer, sampler=batches, config={"width": args.width})
    manager = CheckpointManager(
        os.path.join(args.run_dir, f"group-{args.replica_id}"),
        keep_last=2,
        memory=MemoryOptions(every=args.memory_every, memory_dir=args.memory_dir) if args.memory_every else None,
        preemption_signals=(),
    )
    transport = transport_factory(manager, state, args)
    resumed = manager.restore_latest(state)  # every group gone: the memory tier or the durable save, as without torchft
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own (one rank here)
    ft = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=PG_TIMEOUT),
        min_replica_size=1,
        load_state_dict=transport.load_state_dict,
        state_dict=transport.state_dict,
        checkpoint_transport=transport,
        replica_id=f"group{args.replica_id}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname=args.host,
        timeout=TIMEOUT,
        quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=CONNECT_TIMEOUT,
    )
    if resumed:
        ft.load_state_dict({"step": resumed, "batches_committed": batches.committed_batches})
    optim = torchft.Optimizer(ft, optimizer)
    restored = manager.last_restore.to_dict() if manager.last_restore is not None else None
    log.write(event="start", pid=os.getpid(), started=STARTED, ready=time.time(), resumed=resumed, restored=restored)
    healed_seen = None
    while ft.current_step() < args.steps:
        optim.zero_grad()  # the quorum: groups that left are dropped, one that joins heals (in the background)
        rank, participants = ft.participating_rank(), ft.num_participants()
        if args.die_at_step is not None and ft.current_step() + 1 >= args.die_at_step:
            log.write(event="die", pid=os.getpid(), step=args.die_at_step, t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        indices = batches.indices(rank, participants)
        loss = nn.functional.mse_loss(model(x[indices]).squeeze(1), y[indices])
        loss.backward()
        average_gradients(ft, model)  # torchft's fault-tolerant allreduce: a group that dies mid-step fails it
        before = ft.current_step()
        optim.step()  # commits only if every group of the quorum agrees; a healing group applies its heal first
        if ft.current_step() == before:
            continue  # not committed: this step's batches are taken again
        step = ft.current_step()
        batches.commit(participants, step=step, replica_rank=rank)
        if manager.checkpoint_if_due(step, state, every=args.durable_every):
            batches.trim_record(through_step=step)  # the record since the last durable save stays in memory
        report = manager.last_restore
        if report is not None and report.tier == "healed" and report is not healed_seen:
            healed_seen = report
            started = transport.heal_started
            log.write(
                event="healed",
                pid=os.getpid(),
                t=time.time(),
                began=started,
                refusals=transport.refusals,
                **report.to_dict(),
            )
        log.write(
            event="step",
            pid=os.getpid(),
            step=step,
            t=time.time(),
            participants=participants,
            rank=rank,
            indices=indices if rank is not None else [],
            digest=state_digest(model, optimizer),
            loss=float(loss.detach()),
        )
        if args.stop_file is not None and os.path.exists(args.stop_file):
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)
    manager.close()
    ft.shutdown(wait=False)
    offers = {"memory": transport.offers_from_memory, "live": transport.offers_from_live}
    log.write(
        event="done", pid=os.getpid(), step=ft.current_step(), digest=state_digest(model, optimizer), offers=offers
    )


if __name__ == "__main__":
    main()
