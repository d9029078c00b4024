"""What a bad step costs under the guard: the time from the trigger to the next good step, split into detection,
agreement, restore and replay, against restarting from the newest durable checkpoint, in one run.

    python bench/rollback.py [--params-mib 32] [--steps 20] [--repeat 3] [--json FILE]

One process, one rank: an MLP of ``--params-mib`` MiB of fp32 parameters with AdamW (three times that of state), a
shuffling ``ResumableDataLoader``, a memory snapshot every step and a durable save every ``--steps // 2`` steps,
``mgr.guard`` between backward and optimizer step (examples in ckptfmt/torch/guard.py). Three cases:

1. **transient**: the loss of step ``--steps - 2`` is NaN on its first attempt only. Trigger → rollback → the replay
   is clean and is the step: detect, agree, restore (the memory snapshot, in place), replay (the step again, forward,
   backward and the guard), total.
2. **bad data**: a sample of that step makes the loss NaN wherever it is: the rollback, the replay that trips again,
   the quarantine and second rollback, and the step again on the next samples, which is good.
3. **restart from the durable checkpoint** instead: a new process (imports, model, ``restore_latest`` from the run
   directory as it was at the trigger, without the memory tier) up to its first step done, as a job without the
   guard would pay, plus the steps since that checkpoint, which it must train again (at the step time measured here).

No assertion: the figures depend on the machine; docs/benchmarks.md has them with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ckptfmt.torch import CheckpointManager, MemoryOptions, ResumableDataLoader, TrainingState
from ckptfmt.torch.guard import GuardOptions

RESTART = r"""
import sys, time
started = time.perf_counter()
import torch
from torch import nn
sys.path.insert(0, sys.argv[3])
import rollback
model, optimizer, loader = rollback.build(int(sys.argv[2]))
from ckptfmt.torch import CheckpointManager, TrainingState
state = TrainingState(model=model, optimizer=optimizer, loader=loader, config={"bench": "rollback"})
mgr = CheckpointManager(sys.argv[1], preemption_signals=())
step = mgr.restore_latest(state)
restored = time.perf_counter()
for xb, yb, _ in loader:
    nn.functional.mse_loss(model(xb), yb).backward(); optimizer.step(); optimizer.zero_grad()
    break
