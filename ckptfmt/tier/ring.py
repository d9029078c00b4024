"""The slots of one run on one node: ``<memory dir>/run-<key>/slot-<k>/``, each a whole ckptfmt checkpoint.

A small ring of slots (two by default) is rewritten in turn, the oldest first, so a snapshot torn by a
crash never costs the one before it (spec/memory.md). :class:`RingPolicy` decides which slot the next
snapshot rewrites (MEM-2), purely from what the ring holds; :class:`MemoryTier` finds the slots on disk.
Listing a slot reads its manifest only; the bytes are checked when a restore reads them (every chunk's
digest) or a persist copies them (every file's digest).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from ..errors import CheckpointError, CheckpointNotFoundError, MemoryCapacityError, UnsafePathError, UsageError
from ..manifest import checkpoint_id
from ..manifest_io import read_manifest_bytes
from ..manifest_parse import parse_manifest
from ..paths import LOCK_NAME, MANIFEST_NAME
from ..storage.slot import SlotStore
from .binding import SlotBinding, normalize_run_url, run_dir_key

log = logging.getLogger("ckptfmt")

SHM_DIR = "/dev/shm"
MEMORY_DIR_ENV = "CKPTFMT_MEMORY_DIR"
SLOT_PREFIX = "slot-"
PEER_PREFIX = "peer-"  # ``peer-<source rank>-<k>``: a replica another node sent here (replica.py)
MAX_SLOTS = 16
# What a slot holds besides its tensors (manifest, context blobs, safetensors headers): a margin per slot
SLOT_OVERHEAD = 4 << 20
SlotStatus = Literal["committed", "torn", "empty", "invalid"]


def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _per_user(base: str) -> str:
    uid = _euid()
    return os.path.join(base, "ckptfmt" if uid is None else f"ckptfmt-{uid}")


# This user's, made 0700: in a directory every user may write (/dev/shm), a shared name could be another user's
# first, who could then rename this user's slots away or plant the run's directory to refuse its start.
DEFAULT_MEMORY_DIR = _per_user(SHM_DIR)


def default_memory_dir() -> str:
    """``$CKPTFMT_MEMORY_DIR``, else ``/dev/shm/ckptfmt-<uid>`` (the effective uid of this process)."""
    return os.environ.get(MEMORY_DIR_ENV) or _per_user(SHM_DIR)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """One slot as found: its status, and for a committed one its binding, checkpoint id and size."""

    index: int
    path: str
    status: SlotStatus
    size: int = 0
    binding: SlotBinding | None = None
    checkpoint_id: str | None = None
    reason: str | None = None  # why a slot that is not committed (or has no binding) cannot be used

    @property
    def step(self) -> int | None:
        return self.binding.step if self.binding is not None else None

    def to_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "path": self.path,
            "status": self.status,
            "size": self.size,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "run_id": self.binding.run_id if self.binding else None,
            "node": self.binding.node if self.binding else None,
            "reason": self.reason,
        }


def read_slot(path: str | os.PathLike[str], index: int = 0) -> Slot:
    """The state of the slot directory ``path`` (never raises for what it finds there)."""
    text = os.fspath(path)
    problem = private_dir_problem(text)
    if problem == "absent":
        return Slot(index=index, path=text, status="empty")
    if problem is not None:
        return Slot(index=index, path=text, status="invalid", reason=problem)
    store = SlotStore(text)
    try:
        files = store.list()
    except CheckpointError as exc:
        return Slot(index=index, path=text, status="invalid", reason=str(exc))
    size = sum(files.values())
    try:
        data = read_manifest_bytes(store)
        manifest = parse_manifest(data)
    except CheckpointNotFoundError:
        return Slot(index=index, path=text, status="empty")
    except CheckpointError as exc:
        torn = MANIFEST_NAME not in files
        status: SlotStatus = "torn" if torn else "invalid"
        why = "no manifest: the snapshot was interrupted" if torn else f"manifest refused: {exc}"
        if torn and LOCK_NAME in files:
            why += " (its writer's lock is still there)"
        return Slot(index=index, path=text, status=status, size=size, reason=why)
    try:
        binding = SlotBinding.from_metadata(manifest.metadata)
    except CheckpointError as exc:
        return Slot(index=index, path=text, status="invalid", size=size, reason=str(exc))
    return Slot(
        index=index, path=text, status="committed", size=size, binding=binding, checkpoint_id=checkpoint_id(data)
    )


def private_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a directory of this user's that a slot may live in: "absent", or a reason; None if it is.

    The memory directory is usually under ``/dev/shm``, which every user may write: a slot or run directory
    planted there as a symlink, or owned by another user, would make a snapshot write (and its clean-up of
    an old slot's files) happen somewhere else, and a restore read someone else's state.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"cannot be examined: {exc}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink; memory slots follow none"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not this process's ({os.geteuid()})"
    return None


def _others_may_write(st: os.stat_result) -> bool:
    """Whether a user other than this one (root aside) may add, remove or rename entries of this directory."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) or st.st_uid not in (0, _euid())


