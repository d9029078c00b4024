"""The slots of one run on one node: ``<memory dir>/run-<key>/slot-<k>/``, each a whole ckptfmt checkpoint.

A small ring of slots (two by default) is rewritten in turn, the oldest first, so a snapshot torn by a
crash never costs the one before it (spec/memory.md). Listing a slot reads its manifest only; the
bytes are checked when a restore reads them (every chunk's digest) or a persist copies them (every
file's digest).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import CheckpointError, CheckpointNotFoundError, MemoryCapacityError, UnsafePathError, UsageError
from ..manifest import checkpoint_id
from ..manifest_parse import parse_manifest
from ..paths import LOCK_NAME, MANIFEST_NAME
from ..reader import read_manifest_bytes
from ..storage.slot import SlotStore
from .binding import SlotBinding, run_dir_key

log = logging.getLogger("ckptfmt")

DEFAULT_MEMORY_DIR = "/dev/shm/ckptfmt"
MEMORY_DIR_ENV = "CKPTFMT_MEMORY_DIR"
SLOT_PREFIX = "slot-"
MAX_SLOTS = 16
# What a slot holds besides its tensors (manifest, context blobs, safetensors headers): a margin per slot
SLOT_OVERHEAD = 4 << 20
SlotStatus = Literal["committed", "torn", "empty", "invalid"]


def default_memory_dir() -> str:
    return os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR


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
        self.root = self.memory_dir / run_dir_key(run_url)
        self.slot_count = slots

    def slot_path(self, index: int) -> str:
        return str(self.root / f"{SLOT_PREFIX}{index}")

    def slots(self) -> list[Slot]:
        return [read_slot(self.slot_path(i), i) for i in range(self.slot_count)]

    def ensure(self) -> None:
        """Make the run's directory (the memory directory itself must exist or be creatable)."""
        try:
            self.memory_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
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

    def check_capacity(self, per_slot: int) -> None:
        """Refuse, before writing anything, slots that do not fit: ``per_slot`` is what one snapshot of this
        node's ranks takes; what this run's slots hold already is reused, so it counts as free."""
        self.ensure()
        usage = shutil.disk_usage(self.memory_dir)
        held = sum(s.size for s in self.slots())
        need = self.slot_count * (per_slot + SLOT_OVERHEAD)
        if need > usage.free + held:
            raise MemoryCapacityError(
                f"{self.slot_count} memory slots of {_mib(per_slot + SLOT_OVERHEAD)} need {_mib(need)}, "
                f"but {self.memory_dir} has {_mib(usage.free)} free (of {_mib(usage.total)}; this run's slots hold "
                f"{_mib(held)}): give memory_dir= (or ${MEMORY_DIR_ENV}) a larger tmpfs, e.g. `docker run "
                "--shm-size`, use memory_slots=2, or turn the memory tier off (memory_every=0)",
                path=str(self.memory_dir),
            )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
