"""``ckpt rescue``: persist what dead workers left in node memory, as ordinary checkpoints of their run.

Every committed slot under a memory directory that belongs to the run directory is read together with the
peer copies of the same checkpoint on this node (``peer-*``: the files other nodes' ranks wrote, copied here
by replicas, :mod:`.replica`), through one :class:`~ckptfmt.storage.overlay.OverlayStore`, as the agreed
restore reads them. The checkpoint so assembled is verified whole (every file re-hashed) and copied into the
run directory (:func:`~ckptfmt.tier.persist.persist`). A slot whose checkpoint lacks files no directory here
holds (another node's, never replicated here) is ``partial``; one that fails verification is ``corrupt``; one
whose destination is a symlink or not a directory is ``refused``; torn slots and other run directories' are
skipped. Nothing in memory is deleted: the memory tier's owner reuses its slots.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import CheckpointError, IntegrityError, UnsafePathError
from ..manifest import checkpoint_id
from ..manifest_io import read_manifest_bytes
from ..manifest_parse import parse_manifest
from ..run import RunDirectory
from ..storage.base import Store
from ..storage.overlay import OverlayStore
from ..storage.slot import SlotStore
from ..verify import Problem, verify_checkpoint
from .binding import normalize_run_url, run_dir_key
from .holdings import PEER_PREFIX
from .persist import Persisted, persist
from .ring import SLOT_PREFIX, Slot, private_dir_problem, read_slot

RescueStatus = Literal["persisted", "already durable", "conflict", "partial", "corrupt", "refused", "failed", "skipped"]
# What leaves a committed snapshot of the run neither in the run directory nor knowingly left there: the CLI
# exits 1 for these (a conflict is a checkpoint the run directory has already, at that step; see its docs)
NOT_RESCUED: frozenset[str] = frozenset({"partial", "corrupt", "refused", "failed"})
MEMORY_LABEL = "memory"


@dataclass(frozen=True, slots=True, kw_only=True)
class RescueOutcome:
    """One slot: what it held and what became of it."""

    slot: Slot
    status: RescueStatus
    detail: str | None = None
    persisted: Persisted | None = None
    copies: tuple[str, ...] = ()  # the peer copies that supplied files of the slot's checkpoint
    missing: tuple[str, ...] = ()  # partial: the files of the checkpoint no directory here holds

    def to_dict(self) -> dict[str, object]:
        return {
            "slot": self.slot.to_dict(),
            "status": self.status,
            "detail": self.detail,
            "persisted": self.persisted.to_dict() if self.persisted else None,
            "copies": list(self.copies),
            "missing": list(self.missing),
        }


def _run_root(memory_dir: str | os.PathLike[str], run_url: str) -> Path | None:
    """The run's directory under ``memory_dir``; None when absent. UnsafePathError when it is a symlink, not a
    directory or another user's (as a writer refuses it, :meth:`~ckptfmt.tier.ring.MemoryTier.ensure`)."""
    root = Path(memory_dir) / run_dir_key(run_url)
    problem = private_dir_problem(root)
    if problem == "absent":
        return None
    if problem is not None:
        raise UnsafePathError(problem, path=str(root))
    return root


def _children(root: Path, prefix: str) -> list[Path]:
    return [c for c in sorted(root.iterdir()) if c.name.startswith(prefix) and private_dir_problem(c) is None]


def find_slots(memory_dir: str | os.PathLike[str], run_url: str) -> list[Slot]:
    """The slots under ``memory_dir`` that belong to ``run_url``'s directory, newest step first.

    UnsafePathError when the run's directory there is a symlink, not a directory or another user's (as a
    writer refuses it, :meth:`~ckptfmt.tier.ring.MemoryTier.ensure`): its slots would be someone else's."""
    root = _run_root(memory_dir, run_url)
    if root is None:
        return []
    found = []
    for child in sorted(root.iterdir()):
        suffix = child.name.removeprefix(SLOT_PREFIX)
        if child.name.startswith(SLOT_PREFIX) and suffix.isdigit() and child.is_dir() and not child.is_symlink():
            found.append(read_slot(child, int(suffix)))
    found.sort(key=lambda s: (s.step if s.step is not None else -1, s.index), reverse=True)
    return found


def find_copies(memory_dir: str | os.PathLike[str], run_url: str) -> list[Slot]:
    """The committed peer copies (``peer-<rank>-<k>``) under the run's directory in ``memory_dir``, by path.
    Copies being received (no manifest yet), symlinked or other users' directories are left out."""
    root = _run_root(memory_dir, run_url)
    if root is None:
        return []
    copies = []
    for child in _children(root, PEER_PREFIX):
        ring = child.name.rpartition("-")[2]  # peer-<source rank>-<k>: k is its place in the source's ring
        copies.append(read_slot(child, int(ring) if ring.isdigit() and len(ring) == 1 else 0))
    return [c for c in copies if c.status == "committed"]