def memory_dir_refusal(path: str | os.PathLike[str]) -> UnsafePathError | None:
    """Why ``path`` may not be a memory directory (an error naming it), or None; absent components are fine.

    Each existing component of the path, as given and as resolved, whose parent another user may write
    (``/dev/shm``, ``/tmp``: world-writable) must be a directory, not a symlink, and owned by this user (or
    by root, above the memory directory itself): another user's directory there lets its owner rename this
    user's run directory and slots away (a restore and ``ckpt rescue`` then find nothing), or plant a run's
    directory so that its start is refused; a symlink there sends the snapshots wherever its owner chose.
    """
    given = os.path.abspath(os.fspath(path))
    for candidate in dict.fromkeys((given, os.path.realpath(given))):
        refusal = _walk_refusal(candidate, given)
        if refusal is not None:
            return refusal
    return None


def _walk_refusal(path: str, given: str) -> UnsafePathError | None:
    parts = Path(path).parts
    current = Path(parts[0])
    try:
        parent = os.stat(current)
    except OSError as exc:
        return UnsafePathError(f"memory directory refused: {current} cannot be examined: {exc}", path=given)
    uid = _euid()
    for i, name in enumerate(parts[1:], start=2):
        child = current / name
        try:
            st = os.lstat(child)
        except FileNotFoundError:
            return None  # made by MemoryTier.ensure, 0700
        except OSError as exc:
            return UnsafePathError(f"memory directory refused: {child} cannot be examined: {exc}", path=given)
        last = i == len(parts)
        if _others_may_write(parent):
            why = f"in {current}, which other users may write"
            if stat.S_ISLNK(st.st_mode):
                return UnsafePathError(
                    f"memory directory refused: {child} is a symlink {why}", problem="symlink", path=given
                )
            if uid is not None and st.st_uid != uid and (last or st.st_uid != 0):
                return UnsafePathError(
                    f"memory directory refused: {child} is owned by uid {st.st_uid}, not by this user "
                    f"({uid}), {why}; use a directory of your own (memory_dir= or ${MEMORY_DIR_ENV}), "
                    f"e.g. the default {_per_user(SHM_DIR)}",
                    path=given,
                )
        try:
            parent = os.stat(child)  # a symlink in a directory only trusted users write: where it leads
        except OSError as exc:
            return UnsafePathError(f"memory directory refused: {child} cannot be examined: {exc}", path=given)
        if not stat.S_ISDIR(parent.st_mode):
            return UnsafePathError(
                f"memory directory refused: {child} is not a directory", problem="file_kind", path=given
            )
        current = child
    return None


class SlotRef(NamedTuple):
    """A committed snapshot in this node's ring: its slot index, step and checkpoint id."""

    slot: int
    step: int
    checkpoint_id: str


