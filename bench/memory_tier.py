"""The memory tier against today's saves, in one run: the trainer's cost per snapshot, durable saves made from
memory against async saves, and the time from a kill to the first resumed step from memory against from disk.

    python bench/memory_tier.py [--mib 16 64 256] [--steps 40] [--every 8] [--rounds 7] [--block 8] [--json FILE]
                                [--no-torchrun]

For each state size (weights + two AdamW moments, float32, per rank; one rank, CPU, one training thread)
one process trains an MLP through phases, each ``--steps`` steps, same model and data:

- ``plain``: no checkpoint at all (the baseline step time: measured first and last, the faster taken, after a
  warm-up phase that is not reported);
- ``memory``: ``CheckpointManager(memory_every=1)`` with durable saves off (every step a snapshot): the
  trainer's blocking time per snapshot (capture on the trainer's thread plus ``optimizer.step()`` held for
  the background copy) and the step-time inflation against ``plain``; beside it the peer a trainer would
  write by hand, ``torch.save(state_dict)`` into the same tmpfs on the trainer's thread; and the CPU seconds
  (``time.process_time``, every thread) snapshots add per GiB snapshotted, against ``plain``;
- ``memory+durable``: memory every step, durable every ``--every`` steps made from memory (a byte copy of
  the slot, throttled): median step time while a persist is in flight;
- ``async``: today's ``CheckpointManager(async_save=True)`` every ``--every`` steps: median step time while
  its save is in flight;
- ``interleaved``: the step time at ``memory_every=1`` and with ``torch.save`` into tmpfs every step, against no
  checkpoint, in alternating blocks of one model (``--rounds`` x ``--block`` steps per arm): the figure that holds
  against this VM's drift between phases (the phases' ratios take the faster of two plain phases minutes apart).

Then the recovery: a worker process trains to a step past the last durable save, is SIGKILLed, the page cache
is dropped (a restarted node's cache does not hold the run directory; tmpfs pages stay), and a fresh process
resumes; once with the memory tier (restores from memory), once without (restores from the run
directory, losing the steps since the durable save). Phases of the restart: process start and imports,
restore, first step (detection is the launcher's: torchrun's ``--monitor-interval``, 0.1-5 s). No
assertion: the figures depend on the machine; they go to docs/benchmarks.md with the command that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the MLP's width: its tensors are WIDTH x WIDTH float32 (1 MiB at 512, 16 MiB at 2048); the per-tensor costs of a
# snapshot (capture, planning, the manifest) weigh against the per-byte ones (copy, hash) as the width falls
WIDTH = int(os.environ.get("CKPTFMT_BENCH_WIDTH", "512"))


def set_width(width: int) -> None:
    """The MLP's width, here and in the recovery workers (which read it from the environment)."""
    global WIDTH
    WIDTH = width
    os.environ["CKPTFMT_BENCH_WIDTH"] = str(width)


