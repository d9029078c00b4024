"""Simulated power loss: a model of what is durable, kept beside a real run of the writer.

The writer runs for real, in this process, on local disk. Every os call it makes to change the disk
goes through a wrapper that, after the call, updates a model of the *durable* state:

- a file's contents are durable as of its last ``fsync`` (nothing before the first);
- a directory's entries are durable as of its last ``fsync`` (a rename, link, unlink, mkdir or
  rmdir not followed by an fsync of its directory is lost);
- the run directory's entries at the start are durable.

Inodes are told apart by (inode number, generation): a new generation starts whenever a file is
created or a directory made, so a reused inode number never inherits an older file's durable state.

After every traced call the durable state is recorded; :func:`materialize` writes one such state
into a fresh directory, which is then opened as if the machine had lost power at that moment.
``adversarial`` states go further (a crash may persist *some* unsynced changes): each directory
independently takes its durable or its current entries, each file its durable or current contents.
"""

from __future__ import annotations

import os
import random
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACED = ("open", "write", "fsync", "rename", "link", "unlink", "mkdir", "rmdir")
_REAL: dict[str, Callable[..., Any]] = {name: getattr(os, name) for name in TRACED}  # the model's own calls
Ident = tuple[int, int]  # (inode, generation)
Entries = dict[str, tuple[Ident, bool]]  # name -> (identity, is a directory)


@dataclass(frozen=True, slots=True)
class State:
    """One possible disk after a power loss: the run directory's identity, directory entries and file contents."""

    root: Ident
    dirs: dict[Ident, Entries]
    data: dict[Ident, bytes]


@dataclass(slots=True)
class Event:
    index: int  # number of traced calls made before this event
    what: str  # "committed", "deleting"
    step: int


