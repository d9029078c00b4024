"""Crash consistency of the multi-rank commit: ranks as processes, one of them SIGKILLed.

Each trial forks ``world`` ranks (2 or 3) that write one training checkpoint together into a fresh
run directory, exchanging their records over :class:`~mesh.SocketCollective` (spec/commit.md
"Several ranks"). Every rank writes its own rows of ``weights/emb`` and columns of
``optimizer/emb.exp_avg``; rank 0 writes the replicated ``optimizer/step``, the last rank the
replicated ``weights/head``; the seven context fields are spread over the ranks. One rank, the
victim, is SIGKILLed just before its Nth traced os call, or after a random delay.

After every trial:

- every survivor finishes within a bound (no hang), with the checkpoint id or a library error;
- ``ckptfmt.open`` refuses, or opens a checkpoint that verifies and holds exactly what was written
  (*committed-but-fails-verify* and *loadable-but-wrong* are violations);
- a rank whose save returned an id saw a whole checkpoint of that id, and without a kill every rank did;
- a coordinator whose save failed left neither its lock nor its own files (COM-20);
- when nothing was committed, ``RunDirectory.gc`` removes every remain.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import ckptfmt
from ckptfmt.errors import CheckpointError
from ckptfmt.lock import read_lock
from ckptfmt.paths import LOCK_NAME
from ckptfmt.run import RunDirectory, checkpoint_name
from ckptfmt.storage import open_store

from . import killing, mesh, payload

TARGET_FILE_SIZE = 512  # each rank writes a few data files per field
SEED = 11
COLLECTIVE_TIMEOUT_S = 10.0  # a peer alive but silent; a dead one fails the call at once (end of stream)
BOUND_S = 30.0  # every survivor must have exited by then
ROWS = 48
COLS = 8
_REAL_WRITE = os.write  # reports are not part of the work: never a traced call


def cuts(n: int, world: int) -> list[int]:
    """Uneven cut points of ``n`` over ``world`` ranks (rank ``r`` owns ``[c[r], c[r+1])``)."""
    return [0] + [(n * r) // world + (r % 2) for r in range(1, world)] + [n]


def tensors(seed: int = SEED) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(seed)
    return {
        "weights": {
            "emb": rng.standard_normal((ROWS, COLS)).astype(np.float32),  # sharded by rows
            "head": rng.standard_normal((8, 20)).astype(np.float64),  # replicated, written by the last rank
        },
        "optimizer": {
            "emb.exp_avg": rng.standard_normal((ROWS, COLS)).astype(np.float32),  # sharded by columns
            "step": np.array(seed + 7, dtype=np.int64),  # replicated, written by rank 0
        },
    }


def contexts(world: int, seed: int = SEED) -> dict[str, dict[str, object]]:
    ctx = payload.contexts(seed)
    ctx["topology"] = {"world_size": world, "ranks_saving": world}
    return ctx


def context_owner(name: str, world: int) -> int:
    return {"provenance": 0, "topology": 0, "rng": 1, "data": 1}.get(name, world - 1)  # config, optimizer: last


def write_rank(url: str, world: int, rank: int, collective: ckptfmt.Collective, seed: int = SEED) -> str:
    """Rank ``rank``'s part of the save (every rank calls this with its own collective); returns the id."""
    arrays = tensors(seed)
    rows, cols = cuts(ROWS, world), cuts(COLS, world)
    with ckptfmt.open_writer(url, profile="training", collective=collective, target_file_size=TARGET_FILE_SIZE) as w:
        lo, hi = rows[rank], rows[rank + 1]
        w.write_tensor("weights", "emb", arrays["weights"]["emb"][lo:hi], global_shape=(ROWS, COLS), offsets=(lo, 0))
        lo, hi = cols[rank], cols[rank + 1]
        exp_avg = arrays["optimizer"]["emb.exp_avg"][:, lo:hi]
        w.write_tensor("optimizer", "emb.exp_avg", exp_avg, global_shape=(ROWS, COLS), offsets=(0, lo))
        if rank == world - 1:
            w.write_tensor("weights", "head", arrays["weights"]["head"])
        if rank == 0:
            w.write_tensor("optimizer", "step", arrays["optimizer"]["step"])
        for name, value in contexts(world, seed).items():
            if context_owner(name, world) == rank:
                w.write_context(name, value)
        if context_owner("config", world) == rank:
            w.write_config(payload.config(seed))
    assert w.checkpoint_id is not None
    return w.checkpoint_id


