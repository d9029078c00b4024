"""The CUDA path of the memory tier, in one short run: pinned host buffers filled on a side stream while training
goes on, and the restore from memory back onto the device.

    python bench/cuda_snapshot.py [--device cuda] [--mib 1024] [--steps 30] [--json FILE]

One process, one device. An MLP whose weights and two AdamW moments come to ``--mib`` MiB trains on synthetic data
through two phases of ``--steps`` steps each, the device synchronized after every step:

- ``plain``: no checkpoint (the baseline step time);
- ``memory``: ``CheckpointManager`` with a memory snapshot every step, durable saves off: the step time, and the
  stall per snapshot against ``plain`` (with CUDA: the copies run on a side stream into pinned buffers, and only
  ``optimizer.step()`` waits for them).

Then, on their own: the device-to-host copy of the whole state through ``HostBuffers`` (GB/s, the median of three),
and the restore: a model built afresh on the device (other weights), ``restore_latest(fresh=True)`` from the newest
snapshot, timed, and its weights compared bit for bit with those the snapshot was taken of.

Under 3 minutes on one GPU at the defaults. ``--device cpu`` runs the same path on the CPU (no pinned memory, no
stream): what tests/test_cuda_snapshot_script.py runs in CI so that this script does not rot while no GPU is at
hand. No assertion on time: the figures go to docs/benchmarks.md with the command and machine that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptfmt.torch import CheckpointManager, MemoryOptions, ResumableSampler, TrainingState
from ckptfmt.torch.snapshot import HostBuffers

WIDTH = 2048


def build(mib: int, device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP of square layers whose fp32 weights and AdamW moments come to about ``mib`` MiB."""
    per_layer = WIDTH * WIDTH * 4 * 3  # weights and two moments
    layers = max(1, round(mib * 2**20 / per_layer))
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*blocks).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, steps: int, after: Any = None
) -> list[float]:
    """Seconds per step (the device synchronized), ``after(step)`` called after each ``optimizer.step()``."""
    x = torch.randn(64, WIDTH, device=device)
    times = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
        if after is not None:
            after(step)
        sync(device)
        times.append(time.perf_counter() - started)
    return times


def snapshot_phase(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: ResumableSampler,
    device: torch.device,
    tmp: Path,
    memory_dir: Path,
    steps: int,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Seconds per step with a memory snapshot after every step, and the weights of the newest snapshot."""
    mgr = CheckpointManager(tmp / "run", memory=MemoryOptions(every=1, memory_dir=memory_dir), preemption_signals=())
    state = TrainingState(model=model, optimizer=optimizer, sampler=sampler, config={"bench": "cuda"})
    times = train(model, optimizer, device, steps, lambda step: mgr.checkpoint_if_due(step, state, every=10**9))
    mgr.wait_memory()
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    mgr.close(persist=False)
    return times, saved


def copy_rate(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    """GB/s of one copy of the whole state into (pinned, with CUDA) host buffers, the median of three."""
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = HostBuffers(pinned=device.type == "cuda")
    rates = []
    for _ in range(3):
        sync(device)
        started = time.perf_counter()
        for i, t in enumerate(tensors):
            buffers.copy(str(i), t)
        buffers.synchronize()
        rates.append(nbytes / (time.perf_counter() - started) / 1e9)
    return float(statistics.median(rates))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--mib", type=int, default=1024, help="weights + AdamW moments, MiB")
    p.add_argument("--steps", type=int, default=30, help="steps per phase")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: nothing measured (--device cpu runs the same path on the CPU)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the memory tier's home: node memory, not disk
    with tempfile.TemporaryDirectory(prefix="ckptfmt-cuda-") as tmp, tempfile.TemporaryDirectory(dir=shm) as memory:
        model, optimizer = build(args.mib, device, seed=0)
        train(model, optimizer, device, 3)  # warm-up: kernels, allocator, AdamW's state
        plain = train(model, optimizer, device, args.steps)
        sampler = ResumableSampler(10**6, seed=0)
        with_snapshots, saved = snapshot_phase(model, optimizer, sampler, device, Path(tmp), Path(memory), args.steps)
        rate = copy_rate(model, optimizer, device)
        nbytes = sum(t.numel() * t.element_size() for t in saved.values()) * 3
        del model, optimizer  # before the fresh ones are built (device memory)
        fresh, fresh_optimizer = build(args.mib, device, seed=1)
        sync(device)
        mgr = CheckpointManager(
            Path(tmp) / "run", memory=MemoryOptions(every=1, memory_dir=memory), preemption_signals=()
        )
        started = time.perf_counter()
        step = mgr.restore_latest(model=fresh, optimizer=fresh_optimizer, sampler=sampler, fresh=True)
        sync(device)
        restore_s = time.perf_counter() - started
        tier = mgr.last_restore.tier if mgr.last_restore is not None else None
        mgr.close(persist=False)
        identical = all(torch.equal(v.detach().cpu(), saved[k]) for k, v in fresh.state_dict().items())
    base, snap = statistics.median(plain), statistics.median(with_snapshots)
    figures = {
        "device": name,
        "state_mib": round(nbytes / 2**20),
        "steps": args.steps,
        "step_s_plain": base,
        "step_s_snapshot": snap,
        "stall_s_per_snapshot": snap - base,
        "step_time_ratio": snap / base,
        "copy_gb_s": rate,
        "restore_s": restore_s,
        "restored_step": step,
        "restored_from": tier,
        "bit_identical": identical,
    }
    print(f"| device | state | step plain | step with a snapshot | ratio | stall | copy | restore ({tier}) | exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {name} | {figures['state_mib']} MiB | {base * 1e3:.1f} ms | {snap * 1e3:.1f} ms | {snap / base:.2f} "
        f"| {(snap - base) * 1e3:.1f} ms | {rate:.1f} GB/s | {restore_s:.2f} s (step {step}) | {identical} |"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if not identical or step != args.steps:
        sys.exit("the restore did not give back the newest snapshot's weights")


if __name__ == "__main__":
    main()