@dataclass(slots=True)
class Recorder:
    """Traces os calls under ``root`` and records the durable state after each one."""

    root: Path
    adversarial_every: int = 0  # also record a current-state snapshot every Nth call (0: never)
    seed: int = 0
    gen: dict[int, int] = field(default_factory=dict)
    durable_dirs: dict[Ident, Entries] = field(default_factory=dict)
    durable_data: dict[Ident, bytes] = field(default_factory=dict)
    states: list[State] = field(default_factory=list)
    current: dict[int, State] = field(default_factory=dict)  # call index -> the volatile state then
    calls: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)
    root_id: Ident = (0, 0)

    def ident(self, st: os.stat_result) -> Ident:
        return (st.st_ino, self.gen.get(st.st_ino, 0))

    def new_generation(self, st: os.stat_result) -> None:
        self.gen[st.st_ino] = self.gen.get(st.st_ino, 0) + 1

    def entries_of_fd(self, fd: int) -> Entries:
        out: Entries = {}
        with os.scandir(fd) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                out[entry.name] = (self.ident(st), stat.S_ISDIR(st.st_mode))
        return out

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        state = self.scan()
        self.root_id = state.root
        self.durable_dirs = dict(state.dirs)
        self.durable_data = dict(state.data)
        self.states.append(self.snapshot())

    def scan(self) -> State:
        """The current (volatile) state of the tree below root, as the page cache holds it."""
        dirs: dict[Ident, Entries] = {}
        data: dict[Ident, bytes] = {}

        def walk(path: Path) -> Ident:
            fd = _REAL["open"](path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                ident = self.ident(os.fstat(fd))
                entries = self.entries_of_fd(fd)
            finally:
                os.close(fd)
            dirs[ident] = entries
            for name, (child, is_dir) in entries.items():
                if is_dir:
                    walk(path / name)
                else:
                    data[child] = (path / name).read_bytes()
            return ident

        root = walk(self.root)
        return State(root=root, dirs=dirs, data=data)

    def snapshot(self) -> State:
        return State(root=self.root_id, dirs=dict(self.durable_dirs), data=dict(self.durable_data))

    def note(self, what: str, step: int) -> None:
        with self.lock:
            self.events.append(Event(len(self.calls), what, step))

    # ------------------------------------------------------------ os wrappers

    def after(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        if name == "open":
            flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
            if flags & os.O_CREAT and flags & os.O_EXCL:
                self.new_generation(os.fstat(result))
        elif name == "mkdir":
            path, dir_fd = args[0], kwargs.get("dir_fd")
            self.new_generation(os.stat(path, dir_fd=dir_fd, follow_symlinks=False))
        elif name == "fsync":
            fd = args[0]
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                self.durable_dirs[self.ident(st)] = self.entries_of_fd(fd)
            else:
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    self.durable_data[self.ident(st)] = f.read()
        self.calls.append(name)
        self.states.append(self.snapshot())
        if self.adversarial_every and len(self.calls) % self.adversarial_every == 0:
            self.current[len(self.calls)] = self.scan()


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    originals = dict(_REAL)

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            with recorder.lock:
                result = real(*args, **kwargs)
                recorder.after(name, args, kwargs, result)
                return result

        return traced

    recorder.start()
    for name, real in originals.items():
        setattr(os, name, wrap(name, real))
    try:
        yield recorder
    finally:
        for name, real in originals.items():
            setattr(os, name, real)


def adversarial(durable: State, current: State, rng: random.Random, *, keep: frozenset[Ident] = frozenset()) -> State:
    """A crash that persisted some unsynced changes: per directory and per file, durable or current.

    Directories in ``keep`` always take their durable entries.
    """
    dirs = dict(durable.dirs)
    # A directory gone from the current tree was removed, and rmdir removes only an empty one: its last
    # current entries were none.
    now = {**{ident: {} for ident in durable.dirs if ident != durable.root}, **current.dirs}
    for ident, entries in now.items():
        if ident not in keep and rng.random() < 0.5:
            dirs[ident] = entries
    data = dict(durable.data)
    for ident, content in current.data.items():
        if rng.random() < 0.5:
            data[ident] = content
    return State(root=durable.root, dirs=dirs, data=data)


def materialize(state: State, dest: Path) -> None:
    """Write ``state`` as a directory tree at ``dest`` (which must not exist)."""

    def build(ident: Ident, path: Path) -> None:
        path.mkdir()
        for name, (child, is_dir) in state.dirs.get(ident, {}).items():
            if is_dir:
                build(child, path / name)
            else:
                (path / name).write_bytes(state.data.get(child, b""))

    build(state.root, dest)


# ---------------------------------------------------------------- the harness


@dataclass(slots=True)
class PowerLossFigures:
    name: str = "power loss"
    cuts: int = 0  # moments the power was cut (states opened)
    adversarial: int = 0  # of which, states with some unsynced changes persisted
    checkpoints_judged: int = 0
    committed_intact: int = 0  # judged checkpoints whose commit had returned: all must be whole
    refused: int = 0
    whole: int = 0
    wrong: list[str] = field(default_factory=list)  # opened, but not what was written
    lost: list[str] = field(default_factory=list)  # a commit had returned, the checkpoint is gone or stale
    # opened but not whole, while retention was deleting it (the manifest's unlink not yet durable)
    wrong_while_deleting: list[str] = field(default_factory=list)


def run_workload(recorder: Recorder, steps: tuple[int, ...] = (1, 2, 3), keep_last: int = 2) -> None:
    """Saves into the run directory as CheckpointManager does: commit, set_latest, retention gc."""
    from ckptfmt.run import RunDirectory, checkpoint_name

    from . import payload

    run = RunDirectory(str(recorder.root))
    for step in steps:
        name = checkpoint_name(step)
        ckpt_id = payload.write(run.child_url(name), step, overwrite=True)
        recorder.note("committed", step)
        run.set_latest(name, step, ckpt_id)
        for older in steps:
            if older <= step - keep_last:
                recorder.note("deleting", older)  # retention may start deleting it now
        run.gc(keep_last=keep_last, protect={name})


def judge_state(state: State, cut: int, events: list[Event], dest: Path, label: str, figures: PowerLossFigures) -> None:
    from ckptfmt.run import checkpoint_name

    from . import consistency, payload

    materialize(state, dest)
    committed = {e.step for e in events if e.what == "committed" and e.index <= cut}
    deleting = {e.step for e in events if e.what == "deleting" and e.index <= cut}
    steps = sorted({e.step for e in events})
    for step in steps:
        verdict = payload.judge(str(dest / checkpoint_name(step)), step)
        figures.checkpoints_judged += 1
        must_be_whole = step in committed and step not in deleting
        if verdict.outcome == "wrong":
            where = figures.wrong_while_deleting if step in deleting else figures.wrong
            where.append(f"{label}: step {step} loadable but wrong: {verdict.detail}")
        elif must_be_whole and verdict.outcome != "whole":
            figures.lost.append(f"{label}: step {step} was committed, now {verdict.outcome} ({verdict.detail})")
        else:
            figures.committed_intact += must_be_whole
            figures.refused += verdict.outcome == "refused"
            figures.whole += verdict.outcome == "whole"
    chosen, _bad = consistency.newest_good(str(dest), None)
    live = committed - deleting
    if live and (chosen is None or chosen < max(live)):
        figures.lost.append(f"{label}: step {max(live)} was committed, resume finds {chosen}")


def power_loss(
    workdir: Path, *, cuts: int | None = None, adversarial_every: int = 0, variants: int = 2, seed: int = 0
) -> PowerLossFigures:
    """Run the workload once under the recorder, then cut the power after ``cuts`` sampled calls (all if None).

    With ``adversarial_every`` N, after every Nth call also ``variants`` states that persisted a random
    part of what was not yet synced.
    """
    figures = PowerLossFigures()
    recorder = Recorder(workdir / "run", adversarial_every=adversarial_every)
    with recording(recorder):
        run_workload(recorder)
    rng = random.Random(seed)
    total = len(recorder.states)
    chosen = range(total) if cuts is None or cuts >= total else sorted(rng.sample(range(total), cuts))
    n = 0
    for cut in chosen:
        n += 1
        figures.cuts += 1
        call = recorder.calls[cut - 1] if cut else "start"
        judge_state(
            recorder.states[cut], cut, recorder.events, workdir / f"cut{n}", f"cut after call {cut} ({call})", figures
        )
    for cut, current in sorted(recorder.current.items()):
        for v in range(variants):
            n += 1
            figures.cuts += 1
            figures.adversarial += 1
            state = adversarial(recorder.states[cut], current, rng)
            label = f"cut after call {cut} ({recorder.calls[cut - 1]}), unsynced changes partly kept (variant {v})"
            judge_state(state, cut, recorder.events, workdir / f"cut{n}", label, figures)
    return figures