# ------------------------------------------------------------------ the oracle


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: str  # refused | whole | wrong (loadable but wrong) | unverified (committed, fails verify)
    detail: str
    checkpoint_id: str | None = None


def holds(ckpt: ckptfmt.Checkpoint, world: int) -> str | None:
    """None when ``ckpt`` holds exactly what the ranks wrote; else what differs."""
    expected = tensors()
    if set(ckpt.fields) != {"weights", "optimizer", "rng", "data", "config", "topology", "provenance"}:
        return f"fields {sorted(ckpt.fields)}"
    for name, arrays in expected.items():
        if set(ckpt.tensor_names(name)) != set(arrays):
            return f"tensors of {name}: {sorted(ckpt.tensor_names(name))}"
        for tensor, array in arrays.items():
            got = ckpt.read_tensor(name, tensor)
            if not (got.shape == array.shape and got.dtype == array.dtype and got.tobytes() == array.tobytes()):
                return f"tensor {name}/{tensor} differs"
    for name, value in contexts(world).items():
        if not payload._same_value(ckpt.read_context(name), value):
            return f"context {name} differs"
    if not payload._same_value(ckpt.read_context("config").get("config"), payload.config(SEED)):
        return "config differs"
    return None


def judge(url: str, world: int) -> Verdict:
    """What a reader sees at ``url``; only a library error may escape ``open`` (anything else is wrong)."""
    try:
        ckpt = ckptfmt.open(url)
    except CheckpointError as exc:
        return Verdict("refused", exc.code)
    except Exception as exc:
        return Verdict("wrong", f"open raised {type(exc).__name__}: {exc}")
    try:
        with ckpt:
            report = ckpt.verify()
            if not report.ok:
                return Verdict("unverified", f"verify: {report.problems[0]}", ckpt.id)
            problem = holds(ckpt, world)
    except Exception as exc:
        return Verdict("wrong", f"opened, then {type(exc).__name__}: {exc}", ckpt.id)
    return Verdict("wrong", problem, ckpt.id) if problem else Verdict("whole", "", ckpt.id)


# ------------------------------------------------------------------ one trial


@dataclass(slots=True)
class Trial:
    """What happened to the ranks of one trial (the parent's view)."""

    reports: dict[int, dict[str, Any]]  # rank -> its report (absent: it died first)
    killed: set[int]  # ranks that died of SIGKILL
    hung: set[int]  # ranks still running at the bound (then killed by the parent)
    after_kill_s: float  # from the victim's death to the last survivor's exit (0 when nothing was killed)
    work_s: float  # from the last fork to the last rank's report
    seconds: float


def _after_failure(url: str, rank: int) -> list[str]:
    """A coordinator whose save failed must have removed its lock and its own files (COM-20, COM-14)."""
    if rank != 0:
        return []
    problems = []
    store = open_store(url)
    lock = read_lock(store)
    if lock is not None and lock.pid == os.getpid() and not lock.holder_is_dead():
        problems.append(f"the failed coordinator still holds {LOCK_NAME}: its retries are locked out")
    own = sorted(p for p in store.list() if "r00000-" in p or p.endswith("/context.msgpack"))
    if own:
        problems.append(f"the failed coordinator left its own files: {own[:4]}")
    return problems


def _rank_work(
    url: str, world: int, rank: int, ends: list[dict[int, Any]], report_fd: int, kill_at: int | None
) -> Callable[[], None]:
    def work() -> None:
        collective = mesh.SocketCollective(rank, world, mesh.keep_only(ends, rank), timeout=COLLECTIVE_TIMEOUT_S)
        counter = killing.Counter(kill_at)
        report: dict[str, Any] = {"rank": rank}
        try:
            with killing.traced_os(counter):
                report["id"] = write_rank(url, world, rank, collective)
        except CheckpointError as exc:
            report["error"] = exc.code
            report["message"] = str(exc)[:300]
            report["problems"] = _after_failure(url, rank)
        except BaseException as exc:  # only library errors may escape the API
            report["crashed"] = f"{type(exc).__name__}: {exc}"[:300]
        report["calls"] = counter.names
        report["done"] = time.monotonic()  # system-wide clock: comparable with the parent's
        data = (json.dumps(report) + "\n").encode()
        while data:
            data = data[_REAL_WRITE(report_fd, data) :]

    return work


