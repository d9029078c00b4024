"""A torchft job on loopback for tests and benchmarks: a lighthouse in this process, replica groups as processes.

Each group runs ``examples/torchft_train.py`` (or ``tests/torchft_worker.py``, the same loop with fault hooks) with
its own run directory, memory directory and JSON-lines log. :meth:`Cluster.close` kills every group still running
and shuts the lighthouse down: a test leaves no process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_train.py"
WORKER = Path(__file__).resolve().parent / "torchft_worker.py"
# torchft's lighthouse: a dead group is dropped after 500 ms without a heartbeat; a quorum waits 100 ms for
# stragglers and is recomputed every 20 ms (its defaults: 5 s, 60 s and 100 ms)
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 100, "quorum_tick_ms": 20, "heartbeat_timeout_ms": 500}


class Cluster:
    def __init__(self, root: Path, *, steps: int, step_sleep: float, samples: int = 4096, width: int = 64) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
        from torchft.coordination import LighthouseServer

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.steps = steps
        self.step_sleep = step_sleep
        self.samples = samples
        self.width = width
        self.lighthouse = LighthouseServer(bind="[::]:0", **LIGHTHOUSE)
        self.address = self.lighthouse.address()
        self.processes: list[subprocess.Popen[bytes]] = []

    def log(self, group: int) -> Path:
        return self.root / f"group{group}.jsonl"

    def memory(self, group: int, generation: int = 0) -> Path:
        return self.root / f"memory{group}-{generation}"

    def start(
        self, group: int, *extra: str, generation: int = 0, script: Path = EXAMPLE, steps: int | None = None
    ) -> subprocess.Popen[bytes]:
        """Start replica group ``group``; ``generation`` > 0: a replacement on a new node (a new memory directory)."""
        command = [
            sys.executable,
            str(script),
            "--lighthouse",
            self.address,
            "--replica-id",
            str(group),
            "--run-dir",
            str(self.root / "run"),
            "--memory-dir",
            str(self.memory(group, generation)),
            "--steps",
            str(steps or self.steps),
            "--step-sleep",
            str(self.step_sleep),
            "--samples",
            str(self.samples),
            "--width",
            str(self.width),
            "--log",
            str(self.log(group)),
            "--stop-file",
            str(self.root / "stop"),
            *extra,
        ]
        env = {**os.environ, "RUST_LOG": "warn", "PYTHONPATH": str(ROOT / "examples")}
        with open(self.root / f"group{group}-{generation}.out", "ab") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        """Every group ends its loop cleanly after its next step (``--stop-file``)."""
        (self.root / "stop").touch()

    def until(self, condition: Any, what: str, *, polls: int = 1200, every: float = 0.1) -> None:
        """Poll until ``condition()`` holds; a bounded number of polls (a hang guard)."""
        for _ in range(polls):
            if condition():
                return
            time.sleep(every)
        raise AssertionError(f"never: {what}\n{self.output(0)}\n{self.output(1)}")

    def records(self, group: int) -> list[dict[str, Any]]:
        path = self.log(group)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, group: int, predicate: Any, *, polls: int = 1200, every: float = 0.1) -> dict[str, Any]:
        """The first record of ``group`` that satisfies ``predicate``; a bounded number of polls (a hang guard)."""
        for _ in range(polls):
            for record in self.records(group):
                if predicate(record):
                    return record
            time.sleep(every)
        raise AssertionError(f"group {group} never logged the record waited for; its output:\n{self.output(group)}")

    def output(self, group: int) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.root.glob(f"group{group}-*.out")))

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.lighthouse.shutdown()


@contextmanager
def cluster(root: Path, **kwargs: Any) -> Iterator[Cluster]:
    job = Cluster(root, **kwargs)
    try:
        yield job
    finally:
        job.close()


def steps_by_number(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in records if r["event"] == "step"}