class RingPolicy:
    """Which slot of one node's ring the next snapshot rewrites, and which a durable copy holds (MEM-2).

    Pure bookkeeping, no I/O and no threads: its owner (the coordinator's snapshot writer) locks around it and
    tells it what happened. ``ring_slots`` is the ring the caller asked for; ``slot_count`` may be one more, the
    *spare* slot of a ring of two, written only while one slot is held for a durable copy and the other holds the
    newest snapshot, and only where the memory directory has room for it (``spare=`` of :meth:`pick`).

    Call sequence (rank 0's snapshot thread and persist thread, under the owner's lock)::

        ring = RingPolicy(slot_count=3, ring_slots=2)
        ring.load({0: 4, 1: 5, 2: None})    # what the slots hold at start (None: empty, torn or foreign)
        slot = ring.pick(newest=1, spare=True)  # None: no slot may be written, the snapshot is skipped
        ring.committed(slot, step)          # or ring.failed(slot)
        ring.hold(slot) ... ring.release(slot)  # a durable copy of slot runs meanwhile
    """

    def __init__(self, *, slot_count: int, ring_slots: int) -> None:
        if not 2 <= ring_slots <= slot_count:
            raise UsageError(f"a ring of {ring_slots} slots cannot live in {slot_count}")
        self.slot_count = slot_count
        self.ring_slots = ring_slots
        self._steps: dict[int, int | None] | None = None
        self._held: dict[int, int] = {}  # slot -> durable copies reading it (out of the ring meanwhile)
        self._failing: set[int] = set()  # slots whose last write failed: written last

    @property
    def loaded(self) -> bool:
        return self._steps is not None

    def load(self, steps: dict[int, int | None]) -> None:
        """What each slot holds: the step of a committed snapshot of this run and node, None for any other."""
        self._steps = {s: steps.get(s) for s in range(self.slot_count)}

    @property
    def steps(self) -> dict[int, int | None]:
        """Slot -> committed step (None: empty, torn, foreign or being rewritten); a copy."""
        return dict(self._known())

    def _known(self) -> dict[int, int | None]:
        if self._steps is None:
            raise UsageError("the ring's slots were not loaded")
        return self._steps

    def step_of(self, slot: int) -> int | None:
        return self._known().get(slot)

    def is_spare(self, slot: int) -> bool:
        return slot >= self.ring_slots

    def pick(self, *, newest: int | None, spare: bool) -> int | None:
        """The slot the next snapshot rewrites, or None when none may be (the snapshot is then skipped).

        Never a held slot, never ``newest`` (the slot of the newest committed snapshot: a crash while it is
        rewritten would leave only older ones); the spare only when ``spare`` (it fits) and no other will do; of
        the rest an empty one first, then the oldest; one whose last write failed (a planted symlink, a file it
        cannot rewrite) only when nothing else will. The slot picked counts as empty until :meth:`committed`."""
        steps = self._known()
        usable = {
            s: step
            for s, step in steps.items()
            if not self._held.get(s) and s != newest and (not self.is_spare(s) or spare)
        }
        if not usable:
            return None
        index = min(
            usable,
            key=lambda s: (s in self._failing, self.is_spare(s), usable[s] is not None, usable[s] or 0, s),
        )
        steps[index] = None  # being rewritten: no durable copy may start on it now
        return index

    def committed(self, slot: int, step: int) -> None:
        self._known()[slot] = step
        self._failing.discard(slot)

    def failed(self, slot: int) -> None:
        """The write into ``slot`` failed: it holds nothing, and is written last from now on."""
        self._failing.add(slot)
        if self._steps is not None:
            self._steps[slot] = None

    def succeeded(self, slot: int) -> None:
        """A write into ``slot`` succeeded (on a rank that keeps no steps): it is no longer written last."""
        self._failing.discard(slot)

    def hold(self, slot: int) -> None:
        """A durable copy reads ``slot``: out of the ring until :meth:`release`."""
        self._held[slot] = self._held.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        self._held[slot] -= 1

    def is_held(self, slot: int) -> bool:
        return bool(self._held.get(slot))

    def newest_committed(self) -> tuple[int, int] | None:
        """(slot, step) of the newest committed snapshot, or None when no slot holds one."""
        committed = {s: step for s, step in self._known().items() if step is not None}
        if not committed:
            return None
        slot = max(committed, key=lambda s: committed[s] or 0)
        return slot, committed[slot] or 0

    def drop_after(self, step: int, keep: int | None) -> None:
        """After a restore of ``step`` (from slot ``keep``, or from elsewhere when None): slots holding a newer step,
        or the same step in another slot, are not this trajectory's and go back to the ring to be rewritten."""
        steps = self._known()
        for index, held in steps.items():
            if held is not None and (held > step or (held == step and index != keep)):
                steps[index] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerCopy:
    """A ``peer-<source>-<k>`` directory of the run as found: the rank that sent it, and its state."""

    source: int
    slot: Slot  # the directory read as a slot: status, size, binding


