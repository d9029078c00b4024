"""Recovery after a worker crash and after a node loss, from the memory tier (with cross-node replicas) against
from the run directory, and what replication costs while training, in one run.

    python bench/node_loss.py [--kill-at 6] [--steps 30] [--repeat 1] [--dir DIR] [--json FILE]

Every phase runs ``examples/train.py`` (FSDP2 over gloo, CPU) under ``torchrun`` on this one host, playing two
nodes of two ranks each as ``tests/test_node_loss.py`` does: ``--node-of-rank A,A,B,B`` gives each "node" its own
``CKPTFMT_NODE_KEY`` and memory directory (``<memory dir>/A``, ``/B``, on ``/dev/shm`` where there is one). A
relaunch keeps the torchrun rendezvous id, so it is the same job (``TORCHELASTIC_RUN_ID``), which the memory tier
requires to reuse its slots.

1. **Worker crash**: rank 1 is SIGKILLed once step ``--kill-at``'s memory snapshot is in; torchrun
   (``--max-restarts=1``) restarts the 4 ranks. With ``--memory-every 1 --replicate`` against the same run without
   the memory tier and a durable save at the kill step (``--every``), so both resume at the same step and
   only the restart differs.
2. **Node loss**: once step ``--kill-at``'s snapshot and replica are in (``--replica-sync``: in the background a
   round still running when the next snapshot commits is skipped, and a node loss then loses the steps since the
   last finished one; phase 3 counts them), every rank dies; node B's memory directory is deleted; the survivors
   are relaunched on 2 ranks (``--node-of-rank A,A``). From A's slot and its copies of B's files against from the
   run directory (durable save at the kill step).
3. **Replication's cost**: ``--steps`` steps on A,A,B,B with a memory snapshot every step, without and with
   ``--replicate``: mean step time from the arrival times of rank 0's step lines (steps 1-3 left out), the replica
   rounds skipped (a round still running when the next snapshot commits; the tier's INFO log), and the bytes a
   round copies to the other node (the peer copies' files on disk).
4. **Growing back**: after phase 2's survivors, 4 ranks on A,A,B,B with node B's memory empty: the bytes moved
   between nodes at that restore (``last-restore.json``).

Phases of a restart, from the trainer's own timestamps (rank 0) and torchrun's log: launcher knows (the kill to
the agent's "failed (exitcode ...)" line, when every worker of the attempt is gone: after a crash the survivors
were SIGTERMed and stopped, after a node loss all died), detect + restart (the kill to the new process started:
for a crash torchrun's ``--monitor-interval`` and in-job restart, for a node loss a new torchrun started by this
script), imports, rendezvous + model (process group, FSDP, ``prewarm`` joined), restore (and the report's own
seconds and phases), first step, total (the kill to the first resumed step done). ``--repeat`` runs each recovery
again (medians; the order of memory and run directory alternates). No assertion: the figures depend on the
machine; they go to docs/benchmarks.md with the command that made them. ``--dir`` keeps every torchrun's output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
# train.py sets logging to WARNING; the tier says at INFO which replica rounds it skipped
WRAPPER = """import logging, runpy, sys
logging.getLogger("ckptfmt").setLevel(logging.INFO)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
HEADER = """\
What this single 2-core host cannot show:
- network bandwidth and latency between real nodes: "nodes" A and B are sets of ranks on one machine, so a
  replica or a fetch between them is a gloo send over loopback, and its bytes compete for the same 2 cores;
- GPU copy overlap: CPU training, so a snapshot's device-to-host copy and its overlap with compute are absent;
- detection of a real node's death: a "node loss" here is every rank SIGKILLed and a new torchrun started by
  this script, not a scheduler noticing a dead host and rescheduling;
- scale: examples/train.py's model is fixed and tiny (tens of KiB of state per rank; it has no size flag),
  so restore and replication figures are per-operation overheads, not bandwidth.
The run directory is on local disk and its page cache is not dropped: a durable restore from S3 or NFS is slower.
"""


@dataclass
class Launch:
    """One torchrun: its exit status, rank 0's stdout lines with their arrival times, and stderr."""

    rc: int
    lines: list[tuple[float, str]]
    stderr: str
    ended: float
    restore: dict[str, Any] = field(default_factory=dict)  # the run directory's last-restore.json, if any

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line in self.lines)