def run_trial(
    url: str, world: int, *, victim: int | None, kill_at: int | None = None, delay_s: float | None = None
) -> Trial:
    """Fork ``world`` ranks writing one checkpoint at ``url``; SIGKILL ``victim`` before its ``kill_at``-th
    traced os call, or ``delay_s`` seconds after the fork, or never (``victim`` None)."""
    start = time.monotonic()
    ends = mesh.mesh(world)
    pipes = [os.pipe() for _ in range(world)]
    pids: list[int] = []
    for rank in range(world):

        def setup(rank: int = rank) -> None:
            for r, (read_fd, write_fd) in enumerate(pipes):
                os.close(read_fd)
                if r != rank:
                    os.close(write_fd)

        work = _rank_work(url, world, rank, ends, pipes[rank][1], kill_at if rank == victim else None)
        pids.append(killing.fork(work, setup=setup))
    mesh.keep_only(ends, None)
    for _, write_fd in pipes:
        os.close(write_fd)
    forked = time.monotonic()
    if delay_s is not None and victim is not None:
        time.sleep(delay_s)
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed, hung, ended = _reap_all(pids, start + BOUND_S)
    reports: dict[int, dict[str, Any]] = {}
    for rank, (read_fd, _) in enumerate(pipes):
        with os.fdopen(read_fd, "rb") as src:
            text = src.read().decode()
        if text.strip():
            reports[rank] = json.loads(text)
    died = [ended[r] for r in killed]
    after = max(ended.values()) - min(died) if died else 0.0
    work_s = max((float(r["done"]) for r in reports.values()), default=forked) - forked
    return Trial(reports, killed, hung, after, work_s, time.monotonic() - start)