class MemoryTier:
    """The slot ring of one run directory on this node.

    ``memory_dir`` is shared by every rank of the node (they write one checkpoint together, each its own
    files), and by other runs (each under its own ``run-<key>``).
    """

    def __init__(self, memory_dir: str | os.PathLike[str] | None, run_url: str, *, slots: int = 2) -> None:
        if not 2 <= slots <= MAX_SLOTS:
            raise UsageError(
                f"memory_slots must be between 2 and {MAX_SLOTS}: one slot is rewritten while another holds"
            )
        self.memory_dir = Path(os.path.abspath(os.fspath(memory_dir or default_memory_dir())))
        self.run_url = run_url
        self.root = self.memory_dir / run_dir_key(run_url)
        self.slot_count = slots

    def slot_path(self, index: int) -> str:
        return str(self.root / f"{SLOT_PREFIX}{index}")

    def slots(self) -> list[Slot]:
        return [read_slot(self.slot_path(i), i) for i in range(self.slot_count)]

    def ensure(self) -> None:
        """Make the run's directory, and the memory directory (and its missing parents) 0700 where absent.

        UnsafePathError when the memory directory, or one of its parents, is a symlink or another user's in
        a directory that others may write (:func:`memory_dir_refusal`), or when the run's directory is not
        this user's own (:func:`private_dir_problem`)."""
        for check in (False, True):  # again once made: another user may have made a component first
            refusal = memory_dir_refusal(self.memory_dir)
            if refusal is not None:
                raise refusal
            if check:
                break
            try:
                for directory in (*reversed(self.memory_dir.parents), self.memory_dir):
                    if not os.path.lexists(directory):
                        try:
                            os.mkdir(directory, mode=0o700)
                        except FileExistsError:
                            pass  # another rank of the node made it first
                self.root.mkdir(exist_ok=True, mode=0o700)
            except OSError as exc:
                raise MemoryCapacityError(f"cannot create the memory directory: {exc}", path=str(self.root)) from exc
        problem = private_dir_problem(self.root)
        if problem is not None:
            raise UnsafePathError(problem, path=str(self.root))

    def writable_slot(self, index: int) -> str:
        """The path of slot ``index``, made if absent; UnsafePathError when it is not a directory of ours."""
        path = self.slot_path(index)
        problem = private_dir_problem(path)
        if problem == "absent":
            try:
                os.mkdir(path, mode=0o700)
            except FileExistsError:
                pass  # another rank of the node made it first
            problem = private_dir_problem(path)
        if problem is not None:
            raise UnsafePathError(problem, path=path)
        return path

    def peer_copies(self) -> list[PeerCopy]:
        """The run's ``peer-<source>-<k>`` directories that are this user's own (others are never read)."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        out = []
        for name in names:
            source, _, k = name.removeprefix(PEER_PREFIX).partition("-")
            if not (name.startswith(PEER_PREFIX) and source.isdigit() and k.isdigit()):
                continue
            path = self.root / name
            if private_dir_problem(path) is None:
                out.append(PeerCopy(source=int(source), slot=read_slot(path, int(k))))
        return out

    def _unusable(self, copy: PeerCopy) -> bool:
        """Whether no restore and no rescue of this run would take the copy: it has no manifest (MEM-10), or it
        is bound to another run directory (MEM-4, MEM-8)."""
        slot = copy.slot
        if slot.status in ("empty", "torn"):
            return True
        if slot.status == "committed" and slot.binding is not None:
            return normalize_run_url(slot.binding.run_dir) != normalize_run_url(self.run_url)
        return False

    def check_capacity(self, per_slot: int, *, peer_sources: Collection[int] | None = None) -> None:
        """Refuse, before writing anything, slots that do not fit: ``per_slot`` is what one snapshot of this
        node's ranks takes; what this run's slots hold already is reused, so it counts as free.

        Peer copies are counted too. ``peer_sources``, the ranks whose replicas any rank of this node receives
        in this job, or None where not known: their copies are rewritten in place by its rounds, so they count as
        free, as slots do. Where it is given, a copy of another rank that no restore would take (no manifest,
        or another run directory's) is deleted: no round of this job writes there. Every other copy is kept,
        a stale one too (of a rank that no longer sends here, after a change of world or placement): it may
        be the only copy of another node's newest snapshot. What they hold is named in the refusal.
        """
        self.ensure()
        copies = self.peer_copies()
        current = set(peer_sources) if peer_sources is not None else set()
        reclaimed = 0
        kept: list[PeerCopy] = []
        for copy in copies:
            if peer_sources is not None and copy.source not in current and self._unusable(copy):
                log.info("memory tier: removing %s (%s): no restore would take it", copy.slot.path, copy.slot.status)
                reclaimed += copy.slot.size
                shutil.rmtree(copy.slot.path, ignore_errors=True)  # ours (peer_copies checked it); follows no link
            else:
                kept.append(copy)
        usage = shutil.disk_usage(self.memory_dir)
        held = sum(s.size for s in self.slots())
        reused = sum(c.slot.size for c in kept if c.source in current)
        need = self.slot_count * (per_slot + SLOT_OVERHEAD)
        if need > usage.free + held + reused:
            holds = f"this run's slots hold {_mib(held)}"
            if kept:
                holds += f", its peer copies {_mib(sum(c.slot.size for c in kept))}"
                stale = sum(c.slot.size for c in kept if c.source not in current)
                if peer_sources is not None and stale:
                    holds += f" ({_mib(stale)} of ranks that send none here now: kept, a restore may need them)"
            if reclaimed:
                holds += f"; {_mib(reclaimed)} of copies no restore would take were removed"
            raise MemoryCapacityError(
                f"{self.slot_count} memory slots of {_mib(per_slot + SLOT_OVERHEAD)} need {_mib(need)}, "
                f"but {self.memory_dir} has {_mib(usage.free)} free (of {_mib(usage.total)}; {holds}): give "
                f"memory_dir= (or ${MEMORY_DIR_ENV}) a larger tmpfs, e.g. `docker run --shm-size`, use "
                "memory_slots=2, or turn the memory tier off (memory_every=0)",
                path=str(self.memory_dir),
            )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