class Bench:
    def __init__(self, work: Path, shm: Path, args: argparse.Namespace) -> None:
        self.work, self.shm, self.args = work, shm, args
        self.prefix = f"ckptfmt-node-loss-bench-{os.getpid()}"
        self.wrapper = work / "train_info_log.py"
        self.wrapper.write_text(WRAPPER)
        self.launches = 0

    def torchrun(self, job: str, nproc: int, *train_args: str, restarts: int = 0, ok: bool = True) -> Launch:
        """``job`` is the rendezvous id: a relaunch under the same one is the same job."""
        cmd = [str(TORCHRUN), "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={self.prefix}-{job}"]
        cmd += ["--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", "--monitor-interval=0.1"]
        cmd += [str(self.wrapper), str(TRAIN), "--keep-last", "100", "--peer-timeout", "60", *train_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.time()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        lines: list[tuple[float, str]] = []
        err: list[str] = []

        def stamp() -> None:
            assert proc.stdout is not None
            lines.extend((time.time(), line.rstrip("\n")) for line in proc.stdout)

        readers = [threading.Thread(target=stamp), threading.Thread(target=lambda: err.extend(proc.stderr or ()))]
        for t in readers:
            t.start()
        try:
            rc = proc.wait(timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session started above
            rc = proc.wait()
        ended = time.time()
        for t in readers:
            t.join()
        out = Launch(rc, lines, "".join(err), ended)
        self.launches += 1
        (self.work / f"{self.launches:02d}-{job}.log").write_text(out.stdout + "\n--- stderr\n" + out.stderr)
        if ok and rc != 0:
            raise SystemExit(f"{job} ({nproc} ranks) failed with {rc}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
        run_dir = Path(train_args[train_args.index("--run-dir") + 1])
        if (run_dir / "last-restore.json").exists():
            out.restore = json.loads((run_dir / "last-restore.json").read_text())
        print(f"  {job}: {nproc} ranks, exit {rc}, {ended - started:.1f} s", file=sys.stderr, flush=True)
        return out

    def run_args(self, name: str, memory: bool, *extra: str) -> list[str]:
        args = ["--run-dir", str(self.work / name), *extra]
        if memory:
            args += ["--memory-every", "1", "--memory-dir", str(self.shm / name), "--replicate"]
        return args

    # ---------------------------------------------------------------- 1. a worker crash

    def crash(self, memory: bool, i: int) -> dict[str, Any]:
        k = self.args.kill_at
        name = f"crash-{'memory' if memory else 'durable'}-{i}"
        every = "1000" if memory else str(k)
        args = self.run_args(name, memory, "--steps", str(k + 2), "--every", every, "--node-of-rank", "A,A,B,B")
        done = self.torchrun(name, 4, *args, "--kill-at-step", str(k), "--kill-rank", "1", restarts=1)
        killed = float(_find(r"SIGKILL at ([\d.]+)", done.stdout))
        out = restart_phases(done, killed, attempt=1, lost_at=k)
        # the agent's first reaction (SIGTERM to the survivors) and its word that they stopped, from its log
        out["detect"] = _agent_stamp(r"closing signal SIGTERM", done.stderr, killed) - killed
        out["stopped"] = _agent_stamp(r"failed \(exitcode", done.stderr, killed) - killed
        return out

    # ---------------------------------------------------------------- 2. a node loss, and 4. growing back

    def node_loss(self, memory: bool, i: int) -> dict[str, Any]:
        k = self.args.kill_at
        name = f"node-loss-{'memory' if memory else 'durable'}-{i}"
        every = "1000" if memory else str(k)
        args = self.run_args(name, memory, "--steps", str(k + 4), "--every", every)
        # --replica-sync: step k's replica is in before the node dies (a round in the background may have been
        # skipped, and a node loss then loses the steps since the last one; phase 3 counts the skipped rounds)
        sync = ["--replica-sync"] if memory else []
        lost = self.torchrun(
            name, 4, *args, *sync, "--node-of-rank", "A,A,B,B", "--lose-node-at-step", str(k), ok=False
        )
        _find(r"node lost at ([\d.]+)", lost.stdout)  # fails the bench, with the output, when none died as told
        killed = max(float(t) for t in re.findall(r"node lost at ([\d.]+)", lost.stdout))  # the last rank to die
        replicated = sorted({int(s) for s in re.findall(r"replica of step (\d+) is in", lost.stdout)})
        if memory:
            shutil.rmtree(self.shm / name / "B")  # the node is gone, and its memory with it
        back = self.torchrun(name, 2, *args, "--node-of-rank", "A,A", "--stop-at-step", str(k + 2))
        out = restart_phases(back, killed, attempt=0, lost_at=k)
        out["stopped"] = _agent_stamp(r"failed \(exitcode", lost.stderr, killed) - killed
        out["torchrun_exited"] = lost.ended - killed  # the relaunch starts here
        out["replicated_steps"] = replicated
        if memory:
            grown = self.torchrun(name, 4, *args, "--node-of-rank", "A,A,B,B")
            report = grown.restore
            ranks = report.get("ranks", [report])
            out["grow"] = {
                "step": report.get("step"),
                "bytes_between_nodes": report.get("bytes_between_nodes"),
                "bytes_read": sum(r["bytes_read"] for r in ranks),
                "tiers": [r["tier"] for r in ranks],
                "seconds": report.get("seconds"),
                "phases": report.get("phases"),
            }
        return out

    # ---------------------------------------------------------------- 3. replication's cost while training

    def training(self, replicate: bool) -> dict[str, Any]:
        name = f"train-{'replicate' if replicate else 'memory'}"
        args = ["--run-dir", str(self.work / name), "--steps", str(self.args.steps), "--every", "1000"]
        args += ["--memory-every", "1", "--memory-dir", str(self.shm / name), "--node-of-rank", "A,A,B,B"]
        done = self.torchrun(name, 4, *args, *(["--replicate"] if replicate else []))
        stamps = {int(m.group(1)): t for t, line in done.lines if (m := re.match(r"step (\d+) loss", line))}
        gaps = [stamps[s] - stamps[s - 1] for s in range(4, self.args.steps + 1)]  # steps 1-3: warm-up
        t = timings(done.stdout, 0)
        out: dict[str, Any] = {
            "steps_timed": len(gaps),
            "step_mean_s": statistics.fmean(gaps),
            "step_median_s": statistics.median(gaps),
            "start_to_ready_s": t["ready"] - t["started"],
            "wall_s": done.ended - t["started"],
            "slot_bytes": _tree_bytes(self.shm / name, "slot-"),
        }
        if replicate:
            skipped = {int(s) for s in re.findall(r"replica of step (\d+) skipped", done.stderr)}
            per_round = _peer_round_bytes(self.shm / name)
            rounds = self.args.steps - len(skipped)
            out.update(skipped_rounds=len(skipped), rounds=rounds, round_bytes=per_round)
            out["bytes_per_step"] = per_round * rounds / self.args.steps
        return out


def _agent_stamp(pattern: str, stderr: str, near: float) -> float:
    """The time of torchrun's first log line matching ``pattern`` (glog style: ``W1202 16:00:21.027000``)."""
    found = re.search(rf"^[EWI](\d{{4}}) (\d\d:\d\d:\d\d\.\d+) .*{pattern}", stderr, re.MULTILINE)
    if found is None:
        raise SystemExit(f"no {pattern!r} in torchrun's log:\n{stderr[-3000:]}")
    year = datetime.fromtimestamp(near).year
    return datetime.strptime(f"{year}{found.group(1)} {found.group(2)}", "%Y%m%d %H:%M:%S.%f").timestamp()


def _find(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    if found is None:
        raise SystemExit(f"not found: {pattern!r} in\n{text[-3000:]}")
    return found.group(1)


def timings(stdout: str, attempt: int) -> dict[str, float]:
    names = ("started", "imported", "ready", "restored")
    found = re.search(
        rf"attempt {attempt} timings: process started at ([\d.]+), imports done at ([\d.]+), process group and "
        r"model ready at ([\d.]+), restored at ([\d.]+)",
        stdout,
    )
    if found is None:
        raise SystemExit(f"no timings of attempt {attempt} in\n{stdout[-3000:]}")
    out = dict(zip(names, (float(g) for g in found.groups()), strict=True))
    out["first"] = float(_find(rf"first step of attempt {attempt} done at ([\d.]+)", stdout))
    return out


def restart_phases(done: Launch, killed: float, *, attempt: int, lost_at: int) -> dict[str, Any]:
    t = timings(done.stdout, attempt)
    reports = re.findall(r"restore report: (\{.*\})", done.stdout)
    report: dict[str, Any] = json.loads(reports[-1]) if reports else {}
    ranks = done.restore.get("ranks", [])
    return {
        "killed_at_step": lost_at,
        "resumed_step": int(_find(rf"resumed at step (\d+) .*attempt={attempt}", done.stdout)),
        "tier": report.get("tier"),
        "rank_tiers": [r["tier"] for r in ranks],
        "detect_and_restart": t["started"] - killed,
        "imports": t["imported"] - t["started"],
        "rendezvous_and_model": t["ready"] - t["imported"],
        "restore": t["restored"] - t["ready"],
        "restore_report_s": report.get("seconds"),
        "restore_phases": report.get("phases", {}),
        "bytes_read": sum(r["bytes_read"] for r in ranks) if ranks else report.get("bytes_read"),
        "bytes_between_nodes": report.get("bytes_between_nodes"),
        "first_step": t["first"] - t["restored"],
        "total": t["first"] - killed,
    }


def _files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _tree_bytes(root: Path, prefix: str) -> int:
    """One snapshot's bytes over every node: each node's newest complete directory named ``prefix*``."""
    total = 0
    for node in root.iterdir():
        dirs = [d for d in node.glob(f"*/{prefix}*") if (d / "manifest.json").exists()]
        if dirs:
            total += _files_bytes(max(dirs, key=lambda d: (d / "manifest.json").stat().st_mtime))
    return total


def _peer_round_bytes(root: Path) -> int:
    """The bytes of one replica round: per source rank, its newest complete copy on the other node."""
    newest: dict[str, Path] = {}
    for d in root.glob("*/*/peer-*"):
        if (d / "manifest.json").exists():
            source = d.name.rsplit("-", 1)[0]
            if (
                source not in newest
                or (d / "manifest.json").stat().st_mtime > (newest[source] / "manifest.json").stat().st_mtime
            ):
                newest[source] = d
    return sum(_files_bytes(d) for d in newest.values())


# ---------------------------------------------------------------- output


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field by field over repeats: numbers their median, mappings the same recursively, the rest the first's."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)  # type: ignore[type-var]
        elif all(isinstance(v, dict) for v in values):
            out[key] = _median(values)  # type: ignore[arg-type]
        else:
            out[key] = first
    return out


def _ratio(durable: float, memory: float) -> str:
    return f"{durable / memory:.2f}x" if memory > 0 else "-"


def _kib(n: float | None) -> str:
    return f"{(n or 0) / 1024:.1f} KiB"


def print_tables(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n| killed after step {args.kill_at} (median of {args.repeat}) | from | resumed at | launcher knows, "
        "workers gone | detect + restart | imports | rendezvous + model | restore (report: agree / gather / read "
        "/ apply) | between nodes | first step | kill → first step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = (("crash", "worker crash, 4 → 4 ranks"), ("node_loss", "node B lost, 4 → 2 ranks"))
    cols = ("stopped", "detect_and_restart", "imports", "rendezvous_and_model", "restore")
    for key, label in rows:
        for tier in ("memory", "durable"):
            f = results[key][tier]
            ph = f["restore_phases"] or {}
            split = " / ".join(f"{ph.get(p, 0) * 1e3:.0f}" for p in ("agree", "gather", "read", "apply"))
            cells = [f"{f[c]:.2f} s" for c in cols]
            cells[-1] += f" ({(f['restore_report_s'] or 0) * 1e3:.0f} ms: {split} ms)"
            cells += [_kib(f["bytes_between_nodes"]), f"{f['first_step']:.2f} s", f"{f['total']:.2f} s"]
            source = "memory + replicas" if tier == "memory" else "run directory"
            tiers = ",".join(f["rank_tiers"]) or f["tier"]
            lost = f["killed_at_step"] - f["resumed_step"]
            print(f"| {label} | {source} ({tiers}) | step {f['resumed_step']} ({lost} lost) | {' | '.join(cells)} |")
    for key, label in rows:
        m, d = results[key]["memory"], results[key]["durable"]
        ratios = ", ".join(
            f"{name} {_ratio(d[c], m[c])}"
            for name, c in (
                ("restore", "restore"),
                ("restore report", "restore_report_s"),
                ("kill → first step", "total"),
            )
        )
        print(f"{label}: run directory ÷ memory (above 1: memory faster): {ratios}")
    mem, rep = results["training"]["memory"], results["training"]["replicate"]
    print(
        f"\n| {args.steps} steps on A,A,B,B, snapshot every step | mean step | median step | start → ready "
        "| replica rounds skipped | copied to the other node per round | per step |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| memory tier | {mem['step_mean_s'] * 1e3:.1f} ms | {mem['step_median_s'] * 1e3:.1f} ms "
        f"| {mem['start_to_ready_s']:.2f} s | - | - | - |"
    )
    print(
        f"| memory tier + replicas | {rep['step_mean_s'] * 1e3:.1f} ms | {rep['step_median_s'] * 1e3:.1f} ms "
        f"| {rep['start_to_ready_s']:.2f} s | {rep['skipped_rounds']} of {args.steps} | {_kib(rep['round_bytes'])} "
        f"| {_kib(rep['bytes_per_step'])} |"
    )
    print(
        f"replicas ÷ no replicas: mean step {_ratio(rep['step_mean_s'], mem['step_mean_s'])}, median step "
        f"{_ratio(rep['step_median_s'], mem['step_median_s'])}; one snapshot in the slots: {_kib(mem['slot_bytes'])}"
        " over all ranks (a round copies each rank's files and the manifest, once per source rank)"
    )
    g = results["node_loss"]["memory"]["grow"]
    phases = " / ".join(f"{k} {(g['phases'] or {}).get(k, 0) * 1e3:.0f}" for k in ("agree", "gather", "read", "apply"))
    print(
        f"\nGrowing back 2 → 4 ranks with node B's memory empty (step {g['step']}, tiers {','.join(g['tiers'])}): "
        f"{_kib(g['bytes_between_nodes'])} moved between nodes, {_kib(g['bytes_read'])} of tensors read by all "
        f"ranks, restore {g['seconds'] * 1e3:.0f} ms ({phases} ms)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kill-at", type=int, default=6, help="the step after which a rank or a node dies")
    p.add_argument("--steps", type=int, default=30, help="steps of each replication-cost run")
    p.add_argument("--repeat", type=int, default=1, help="runs of each recovery (medians; about 70 s each)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a torchrun is killed")
    p.add_argument("--dir", help="where to write, logs kept (default: a temporary directory, removed afterwards)")
    p.add_argument("--json", type=Path, help="write every figure as JSON")
    args = p.parse_args()
    print(HEADER, flush=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptfmt-node-loss-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shm = Path(tempfile.mkdtemp(prefix="ckptfmt-node-loss-", dir="/dev/shm" if Path("/dev/shm").is_dir() else work))
    bench = Bench(work, shm, args)
    results: dict[str, Any] = {"kill_at": args.kill_at, "steps": args.steps, "repeat": args.repeat}
    started = time.time()
    try:
        for key, fn in (("crash", bench.crash), ("node_loss", bench.node_loss)):
            runs: dict[str, list[dict[str, Any]]] = {"memory": [], "durable": []}
            for i in range(args.repeat):
                for memory in (True, False) if i % 2 == 0 else (False, True):  # alternate: no tier always first
                    print(f"{key} from {'memory' if memory else 'the run directory'}", file=sys.stderr, flush=True)
                    runs["memory" if memory else "durable"].append(fn(memory, i))
            results[key] = {tier: _median(r) for tier, r in runs.items()} | {"runs": runs}
        print("replication's cost", file=sys.stderr, flush=True)
        results["training"] = {"memory": bench.training(False), "replicate": bench.training(True)}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.time() - started
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print_tables(results, args)
    print(f"\n(bench wall time {results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