print(step, restored - started, time.perf_counter() - started)
"""


def build(params_mib: int) -> tuple[nn.Module, torch.optim.Optimizer, ResumableDataLoader[Any]]:
    torch.manual_seed(0)
    width = int((params_mib * (1 << 20) / 4 / 2) ** 0.5)
    x = torch.randn(1024, width)
    y = torch.randn(1024, width)
    index = torch.arange(len(x))
    loader: ResumableDataLoader[Any] = ResumableDataLoader(
        TensorDataset(x, y, index), batch_size=16, seed=1, shuffle=True
    )
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader


def guarded(
    root: Path, params_mib: int, steps: int, bad_step: int, always: bool, keep: Path | None = None
) -> dict[str, float]:
    model, optimizer, loader = build(params_mib)
    state = TrainingState(model=model, optimizer=optimizer, loader=loader, config={"bench": "rollback"})
    mgr = CheckpointManager(
        root, memory=MemoryOptions(every=1, memory_dir=root / "memory"), guard=GuardOptions(), preemption_signals=()
    )
    attempts = 0
    bad_sample: int | None = None  # bad data: the first sample of the bad step's batch is NaN wherever it appears
    step = 0
    times: dict[str, float] = {}
    step_seconds: list[float] = []
    mgr.checkpoint_if_due(0, state, every=steps // 2)
    while step < steps:
        for xb, yb, ib in loader:
            began = time.perf_counter()
            loss = nn.functional.mse_loss(model(xb), yb)
            if step + 1 == bad_step:
                attempts += 1
                if always and bad_sample is None:
                    bad_sample = int(ib[0])
                if not always and attempts == 1:
                    loss = loss * math.nan
            if bad_sample is not None and bad_sample in ib.tolist():
                loss = loss * math.nan
            loss.backward()  # type: ignore[no-untyped-call]
            verdict = mgr.guard(step + 1, state, loss=loss)
            if verdict.rolled_back:
                assert verdict.event is not None
                if "trigger" not in times:
                    times["trigger"] = began
                    if keep is not None:  # the run directory as a restart would find it now (durable saves only)
                        copied = time.perf_counter()
                        copy_run(root, keep)
                        times["trigger"] += time.perf_counter() - copied  # the copy is the bench's, not the guard's
                    times.update({k: v for k, v in verdict.event.phases.items()})
                else:
                    times["second_rollback"] = time.perf_counter() - began
                times["rolled_back_at"] = time.perf_counter()
                step = verdict.step
                break
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            now = time.perf_counter()
            if "trigger" in times and "next_good" not in times:
                times["next_good"] = now
                times["replay"] = now - times["rolled_back_at"]
            elif "trigger" not in times and step > 2:
                step_seconds.append(now - began)
            mgr.checkpoint_if_due(step, state, every=steps // 2)
            if step >= steps:
                break
    mgr.close(persist=False)
    out: dict[str, float] = {k: times[k] for k in ("detect", "agree", "restore", "replay") if k in times}
    if "second_rollback" in times:
        out["second_rollback"] = times["second_rollback"]
    out["total"] = times["next_good"] - times["trigger"]
    out["step"] = statistics.median(step_seconds)
    return out


def copy_run(root: Path, to: Path) -> None:
    """The run directory without the memory tier; a durable copy still being written (the memory tier persists
    the snapshot a rollback restored) is left out or copied part way: a restore passes over it."""
    try:
        shutil.copytree(root, to, ignore=shutil.ignore_patterns("memory", "*.tmp-*"))
    except shutil.Error:
        pass  # a temp file renamed or removed while copied


def restart(root: Path, params_mib: int) -> dict[str, float]:
    here = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", RESTART, str(root), str(params_mib), here], capture_output=True, text=True, check=True
    )
    step, restored, first = done.stdout.split()[-3:]
    return {"resumed_at": float(step), "start_and_restore": float(restored), "first_step_done": float(first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-mib", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bad = args.steps - 2
    results: dict[str, list[dict[str, float]]] = {"transient": [], "bad data": [], "restart": []}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            at_trigger = Path(tmp) / "at-trigger"
            transient = guarded(Path(tmp) / "t", args.params_mib, args.steps, bad, always=False, keep=at_trigger)
            results["transient"].append(transient)
            results["bad data"].append(guarded(Path(tmp) / "b", args.params_mib, args.steps, bad, always=True))
            results["restart"].append(restart(at_trigger, args.params_mib))
    med = {case: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for case, runs in results.items()}
    step = med["transient"]["step"]
    redo = (bad - 1 - med["restart"]["resumed_at"]) * step  # the steps a restart trains again
    restart_total = med["restart"]["first_step_done"] + redo
    for case in ("transient", "bad data"):
        row = med[case]
        parts = ", ".join(
            f"{k} {row[k] * 1e3:.1f} ms"
            for k in ("detect", "agree", "restore", "second_rollback", "replay")
            if k in row
        )
        print(
            f"{case:9s}: trigger -> next good step {row['total'] * 1e3:.1f} ms ({parts}); a step takes "
            f"{row['step'] * 1e3:.1f} ms; x{restart_total / row['total']:.1f} faster than a restart"
        )
    r = med["restart"]
    print(
        f"restart  : new process -> restored {r['start_and_restore']:.2f} s, first step done "
        f"{r['first_step_done']:.2f} s, from step {r['resumed_at']:.0f}, plus {redo:.2f} s to train again the "
        f"{bad - 1 - r['resumed_at']:.0f} steps since: {restart_total:.2f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(med, indent=2))


if __name__ == "__main__":
    main()