def _reap_all(pids: Sequence[int], deadline: float) -> tuple[set[int], set[int], dict[int, float]]:
    """Wait for every rank until ``deadline``; SIGKILL any still running then (a hang)."""
    pending = dict(enumerate(pids))
    killed: set[int] = set()
    hung: set[int] = set()
    ended: dict[int, float] = {}
    while pending:
        for rank, pid in list(pending.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            ended[rank] = time.monotonic()
            del pending[rank]
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                killed.add(rank)
            elif not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                raise AssertionError(f"rank {rank} failed with status {status} (its traceback is on stderr)")
        if pending and time.monotonic() > deadline:
            for rank, pid in pending.items():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung.add(rank)
                ended[rank] = time.monotonic()
            break
        time.sleep(0.0005)
    return killed, hung, ended


# ------------------------------------------------------------------ judging and figures


@dataclass(slots=True)
class MultiFigures:
    """Counts of one harness run; ``wrong`` lists every violation (empty when everything held)."""

    name: str
    trials: int = 0
    killed: int = 0
    refused: int = 0
    whole: int = 0
    loadable_but_wrong: int = 0
    fails_verify: int = 0
    gc_clean: int = 0  # refused trials whose remains gc removed entirely
    slowest_survivor_s: float = 0.0  # longest from a kill to the last survivor's exit
    wrong: list[str] = field(default_factory=list)

    def add(self, other: MultiFigures) -> None:
        for name in ("trials", "killed", "refused", "whole", "loadable_but_wrong", "fails_verify", "gc_clean"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.slowest_survivor_s = max(self.slowest_survivor_s, other.slowest_survivor_s)
        self.wrong += other.wrong


def leftovers(run_url: str) -> list[str]:
    """What ``RunDirectory.gc`` leaves of a run directory holding no committed checkpoint (should be nothing)."""
    run = RunDirectory(run_url)
    run.gc(keep_last=None)
    return [p for p in run.store.list() if p != "latest.json"]


def judge_trial(run_url: str, world: int, trial: Trial, label: str, figures: MultiFigures) -> Verdict:
    url = f"{run_url}/{checkpoint_name(1)}"
    figures.trials += 1
    figures.killed += bool(trial.killed)
    figures.slowest_survivor_s = max(figures.slowest_survivor_s, trial.after_kill_s)
    wrong = figures.wrong
    for rank in sorted(trial.hung):
        wrong.append(f"{label}: rank {rank} hung ({BOUND_S:g} s)")
    survivors = [r for r in range(world) if r not in trial.killed and r not in trial.hung]
    ids = set()
    for rank in survivors:
        report = trial.reports.get(rank)
        if report is None:
            wrong.append(f"{label}: rank {rank} exited without a report")
            continue
        if "crashed" in report:
            wrong.append(f"{label}: rank {rank} raised a non-library error: {report['crashed']}")
        wrong += [f"{label}: rank {rank}: {p}" for p in report.get("problems", [])]
        if "id" in report:
            ids.add(report["id"])
    if len(ids) > 1:
        wrong.append(f"{label}: the ranks returned different ids: {sorted(ids)}")
    elif not trial.killed and not trial.hung and not all("id" in trial.reports.get(r, {}) for r in range(world)):
        detail = {r: trial.reports.get(r, {}).get("message", "no report") for r in range(world)}
        wrong.append(f"{label}: nothing was killed, yet not every rank committed: {detail}")
    verdict = judge(url, world)
    if verdict.outcome == "wrong":
        figures.loadable_but_wrong += 1
        wrong.append(f"{label}: loadable but wrong: {verdict.detail}")
    elif verdict.outcome == "unverified":
        figures.fails_verify += 1
        wrong.append(f"{label}: committed but fails verify: {verdict.detail}")
    elif verdict.outcome == "whole":
        figures.whole += 1
        if ids and ids != {verdict.checkpoint_id}:
            wrong.append(f"{label}: ranks returned {ids}, the checkpoint is {verdict.checkpoint_id}")
    else:
        figures.refused += 1
        if ids:
            wrong.append(f"{label}: a rank's save returned {ids}, but the checkpoint is refused ({verdict.detail})")
        left = leftovers(run_url)
        if left:
            wrong.append(f"{label}: gc left {left}")
        else:
            figures.gc_clean += 1
    return verdict


def count_calls(run_url: str, world: int) -> list[list[str]]:
    """Each rank's traced os calls in an uninterrupted save, in order."""
    trial = run_trial(run_url, world, victim=None)
    assert not trial.killed and not trial.hung and len(trial.reports) == world, trial
    assert all("id" in r for r in trial.reports.values()), trial.reports
    return [list(trial.reports[r]["calls"]) for r in range(world)]


def kill_points(url: Callable[[int], str], world: int, *, per_rank: int | None = None, tail: int = 0) -> MultiFigures:
    """SIGKILL each rank in turn just before each of its traced os calls, and once past its last (nothing
    killed: the control). ``per_rank``: only that many points per rank, spread evenly, plus its last
    ``tail`` calls (where the records are exchanged and the manifest written). ``url(i)``: a fresh run directory.
    """
    figures = MultiFigures(f"{world} ranks, kill points")
    calls = count_calls(url(-1), world)
    i = 0
    for victim in range(world):
        total = len(calls[victim])
        chosen = set(range(1, total + 2)) if per_rank is None else set(spread(total, per_rank))
        chosen |= set(range(max(1, total + 1 - tail), total + 2))
        for n in sorted(chosen):
            name = calls[victim][n - 1] if n <= total else "none: control"
            label = f"{world} ranks, rank {victim} killed before call {n}/{total} ({name})"
            run_url = url(i)
            i += 1
            trial = run_trial(f"{run_url}/{checkpoint_name(1)}", world, victim=victim, kill_at=n)
            judge_trial(run_url, world, trial, label, figures)
    return figures


def random_kills(url: Callable[[int], str], world: int, trials: int, *, seed: int = 0) -> MultiFigures:
    """SIGKILL rank ``i % world`` of trial ``i`` after a delay uniform over 1.2x an uninterrupted save."""
    figures = MultiFigures(f"{world} ranks, random moments")
    rng = random.Random(seed)
    durations = sorted(run_trial(f"{url(-2 - k)}/{checkpoint_name(1)}", world, victim=None).work_s for k in range(3))
    horizon = 1.2 * durations[1]
    for i in range(trials):
        delay = rng.uniform(0, horizon)
        victim = i % world
        label = f"{world} ranks, rank {victim} killed after {delay * 1000:.2f} ms (trial {i})"
        run_url = url(i)
        trial = run_trial(f"{run_url}/{checkpoint_name(1)}", world, victim=victim, delay_s=delay)
        judge_trial(run_url, world, trial, label, figures)
    return figures


def spread(total: int, count: int) -> list[int]:
    """``count`` kill points spread evenly over calls 1..total+1 (the last: nothing killed)."""
    if count >= total + 1:
        return list(range(1, total + 2))
    return sorted({1 + round(i * total / (count - 1)) for i in range(count)})