def build(mib: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    from ckptfmt.torch import ResumableSampler

    layers = max(1, (mib << 20) // (3 * 4 * WIDTH * WIDTH))  # weights + two AdamW moments, float32
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(layers)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), ResumableSampler(1 << 16, seed=0)


def state_shape(mib: int) -> tuple[int, float]:
    """How many tensors the state has and the size of the large ones (weights and both moments; biases aside)."""
    layers = max(1, (mib << 20) // (3 * 4 * WIDTH * WIDTH))
    return 3 * 2 * layers, WIDTH * WIDTH * 4 / (1 << 20)


def step(model: Any, optimizer: Any, batch: int) -> None:
    import torch

    x = torch.randn(batch, WIDTH)
    loss = model(x).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def phase(name: str, args: argparse.Namespace, mib: int, work: Path) -> dict[str, Any]:
    import torch

    from ckptfmt.torch import CheckpointManager

    model, optimizer, sampler = build(mib)
    step(model, optimizer, args.batch)  # optimizer state exists from here on
    options: dict[str, Any] = {"keep_last": 2, "preemption_signals": ()}
    every = args.every if name in ("memory+durable", "async") else 10**9
    if name.startswith("memory"):
        options.update(memory_every=1, memory_dir=work / "shm")
    if name == "async":
        options["async_save"] = True
    mgr = CheckpointManager(work / name, **options) if name not in ("plain", "torch.save") else None
    times, busy, idle, stalls = [], [], [], []
    cpu_start = time.process_time()  # every thread of this process: the trainer's and the background work's
    for i in range(1, args.steps + 1):
        sampler.advance(args.batch)
        inflight = mgr is not None and _in_flight(mgr)
        start = time.perf_counter()
        step(model, optimizer, args.batch)
        mid = time.perf_counter()
        if mgr is not None:
            mgr.checkpoint_if_due(i, every=every, model=model, optimizer=optimizer, sampler=sampler, config={"m": mib})
        elif name == "torch.save":
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, work / "shm-torch.pt")
        end = time.perf_counter()
        times.append(end - start)
        stalls.append(end - mid)
        if inflight:
            busy.append(end - start)
        elif i > 2:
            idle.append(end - start)
    out: dict[str, Any] = {"step_s": statistics.median(times[2:]), "stall_s": statistics.median(stalls[2:])}
    out["cpu_s_per_step"] = (time.process_time() - cpu_start) / args.steps
    if busy:
        out["step_while_persisting_s"] = statistics.median(busy)
        out["steps_while_persisting"] = len(busy)
        out["step_not_persisting_s"] = statistics.median(idle) if idle else out["step_s"]
    if mgr is not None:
        memory = mgr._memory
        if memory is not None and memory.snapshots:
            out["blocking_s"] = (memory.capture_seconds + memory.held_seconds) / memory.snapshots
            out["held_s"] = memory.held_seconds / memory.snapshots
            out["skipped"] = memory.skipped
            out["snapshots"] = memory.snapshots
        if name == "async":
            out["held_s"] = mgr.held_seconds / max(1, args.steps // args.every)
        mgr.close()
        if memory is not None and memory.last_persisted is not None:
            out["persist_s"] = memory.last_persisted.seconds
    return out


ARMS = ("plain", "memory", "torch.save")  # the interleaved comparison's arms: the baseline first


def interleaved(args: argparse.Namespace, mib: int, work: Path) -> dict[str, Any]:
    """Step time with a snapshot every step against no checkpoint and against ``torch.save`` into tmpfs, in
    alternating blocks of one model and one manager (``--rounds`` x ``--block`` steps each, the arms' order rotated
    every round): this VM's step time drifts between phases minutes apart by as much as the snapshot costs (45 and
    50 ms for two plain phases of one run), and blocks next to each other share that drift. A snapshot block ends
    with ``wait_memory()``, outside the clock, so no snapshot runs into the next block. Per round, each arm's
    median step over the no-checkpoint block's; reported as the median over rounds and its range."""
    import torch

    from ckptfmt.torch import CheckpointManager

    model, optimizer, sampler = build(mib)
    step(model, optimizer, args.batch)
    mgr = CheckpointManager(work / "run", keep_last=2, preemption_signals=(), memory_every=1, memory_dir=work / "shm")
    arms = ARMS
    counter = 0

    def block(arm: str) -> float:
        nonlocal counter
        times = []
        for _ in range(args.block):
            counter += 1
            sampler.advance(args.batch)
            start = time.perf_counter()
            step(model, optimizer, args.batch)
            if arm == "memory":
                mgr.checkpoint_if_due(
                    counter, every=10**9, model=model, optimizer=optimizer, sampler=sampler, config={"m": mib}
                )
            elif arm == "torch.save":
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(state, work / "shm" / "torch.pt")
            times.append(time.perf_counter() - start)
        if arm == "memory":
            mgr.wait_memory()
        return statistics.median(times[1:])  # the block's first step may wait for what the last block left

    try:
        for arm in arms:  # a warm-up block each: first snapshots allocate their slots, torch.save its file
            block(arm)
        ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
        plain: list[float] = []
        orders: list[tuple[str, ...]] = []
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            orders.append(order)
            medians = {arm: block(arm) for arm in order}
            plain.append(medians["plain"])
            for arm in arms[1:]:
                ratios[arm].append(medians[arm] / medians["plain"])
        snapshots = mgr._memory.snapshots if mgr._memory is not None else 0
    finally:
        mgr.close(persist=False)
    out: dict[str, Any] = {"rounds": args.rounds, "block": args.block, "plain_step_s": statistics.median(plain)}
    out["snapshots"] = snapshots
    out["orders"] = orders
    for arm, values in ratios.items():
        out[arm] = {"median": statistics.median(values), "min": min(values), "max": max(values), "ratios": values}
    return out


def _in_flight(mgr: Any) -> bool:
    memory = mgr._memory
    if memory is not None:
        return any(not f.done() for f in memory._persists)
    return mgr._inflight is not None and not mgr._inflight.done()


WORKER = """
import json, os, signal, sys, time
t0 = float(sys.argv[5])
sys.path.insert(0, sys.argv[6])
import torch
from memory_tier import build, step
from ckptfmt.torch import CheckpointManager, prewarm
warm = prewarm()  # as a restarted worker does while its process group forms
imported = time.time()
mib, run_dir, shm, kill_at = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
model, optimizer, sampler = build(mib)
options = {"memory_every": 1, "memory_dir": shm} if shm != "-" else {}
mgr = CheckpointManager(run_dir, keep_last=2, **options)
built = time.time()
warm.join()
step_no = mgr.restore_latest(model=model, optimizer=optimizer, sampler=sampler, config={"m": mib}) or 0
restored = time.time()
report = mgr.last_restore.to_dict() if mgr.last_restore else None
while True:
    sampler.advance(64)
    step(model, optimizer, 64)
    step_no += 1
    if kill_at < 0:
        print(json.dumps({"imported": imported - t0, "built": built - imported, "restored": restored - built,
                          "first_step": time.time() - restored, "report": report}), flush=True)
        mgr.close()
        sys.exit(0)
    mgr.checkpoint_if_due(step_no, every=8, model=model, optimizer=optimizer, sampler=sampler, config={"m": mib})
    if step_no == kill_at:
        mgr.wait_memory() if options else mgr.wait()
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _scratch(work: Path, mib: int, name: str, shm_parent: Path) -> Path:
    scratch = work / f"{mib}-{name}"
    scratch.mkdir(parents=True)
    (scratch / "shm").symlink_to(Path(tempfile.mkdtemp(dir=shm_parent)), target_is_directory=True)
    return scratch


def drop_page_cache() -> bool:
    """A restarted node's page cache does not hold the run directory (tmpfs pages are not cache: they stay)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def recovery(mib: int, memory: bool, work: Path) -> dict[str, Any]:
    run_dir, shm = work / f"recover-{memory}", work / "shm-recover" if memory else "-"
    script = work / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = str(Path(__file__).resolve().parent)
    base = [sys.executable, str(script), str(mib), str(run_dir), str(shm)]
    subprocess.run([*base, "13", "0", here], env=env, check=False, capture_output=True)  # killed after step 13
    drop_page_cache()
    start = time.time()
    done = subprocess.run([*base, "-1", str(start), here], env=env, check=True, capture_output=True, text=True)
    total = time.time() - start
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out["kill_to_first_step"] = total
    out["resumed_step"] = out["report"]["step"] if out["report"] else None
    return out


def recovery_torchrun(work: Path, memory: bool) -> dict[str, Any]:
    """examples/train.py on 2 ranks under torchrun, rank 1 SIGKILLed after step 10 (durable saves every 8):
    the restart split into detect (until the agent signals the survivor), restart (the survivor stopped and new
    worker processes created), import, process group and model, restore, first step."""
    import re
    from datetime import datetime

    here = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
    cmd += [str(here / "examples" / "train.py"), "--run-dir", str(work / f"torchrun-{memory}"), "--steps", "12"]
    cmd += ["--every", "8", "--kill-at-step", "10", "--kill-rank", "1"]
    if memory:
        cmd += ["--memory-every", "1", "--memory-dir", str(work / "shm-torchrun")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    out = done.stdout
    killed = float(re.search(r"SIGKILL at ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # the agent's first reaction to the death: it sends the surviving worker SIGTERM (logged with a timestamp)
    stamp = re.search(r"[EWI](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*closing signal SIGTERM", done.stderr)
    assert stamp is not None, done.stderr[-2000:]
    year = datetime.fromtimestamp(killed).year
    detected = datetime.strptime(f"{year}{stamp.group(1)} {stamp.group(2)}", "%Y%m%d %H:%M:%S.%f").timestamp()
    times = re.search(
        r"attempt 1 timings: process started at ([\d.]+), imports done at ([\d.]+), process group and model "
        r"ready at ([\d.]+), restored at ([\d.]+)",
        out,
    )
    first = float(re.search(r"first step of attempt 1 done at ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert times is not None, out[-2000:]
    started, imported, ready, restored = (float(g) for g in times.groups())
    resumed = re.search(r"resumed at step (\d+) .*attempt=1", out)
    return {
        "resumed_step": int(resumed.group(1)) if resumed else None,
        "detect": detected - killed,
        "detect_and_restart": started - killed,
        "import": imported - started,
        "group_and_model": ready - imported,
        "restore": restored - ready,
        "first_step": first - restored,
        "kill_to_first_step": first - killed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[16, 64, 256], help="state sizes per rank, MiB")
    p.add_argument("--steps", type=int, default=40, help="steps per phase")
    p.add_argument("--every", type=int, default=8, help="durable cadence of the memory+durable and async phases")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7, help="rounds of the interleaved comparison")
    p.add_argument("--block", type=int, default=8, help="steps per arm and round in the interleaved comparison")
    p.add_argument("--width", type=int, default=WIDTH, help="the MLP's width: tensors of width x width float32")
    p.add_argument("--dir", help="where to write (default: a temporary directory on local disk, removed afterwards)")
    p.add_argument("--json", type=Path, help="write every figure as JSON")
    p.add_argument("--no-torchrun", action="store_true", help="skip the 2-rank torchrun kill-and-restart phases")
    args = p.parse_args()
    set_width(args.width)
    import torch

    torch.set_num_threads(1)  # one core trains, the other is free for the background work
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptfmt-memory-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    # every memory directory of the run under one in tmpfs, removed at the end whatever happened: tmpfs is memory,
    # and a phase that failed (or the warm-up, which removes nothing) would leave its slots there
    shm_parent = Path(
        tempfile.mkdtemp(prefix="ckptfmt-memory-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else work)
    )
    results: dict[str, Any] = {}
    try:
        for mib in args.mib:
            figures: dict[str, Any] = {}
            phase("plain", args, mib, _scratch(work, mib, "warm-up", shm_parent))  # first touches, lazy imports
            for name in ("plain", "torch.save", "memory", "memory+durable", "async", "plain-again"):
                scratch = _scratch(work, mib, name, shm_parent)
                figures[name] = phase(name.removesuffix("-again"), args, mib, scratch)
                shutil.rmtree((scratch / "shm").resolve(), ignore_errors=True)
                print(f"{mib} MiB {name}: {json.dumps(figures[name])}", file=sys.stderr, flush=True)
            figures["interleaved"] = interleaved(args, mib, _scratch(work, mib, "interleaved", shm_parent))
            shutil.rmtree((work / f"{mib}-interleaved" / "shm").resolve(), ignore_errors=True)
            print(f"{mib} MiB interleaved: {json.dumps(figures['interleaved'])}", file=sys.stderr, flush=True)
            rec = work / f"{mib}-recovery"
            rec.mkdir()
            (rec / "shm-recover").symlink_to(Path(tempfile.mkdtemp(dir=shm_parent)), target_is_directory=True)
            figures["recover_memory"] = recovery(mib, True, rec)
            figures["recover_durable"] = recovery(mib, False, rec)
            shutil.rmtree((rec / "shm-recover").resolve(), ignore_errors=True)
            figures["tensors"], figures["tensor_mib"] = state_shape(mib)
            results[str(mib)] = figures
        if not args.no_torchrun:
            shm = Path(tempfile.mkdtemp(dir=shm_parent))
            (work / "shm-torchrun").symlink_to(shm, target_is_directory=True)
            results["torchrun"] = {"memory": recovery_torchrun(work, True), "durable": recovery_torchrun(work, False)}
            shutil.rmtree(shm, ignore_errors=True)
            print(f"torchrun: {json.dumps(results['torchrun'])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(shm_parent, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print_table(results)


def print_torchrun(phases: dict[str, Any]) -> None:
    print(
        "\n| 2 ranks under torchrun, rank 1 SIGKILLed after step 10 | resumed at | detect + restart | import "
        "| group + model (prewarm joined) | restore | first step | kill → first step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = ("detect_and_restart", "import", "group_and_model", "restore", "first_step", "kill_to_first_step")
    for tier, f in phases.items():
        cells = " | ".join(f"{f[k]:.2f} s" for k in keys)
        print(f"| from {tier} | step {f['resumed_step']} | {cells} |")


def print_table(results: dict[str, Any]) -> None:
    results = dict(results)
    phases = results.pop("torchrun", None)
    print(
        "| state/rank | step | snapshot blocks trainer | step at memory_every=1 | torch.save to tmpfs | "
        "CPU-s per snapshot GiB | step while persisting from memory | step while async save | "
        "kill→first step: memory | : run dir |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mib, f in results.items():
        base = min(f["plain"]["step_s"], f["plain-again"]["step_s"])

        def x(v: float) -> str:
            return f"{v / base:.2f}x"

        mem, dur, asy = f["memory"], f["memory+durable"], f["async"]
        # what snapshots add to the process's CPU time (all threads), per GiB snapshotted: a snapshot a step
        plain_cpu = min(f["plain"]["cpu_s_per_step"], f["plain-again"]["cpu_s_per_step"])
        per_gib = (mem["cpu_s_per_step"] - plain_cpu) / (int(mib) / 1024)
        rm, rd = f["recover_memory"], f["recover_durable"]
        print(
            f"| {mib} MiB ({f['tensors']} tensors, the large {f['tensor_mib']:g} MiB) "
            f"| {base * 1e3:.0f} ms | {mem.get('blocking_s', 0) * 1e3:.1f} ms "
            f"| {x(mem['step_s'])} | {f['torch.save']['stall_s'] * 1e3:.1f} ms | {per_gib:.3f} "
            f"| {x(dur.get('step_while_persisting_s', dur['step_s']))} "
            f"({dur.get('step_while_persisting_s', 0) / dur.get('step_not_persisting_s', 1):.2f}x its other steps) "
            f"| {x(asy.get('step_while_persisting_s', asy['step_s']))} "
            f"| {rm['kill_to_first_step']:.2f} s (step {rm['resumed_step']}; start+import {rm['imported']:.2f}, "
            f"build {rm['built']:.2f}, restore {rm['restored']:.2f}, first step {rm['first_step']:.2f}) "
            f"| {rd['kill_to_first_step']:.2f} s (step {rd['resumed_step']}; restore {rd['restored']:.2f}) |"
        )
    print_interleaved(results)
    if phases:
        print_torchrun(phases)


def print_interleaved(results: dict[str, Any]) -> None:
    rows = {mib: f["interleaved"] for mib, f in results.items() if "interleaved" in f}
    if not rows:
        return
    print(
        "\n| state/rank, interleaved | step, no checkpoint | step at memory_every=1 | step with torch.save to tmpfs "
        "| rounds x steps per arm |"
    )
    print("|---|---|---|---|---|")
    for mib, f in rows.items():
        cells = " | ".join(
            f"{f[a]['median']:.2f}x ({f[a]['min']:.2f}-{f[a]['max']:.2f})" if a in f else "not run"
            for a in ("memory", "torch.save")
        )
        print(f"| {mib} MiB | {f['plain_step_s'] * 1e3:.0f} ms | {cells} | {f['rounds']} x {f['block']} |")


if __name__ == "__main__":
    main()