def rescue(
    memory_dir: str | os.PathLike[str], run_url: str, storage_options: Mapping[str, Any] | None = None
) -> list[RescueOutcome]:
    """Persist every committed slot of ``run_url`` found under ``memory_dir`` whose checkpoint this node holds
    whole (in the slot and the peer copies beside it) and verifies; one outcome per slot."""
    run = RunDirectory(run_url, storage_options)
    wanted = normalize_run_url(run_url)
    copies = find_copies(memory_dir, run_url)
    outcomes = []
    for slot in find_slots(memory_dir, run_url):
        if slot.status != "committed" or slot.binding is None:
            outcomes.append(RescueOutcome(slot=slot, status="skipped", detail=slot.reason or slot.status))
            continue
        if normalize_run_url(slot.binding.run_dir) != wanted:
            detail = f"belongs to run directory {slot.binding.run_dir!r}"
            outcomes.append(RescueOutcome(slot=slot, status="skipped", detail=detail))
            continue
        outcomes.append(_rescue_slot(slot, [c for c in copies if c.checkpoint_id == slot.checkpoint_id], run))
    return outcomes


def _rescue_slot(slot: Slot, copies: list[Slot], run: RunDirectory) -> RescueOutcome:
    """The slot's checkpoint, read from the slot first and its peer copies after, verified whole, persisted."""
    try:
        data = read_manifest_bytes(SlotStore(slot.path))
        manifest = parse_manifest(data)
    except CheckpointError as exc:  # changed since it was listed
        return RescueOutcome(slot=slot, status="skipped", detail=str(exc))
    if checkpoint_id(data) != slot.checkpoint_id:
        return RescueOutcome(slot=slot, status="skipped", detail="its manifest changed while it was read")
    layers: list[tuple[str, Store]] = [(MEMORY_LABEL, SlotStore(slot.path))]
    layers += [(c.path, SlotStore(c.path)) for c in copies]
    overlay = OverlayStore(layers, sizes={f.path: f.size for f in manifest.files})
    try:
        try:
            problems = _verify(overlay, data)
        except CheckpointError as exc:  # a manifest this copy cannot check (references a base: never a snapshot)
            return RescueOutcome(slot=slot, status="failed", detail=str(exc))
        used = tuple(sorted({s for s in overlay.sources.values() if s != MEMORY_LABEL}))
        missing = tuple(p.path for p in problems if p.code == "missing_file" and p.path is not None)
        damaged = [p for p in problems if p.code != "missing_file" or p.path is None]
        if damaged:
            detail = "; ".join(str(p) for p in damaged[:3])
            if missing:
                detail += f"; and {len(missing)} file(s) no directory here holds"
            return RescueOutcome(slot=slot, status="corrupt", detail=detail, copies=used, missing=missing)
        if missing:
            detail = (
                f"{len(missing)} of the checkpoint's {len(manifest.files)} files are in neither the slot nor a peer "
                f"copy here: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} (a snapshot spread over "
                "nodes: the files of a node whose copies never reached this one)"
            )
            return RescueOutcome(slot=slot, status="partial", detail=detail, copies=used, missing=missing)
        try:
            done = persist(overlay, run)
        except UnsafePathError as exc:  # the destination is a symlink or not a directory: nothing written there
            return RescueOutcome(slot=slot, status="refused", detail=str(exc), copies=used)
        except IntegrityError as exc:  # rotted between the verification and the copy
            return RescueOutcome(slot=slot, status="corrupt", detail=str(exc), copies=used)
        except CheckpointError as exc:  # the run directory failed (storage, a lock)
            return RescueOutcome(slot=slot, status="failed", detail=str(exc), copies=used)
        return RescueOutcome(slot=slot, status=done.status, persisted=done, copies=used)
    finally:
        overlay.close()


def _verify(overlay: OverlayStore, data: bytes) -> list[Problem]:
    """Every problem of the checkpoint read through ``overlay``. A file found bad in one directory is read again
    from the next that holds it (a stale or rotted file in the slot must not hide a good peer copy)."""
    manifest = parse_manifest(data)
    while True:
        report = verify_checkpoint(overlay, manifest, checkpoint_id=checkpoint_id(data))
        bad = {p.path for p in report.problems if p.path is not None and p.code != "missing_file"}
        if not [path for path in sorted(bad) if overlay.fall_back(path) is not None]:
            return report.problems
