"""Lose a node under torchrun elastic, keep every replicated step, and grow back (ckptfmt's memory tier with replicas).

    python examples/node_loss.py --workdir runs/node-loss [--seed N] [--json OUT]

Two torchrun agents on loopback play two nodes, A and B, of two FSDP2 ranks each (gloo on CPU): each agent has
its own ``CKPTFMT_NODE_KEY`` and memory directory, and they meet at a rendezvous store this script runs on its
own (``--rdzv-conf is_host=false``), so that the store does not die with a node. Every step's state is a memory
snapshot, replicated to the other node.

1. At a step drawn at random, node B is lost: its workers, its agent, and its memory directory.
2. Node A's workers fail on their next collective; torchrun restarts them (``--nnodes=1:2``), alone now: they
   restore the last step B had replicated (0 replicated steps lost) from A's own slot and A's copies of B's
   files, reshard 4 -> 2 ranks, and train to the end of the first leg, continuing the same global sample order.
3. The job is relaunched on both nodes (B with empty memory): four ranks restore from memory, B's ranks getting
   their files from A's memory over gloo, and train to the end.

The script checks that no sample was repeated or skipped and prints what each restore read, from where, and
what it cost. (The job grows back by a relaunch: a torchrun agent that joins a running job starts its workers
at restart count 0 while the others are at 1, and this example's worker rendezvous keys on that count.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS, LEG = 12, 8  # the first leg ends at step LEG, the relaunch on both nodes trains to STEPS
JOB = "ckptfmt-node-loss-example"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_store(port: int) -> subprocess.Popen[str]:
    """The rendezvous store, in a process of its own (not inside any node's agent)."""
    code = (
        "import sys, time, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False)\n"
        "print('ready', flush=True)\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def agent(work: Path, node: str, port: int, *args: str, restarts: int = 3) -> subprocess.Popen[str]:
    """One node: a torchrun agent (in a session of its own, so that the node can be killed whole)."""
    cmd = [str(TORCHRUN), "--nnodes=1:2", "--nproc-per-node=2", f"--max-restarts={restarts}"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={JOB}"]
    # a node that stops its heartbeat is dropped from the rendezvous after ~2 s (torch's default: 15 s)
    conf = "is_host=false,last_call_timeout=1,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=2"
    cmd += [f"--rdzv-conf={conf}", "--monitor-interval=0.2"]
    cmd += [str(TRAIN), "--run-dir", str(work / "run"), "--steps", str(STEPS), "--every", "100"]
    cmd += ["--keep-last", "100", "--memory-every", "1", "--memory-dir", str(work / "shm" / node), "--replicate"]
    cmd += ["--replica-sync", "--samples-out", str(work / "samples"), "--peer-timeout", "20", *args]
    env = {**os.environ, "CKPTFMT_NODE_KEY": node, "OMP_NUM_THREADS": "1"}
    log = open(work / f"{node}-{len(list(work.glob(f'{node}-*.log')))}.log", "w")  # noqa: SIM115 - lives with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def wait_for(path_glob: str, work: Path, pattern: str, timeout: float = 240.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in sorted(work.glob(path_glob)):
            found = re.search(pattern, log.read_text())
            if found:
                return found
        time.sleep(0.1)
    raise TimeoutError(f"no {pattern!r} in {path_glob} after {timeout:g} s")


def kill_tree(root: int) -> set[int]:
    """SIGKILL a process and every descendant (torchrun starts each worker in a session of its own: neither its
    process group nor its session reaches them; a stopped worker ignores torchrun's SIGTERM). Returns them."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return tree


def kill_node(proc: subprocess.Popen[str]) -> None:
    """The node's agent and every process it started, killed; returns once none of them runs."""
    tree = kill_tree(proc.pid)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(pid) for pid in tree - {proc.pid}):
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def finish(proc: subprocess.Popen[str], what: str, timeout: float = 300.0) -> None:
    code = proc.wait(timeout=timeout)
    if code != 0:
        raise RuntimeError(f"{what} exited with {code}")


def reports(text: str) -> list[dict[str, Any]]:
    return [json.loads(m) for m in re.findall(r"restore report: (\{.*\})", text)]


def global_order(samples: int) -> list[int]:
    """The dataset indices in the order the run's loader hands them out as one global stream (one process)."""
    sys.path.insert(0, str(HERE))
    try:
        import train
    finally:
        sys.path.pop(0)
    loader = train.build(train.TrainConfig(steps=STEPS), indexed=True).loader
    order: list[int] = []
    while len(order) < samples:
        for batch in loader:
            order.extend(int(i) for i in batch[2])
    return order


def check_sample_order(work: Path, replicated: int) -> tuple[int, list[str]]:
    """Each step consumed the next samples of the global order, whichever ranks ran it: (samples, problems)."""
    per_rank = [json.loads((work / f"samples.rank{r}.json").read_text())["steps"] for r in range(4)]
    blocks = []
    for step in range(1, STEPS + 1):
        ranks = range(2) if replicated < step <= LEG else range(4)  # node A's two ranks went on alone
        blocks.append((step, [i for r in ranks for i in per_rank[r].get(str(step), [])]))
    reference = global_order(sum(len(b) for _, b in blocks))
    problems, seen = [], 0
    for step, block in blocks:
        if sorted(block) != sorted(reference[seen : seen + len(block)]):
            problems.append(f"step {step} did not take the next {len(block)} samples of the global order")
        seen += len(block)
    return seen, problems


def run(work: Path, seed: int | None) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lose_at = random.Random(seed).randint(3, 6)
    port = free_port()
    store = start_store(port)
    try:
        print(f"[node-loss] two nodes of 2 ranks; node B is lost after step {lose_at}", flush=True)
        leg = ["--stop-at-step", str(LEG), "--lose-node-at-step", str(lose_at), "--lost-node", "B"]
        a = agent(work, "A", port, *leg)
        b = agent(work, "B", port, *leg)
        found = wait_for("B-*.log", work, r"replica of step (\d+) is in; node lost at ([\d.]+)")
        replicated, lost_at = int(found.group(1)), float(found.group(2))
        kill_node(b)  # the node's agent and every worker it started
        shutil.rmtree(work / "shm" / "B")  # and its memory
        print(f"[node-loss] node B lost at step {replicated} (replicated); A's workers restart alone", flush=True)
        finish(a, "node A's agent")
        first_leg = (work / "A-0.log").read_text()
        survivors = [r for r in reports(first_leg) if r["step"]]
        timings = re.search(
            r"attempt 1 timings: process started at ([\d.]+), imports done at ([\d.]+), process group and model "
            r"ready at ([\d.]+), restored at ([\d.]+)",
            first_leg,
        )
        assert timings is not None, first_leg[-3000:]
        started, _, ready, restored = (float(t) for t in timings.groups())
        resumed = float(re.findall(r"first step of attempt 1 done at ([\d.]+)", first_leg)[0])
        print("[node-loss] the job is relaunched on both nodes; B's memory is empty", flush=True)
        store.kill()  # a finished job's rendezvous is closed: the relaunch (same run id) meets on a new store
        store.wait()
        port = free_port()
        store = start_store(port)
        a2, b2 = agent(work, "A", port), agent(work, "B", port)
        finish(a2, "node A's agent (grown back)")
        finish(b2, "node B's agent (grown back)")
        grown = reports((work / "A-1.log").read_text())
    finally:
        store.kill()
        store.wait()
    samples, problems = check_sample_order(work, replicated)
    result = {
        "lost_after_step": lose_at,
        "replicated_step": replicated,
        "survivors_restore": survivors[0] if survivors else None,
        "grown_restore": grown[0] if grown else None,
        "kill_to_first_resumed_step_s": round(resumed - lost_at, 3),
        # detect (the survivors' collective fails) + restart (torchrun's re-rendezvous, a new process), then the
        # worker's imports and process group, the restore, and the first step
        "phases_s": {
            "detect_and_restart": round(started - lost_at, 3),
            "imports_and_rendezvous": round(ready - started, 3),
            "restore": round(restored - ready, 3),
            "first_step": round(resumed - restored, 3),
        },
        "samples_trained": samples,
        "sample_order_problems": problems,
        "last_restore_record": json.loads((work / "run" / "last-restore.json").read_text()),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/node-loss")
    p.add_argument("--seed", type=int, help="draws the step at which node B is lost (default: random)")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON")
    args = p.parse_args(argv)
    result = run(Path(args.workdir).resolve(), args.seed)
    survivors, grown = result["survivors_restore"], result["grown_restore"]
    print(
        f"[node-loss] survivors restored step {survivors['step']} from {survivors['tier']} "
        f"(node B had replicated step {result['replicated_step']}): "
        f"{result['replicated_step'] - survivors['step']} replicated steps lost; "
        f"kill to first resumed step {result['kill_to_first_resumed_step_s']:.1f} s "
        f"({', '.join(f'{k} {v:.1f} s' for k, v in result['phases_s'].items())})"
    )
    print(
        f"[node-loss] grown back: step {grown['step']} restored, "
        f"{grown['bytes_between_nodes']} bytes moved between nodes; "
        f"{result['samples_trained']} samples trained in the global order, "
        f"{len(result['sample_order_problems'])} step(s) out of it"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = survivors["step"] == result["replicated_step"] and not result["sample_order_problems"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
