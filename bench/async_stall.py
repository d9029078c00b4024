"""Training-loop stall of async versus synchronous checkpoint saves, in the same run.

    python bench/async_stall.py [--mib 256] [--steps 40] [--every 8] [--run-dir DIR]

One process trains an MLP (AdamW, so the optimizer state is twice the weights) on CPU. The first
half of the steps saves synchronously through ``CheckpointManager(async_save=False)``, the second
half through ``CheckpointManager(async_save=True)``, both every ``--every`` steps, to local disk.

The stall of a save is the time the training loop spends inside ``mgr.save`` (for async: waiting for
the previous save, if any, plus the snapshot into host buffers). Reported per save: sync stall, async
stall, their ratio (goal: async <= 5 % of sync), the parts of the async stall, and how much slower the
steps that overlap a background write run (GIL and memory-bandwidth contention), which is a cost the
stall alone does not show. No assertion: the figures depend on the disk and the CPU.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptfmt import provenance
from ckptfmt.torch import CheckpointManager, ResumableSampler, api, state


def build(mib: int) -> tuple[nn.Module, torch.optim.Optimizer, ResumableSampler]:
    width = 1024
    layers = max(1, (mib << 20) // (3 * 4 * width * width))  # weights + two AdamW moments, float32
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, ResumableSampler(4096, seed=0)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="checkpoint size (weights + optimizer), MiB")
    p.add_argument("--steps", type=int, default=40, help="steps per phase (sync, then async)")
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--run-dir", help="where to write (default: a temporary directory, removed afterwards)")
    args = p.parse_args()
    torch.set_num_threads(1)  # one core trains, the other is free for the background writer
    model, optimizer, sampler = build(args.mib)
    config = {"mib": args.mib, "batch": args.batch}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="ckptfmt-stall-"))
    x = torch.randn(args.batch, 1024)

    def step() -> None:
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sampler.advance(args.batch)

    step()  # optimizer state exists from here on
    results: dict[str, dict[str, list[float]]] = {}
    for mode in ("sync", "async"):
        mgr = CheckpointManager(root / mode, keep_last=2, async_save=mode == "async")
        stalls: list[float] = []
        quiet_steps: list[float] = []  # steps with no save in flight
        busy_steps: list[float] = []  # async: steps while a save persists in the background
        held: list[float] = []  # how long the optimizer.step() after each save waited for the copy
        for i in range(1, args.steps + 1):
            persisting = mgr._inflight is not None and not mgr._inflight.done()
            before = mgr.held_seconds
            (busy_steps if persisting else quiet_steps).append(timed(step))
            if i > 1 and (i - 1) % args.every == 0:
                held.append(mgr.held_seconds - before)
            if i % args.every == 0:
                stalls.append(
                    timed(lambda: mgr.save(i, model=model, optimizer=optimizer, sampler=sampler, config=config))
                )
        mgr.close()
        results[mode] = {"stall": stalls, "quiet": quiet_steps, "busy": busy_steps, "held": held}

    # the parts of the async stall, measured alone
    buffers = state.HostBuffers()

    def to_host() -> None:
        state.capture_model(model, state.Snapshot(), buffers)
        state.capture_optimizer(optimizer, state.Snapshot(), buffers)

    snap_parts = {
        "snapshot to host buffers (weights + optimizer)": to_host,
        "git lookup (the manager does it once, at start, not per save)": lambda: provenance.capture(step=1),
        "full capture, as the manager does it (all seven fields)": lambda: api.capture(
            step=1, model=model, optimizer=optimizer, sampler=sampler, config=config, buffers=buffers, code={}
        ),
    }
    parts = {name: statistics.median(timed(fn) for _ in range(5)) for name, fn in snap_parts.items()}
    if not args.run_dir:
        shutil.rmtree(root, ignore_errors=True)

    # an async save's stall: the save() call, plus the time the next optimizer.step() waited in the
    # manager's step pre-hook for parameters and optimizer state to be copied (CheckpointManager.held_seconds)
    hold = results["async"]["held"]
    results["async"]["stall"] = [s + h for s, h in zip(results["async"]["stall"], hold + [0.0] * 99, strict=False)]
    sync = statistics.median(results["sync"]["stall"])
    asyn = statistics.median(results["async"]["stall"])
    print(
        f"checkpoint: {nbytes / 2**20:.0f} MiB (weights + AdamW moments), "
        f"{args.steps} steps per mode, a save every {args.every}"
    )
    print(f"sync  stall per save: median {sync * 1e3:8.1f} ms  (n={len(results['sync']['stall'])})")
    print(
        f"async stall per save: median {asyn * 1e3:8.1f} ms  (n={len(results['async']['stall'])}; save() call "
        f"plus the next optimizer.step()'s wait for the copy, median {statistics.median(hold or [0]) * 1e3:.1f} ms)"
    )
    print(f"async / sync: {asyn / sync:.1%}  (goal <= 5%: {'met' if asyn <= 0.05 * sync else 'NOT met'})")
    for name, seconds in parts.items():
        print(f"  {name}: {seconds * 1e3:.1f} ms")
    quiet = statistics.median(results["sync"]["quiet"] + results["async"]["quiet"])
    if results["async"]["busy"]:
        busy = statistics.median(results["async"]["busy"])
        print(
            f"step time: {quiet * 1e3:.1f} ms alone, {busy * 1e3:.1f} ms while a save persists "
            f"({busy / quiet - 1:+.0%}, n={len(results['async']['busy'])})"
        )
    print(
        "stalls (ms): sync",
        [round(s * 1e3, 1) for s in results["sync"]["stall"]],
        "async",
        [round(s * 1e3, 1) for s in results["async"]["stall"]],
    )


if __name__ == "__main__":
    main()
