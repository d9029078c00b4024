"""No restart under torchft: what a lost replica group costs the survivors, what its replacement's heal costs, and
what the heal moves against torchft's own HTTP transport, in one run.

    python bench/no_restart.py [--repeat 3] [--params-mib 64] [--steps 60] [--json FILE]

Every phase runs on this host, on loopback: torchft's lighthouse in this process (a dead group is dropped after
500 ms without a heartbeat, a quorum waits 100 ms for stragglers: tests/torchft_cluster.py), replica groups as
processes running ``examples/torchft_train.py`` (one rank each, gloo on CPU, AdamW, ReplicaBatches, a memory
snapshot every committed step, torchft's timeouts as that file states them).

1. **Survivor stall**: two groups; group 1 SIGKILLs itself in the middle of step 12 (after its quorum, before its
   gradients are reduced). The stall is the time from the kill to the survivor's next committed step, against the
   survivor's median step time before the kill. Same pid throughout: the survivor never restarts.
2. **Replacement heal**: a new process for group 1 on a new node (an empty memory directory) joins and heals from
   the survivor. Its phases, from its own timestamps: start (process start to torchft's Manager made: imports,
   model, CheckpointManager, transport), quorum (to the heal's first request), transfer (the checked files), apply
   (all seven fields, in place), first step (to its first committed step), total.
3. **Heal transfer against torchft's HTTPTransport**, in this process, on the same state (an MLP of
   ``--params-mib`` MiB of fp32 parameters with AdamW's state, about three times that): ckptfmt's transport serving
   a memory snapshot (the training state: checked files into the receiver's staging directory, then loaded in
   place), ckptfmt's transport on the state dict as torchft hands it (any tree: a snapshot written, checked,
   read back), and torchft's ``HTTPTransport`` (a ``torch.save`` stream, nothing checked). Bytes, seconds, GB/s,
   and the ratio to HTTPTransport.
4. **The memory tier's cost under torchft**: the median step time of two groups with a memory snapshot every step
   against none (steps 6 on).

No assertion: the figures depend on the machine; docs/benchmarks.md has them with the command that made them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from torchft_cluster import cluster, steps_by_number  # type: ignore[import-not-found]  # noqa: E402


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_times(records: list[dict[str, Any]], first: int = 6) -> list[float]:
    steps = steps_by_number(records)
    return [steps[s]["t"] - steps[s - 1]["t"] for s in sorted(steps) if s > first and s - 1 in steps]


def kill_and_heal(root: Path, steps: int, sleep: float) -> dict[str, Any]:
    with cluster(root, steps=steps, step_sleep=sleep) as job:
        survivor = job.start(0)
        job.start(1, "--die-at-step", "12")
        died = job.wait_for(1, lambda r: r["event"] == "die")
        replacement = job.start(1, generation=1)
        healed = job.wait_for(1, lambda r: r["event"] == "healed" and r["pid"] == replacement.pid)
        survivor.wait(timeout=300)
        replacement.wait(timeout=300)
        mine = [r for r in job.records(0) if r["event"] == "step"]
        assert {r["pid"] for r in mine} == {survivor.pid}, "the survivor restarted"
        before = [r for r in mine if r["t"] <= died["t"]]
        after = [r for r in mine if r["t"] > died["t"]]
        start = next(r for r in job.records(1) if r["event"] == "start" and r["pid"] == replacement.pid)
        transfer, apply = healed["phases"]["transfer"], healed["phases"]["apply"]
        return {
            "stall_s": after[0]["t"] - died["t"],
            "step_s": median([b["t"] - a["t"] for a, b in itertools.pairwise(before[5:])]),
            "quorum_after_kill": after[0]["participants"],
            "start_s": start["ready"] - start["started"],
            "quorum_s": healed["began"] - start["ready"],
            "transfer_s": transfer,
            "apply_s": apply,
            "first_step_s": healed["t"] - (healed["began"] + transfer + apply),
            "total_s": healed["t"] - start["started"],
            "heal_bytes": healed["bytes_read"],
            "source": healed["sources"]["*"].rsplit("(", 1)[-1].rstrip(")"),
        }


def memory_cost(root: Path, steps: int, sleep: float) -> dict[str, float]:
    out = {}
    for label, every in (("memory_every_1", "1"), ("memory_off", "0")):
        with cluster(root / label, steps=steps, step_sleep=sleep) as job:
            groups = [job.start(g, "--memory-every", every) for g in (0, 1)]
            for g in groups:
                g.wait(timeout=300)
            out[label] = median(step_times(job.records(0)))
    return out


def transfer(params_mib: int, repeat: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchft.checkpointing.http_transport import HTTPTransport

    from ckptfmt.torch import CheckpointManager, MemoryOptions, ReplicaBatches, TrainingState
    from ckptfmt.torch.ft_transport import CkptfmtTransport

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    width = int((params_mib * (1 << 20) / 4 / 2) ** 0.5)  # two square layers

    def group(seed: int, tmp: str, name: str) -> tuple[Any, ...]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
        batches = ReplicaBatches(1024, batch_size=4, seed=1)
        state = TrainingState(model=model, optimizer=optimizer, sampler=batches, config={"width": width})
        manager = CheckpointManager(
            f"{tmp}/{name}", memory=MemoryOptions(every=1, memory_dir=f"{tmp}/mem-{name}"), preemption_signals=()
        )
        return model, optimizer, state, manager

    results: dict[str, list[tuple[float, int]]] = {"ckptfmt_memory": [], "ckptfmt_tree": [], "torchft_http": []}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        _, _, sent_state, sender_mgr = group(0, tmp, "a")
        _, _, got_state, receiver_mgr = group(1, tmp, "b")
        sender_mgr.checkpoint_if_due(1, sent_state, every=1000)
        sender_mgr.wait_memory()
        timeout = timedelta(seconds=120)
        a = CkptfmtTransport(manager=sender_mgr, state=sent_state, host="127.0.0.1", timeout=timeout)
        b = CkptfmtTransport(manager=receiver_mgr, state=got_state, host="127.0.0.1", timeout=timeout)
        tree = {
            "user": {"default": {"model": sent_state.model.state_dict(), "optim": sent_state.optimizer.state_dict()}},
            "torchft": {"step": 1, "batches_committed": 1},
        }
        http_a, http_b = HTTPTransport(timeout=timeout, num_chunks=0), HTTPTransport(timeout=timeout, num_chunks=0)
        nbytes = sum(t.numel() * t.element_size() for t in sent_state.model.state_dict().values())
        nbytes += sum(v.numel() * v.element_size() for e in sent_state.optimizer.state.values() for v in e.values())
        for _ in range(repeat):
            started = time.perf_counter()
            a.send_checkpoint([1], 1, {"user": {"default": a.state_dict()}, "torchft": tree["torchft"]}, timeout)
            got = b.recv_checkpoint(0, a.metadata(), 1, timeout)
            b.load_state_dict(got["user"]["default"])
            a.disallow_checkpoint()
            results["ckptfmt_memory"].append((time.perf_counter() - started, receiver_mgr.last_restore.bytes_read))
            for kind, (send, recv) in (("ckptfmt_tree", (a, b)), ("torchft_http", (http_a, http_b))):
                started = time.perf_counter()
                send.send_checkpoint([1], 1, tree, timeout)
                got = recv.recv_checkpoint(0, send.metadata(), 1, timeout)
                user = got["user"]["default"]  # applied as torchft's Manager would, with the user's load_state_dict
                got_state.model.load_state_dict(user["model"])
                got_state.optimizer.load_state_dict(user["optim"])
                send.disallow_checkpoint()
                results[kind].append((time.perf_counter() - started, nbytes))
                del got
        for t in (a, b, http_a, http_b):
            t.shutdown()
        sender_mgr.close(persist=False)
        receiver_mgr.close(persist=False)
    out = {}
    base = median([s for s, _ in results["torchft_http"]])
    for kind, runs in results.items():
        seconds = median([s for s, _ in runs])
        out[kind] = {
            "bytes": runs[0][1],
            "seconds": seconds,
            "GB_s": runs[0][1] / seconds / 1e9,
            "x_http": base / seconds,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--params-mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [kill_and_heal(Path(tmp) / f"kill{i}", args.steps, args.step_sleep) for i in range(args.repeat)]
        cost = memory_cost(Path(tmp) / "cost", args.steps, args.step_sleep)
    heal: dict[str, Any] = {key: median([r[key] for r in runs]) for key in runs[0] if key != "source"}
    heal["sources"] = [r["source"] for r in runs]
    moved = transfer(args.params_mib, args.repeat)
    print(
        f"survivor: stall {heal['stall_s']:.3f} s from the kill to its next step (its steps: {heal['step_s']:.3f} s),"
        f" quorum after the kill: {heal['quorum_after_kill']:.0f} group; medians of {args.repeat}"
    )
    print(
        "replacement: "
        + ", ".join(
            f"{k.removesuffix('_s')} {heal[k]:.3f} s"
            for k in ("start_s", "quorum_s", "transfer_s", "apply_s", "first_step_s", "total_s")
        )
        + f"; {heal['heal_bytes']:.0f} bytes healed from {heal['sources']}"
    )
    for kind, row in moved.items():
        print(
            f"heal transfer {kind:15s} {row['bytes'] / 2**20:8.1f} MiB {row['seconds']:7.3f} s "
            f"{row['GB_s']:6.2f} GB/s  x{row['x_http']:.2f} of torchft's HTTPTransport"
        )
    print(
        f"step time under torchft: memory tier every step {cost['memory_every_1']:.4f} s, without "
        f"{cost['memory_off']:.4f} s (x{cost['memory_every_1'] / cost['memory_off']:.3f}, --step-sleep "
        f"{args.step_sleep} s included)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"heal": heal, "transfer": moved, "memory_cost": cost}, indent=2))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
