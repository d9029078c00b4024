"""What each node's memory holds (spec/memory.md, MEM-11 and MEM-17).

A checkpoint of a job spanning several nodes is one manifest whose files are spread over the nodes' slots;
replicas put copies of a node's files on another node. A **holding** is one directory on one node with a
committed manifest and some of the files it lists. At a restore each node's leader lists its own holdings
(:func:`node_holdings`) and summarizes them (:mod:`.summary`); :func:`complete` is the file-by-file definition of a
checkpoint held whole (MEM-11), which the summaries' choice never exceeds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import CheckpointError, MalformedMessageError
from ..manifest import Manifest, checkpoint_id
from ..manifest_io import read_manifest_bytes
from ..manifest_parse import parse_manifest
from ..paths import LOCK_NAME, MANIFEST_NAME
from ..storage.slot import SlotStore
from .binding import SlotBinding, normalize_run_url
from .ring import MemoryTier, private_dir_problem

HoldingKind = Literal["slot", "peer", "fetched"]
HOLDING_KINDS: tuple[HoldingKind, ...] = ("slot", "peer", "fetched")
PEER_PREFIX = "peer-"
FETCH_PREFIX = "fetched-"
_CHECKPOINT_ID = re.compile(r"sha256:[0-9a-f]{64}")
_HOLDING_MEMBERS = ("node", "path", "kind", "checkpoint_id", "step", "files")
# the names ckptfmt/layout.py gives a rank's files
_RANK_FILE = re.compile(r"r(?P<data>\d+)-\d+\.safetensors|context(?:\.r(?P<context>\d+))?\.msgpack")


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """A directory on ``node`` holding ``files`` (path -> size) of the committed checkpoint ``checkpoint_id``."""

    node: str
    path: str
    kind: HoldingKind
    checkpoint_id: str
    step: int
    files: Mapping[str, int]

    def to_dict(self) -> dict[str, object]:
        return {
            "node": self.node,
            "path": self.path,
            "kind": self.kind,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "files": dict(sorted(self.files.items())),
        }

    @classmethod
    def from_dict(cls, doc: object, *, rank: int | None = None) -> Holding:
        """Parse a holding another rank sent (``rank``, named in the error): every member of its type, the checkpoint
        id well formed, sizes and step non-negative; MalformedMessageError naming the member otherwise."""
        who = _sender(rank)
        record = _record(doc, _HOLDING_MEMBERS, f"{who}: a holding")
        kind = _text(record, "kind", who)
        if kind not in HOLDING_KINDS:
            raise MalformedMessageError(f"{who}: holding member 'kind' is {kind[:40]!r}, not one of {HOLDING_KINDS}")
        files = record["files"]
        if not isinstance(files, Mapping):
            raise MalformedMessageError(f"{who}: holding member 'files' is {type(files).__name__}, not an object")
        return cls(
            node=_text(record, "node", who),
            path=_text(record, "path", who),
            kind=kind,
            checkpoint_id=check_checkpoint_id(record["checkpoint_id"], who),
            step=_count(record, "step", who),
            files={_file_name(k, who): _count(files, k, who, "the size of file") for k in files},
        )


def _sender(rank: int | None) -> str:
    return f"rank {rank}" if rank is not None else "a peer"


def check_checkpoint_id(value: object, who: str) -> str:
    """``value`` if it is a checkpoint id (``sha256:`` and 64 lowercase hex digits), else MalformedMessageError: an
    id names directories and files on the receiving node, so nothing else may pass as one."""
    if not isinstance(value, str) or _CHECKPOINT_ID.fullmatch(value) is None:
        shown = value[:80] if isinstance(value, str) else type(value).__name__
        raise MalformedMessageError(f"{who}: {shown!r} is not a checkpoint id (sha256: and 64 hex digits)")
    return value


def _record(doc: object, members: tuple[str, ...], what: str) -> Mapping[str, object]:
    if not isinstance(doc, Mapping):
        raise MalformedMessageError(f"{what} is {type(doc).__name__}, not an object")
    missing = [m for m in members if m not in doc]
    if missing:
        raise MalformedMessageError(f"{what} lacks member {missing[0]!r}")
    extra = sorted(str(k) for k in doc if k not in members)
    if extra:
        raise MalformedMessageError(f"{what} has an unknown member {extra[0][:40]!r}")
    return doc


def _text(doc: Mapping[str, object], name: str, who: str) -> str:
    value = doc[name]
    if not isinstance(value, str) or not value:
        raise MalformedMessageError(f"{who}: member {name!r} is {type(value).__name__}, not a non-empty string")
    return value


def _count(doc: Mapping[str, object], name: str, who: str, what: str = "member") -> int:
    value = doc[name]
    # bool is an int to Python, not to JSON; a count beyond int64 is no file's nor step's
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise MalformedMessageError(f"{who}: {what} {name!r} is {str(value)[:40]!r}, not a non-negative integer")
    return value


def _file_name(value: object, who: str) -> str:
    if not isinstance(value, str) or not value:
        raise MalformedMessageError(f"{who}: a holding's file name is {type(value).__name__}, not a string")
    return value


def rank_of_file(path: str) -> int | None:
    """The rank that wrote ``path``, by the reference writer's names (:mod:`ckptfmt.layout`): ``r<rank>-<seq>``
    data files and ``context[.r<rank>].msgpack`` blobs; None for any other name."""
    found = _RANK_FILE.fullmatch(path.rpartition("/")[2])
    if found is None:
        return None
    rank = found.group("data") or found.group("context")
    return int(rank) if rank is not None else 0


def own_files(binding: SlotBinding, node: str, files: Mapping[str, int]) -> dict[str, int]:
    """Of a slot's ``files``, those the snapshot's node map (``ckptfmt.memory.nodes``) puts on ``node``.

    A spread slot rewritten after a change of placement (MEM-9) can keep a file an earlier snapshot's rank wrote
    here, under a name the new manifest lists for a rank now on another node, at the same size: present, but
    stale. It is not this node's to hold (its digest would fail on read), so it is not counted."""
    if not binding.nodes:
        return dict(files)  # written on one node: every file is its own
    out: dict[str, int] = {}
    for path, size in files.items():
        rank = rank_of_file(path)
        if rank is None or (rank < len(binding.nodes) and binding.nodes[rank] == node):
            out[path] = size
    return out


def node_holdings(
    tier: MemoryTier, *, node: str, run_id: str, run_dir: str, slot_count: int
) -> tuple[list[Holding], dict[str, bytes]]:
    """This node's holdings of the run (its slots, the peer copies it received, files fetched at a restore) and
    their manifests by checkpoint id. Directories of another run, uncommitted or unsafe ones are left out."""
    holdings: list[Holding] = []
    manifests: dict[str, bytes] = {}
    names = [f"slot-{i}" for i in range(slot_count)]
    try:
        names += sorted(n for n in os.listdir(tier.root) if n.startswith((PEER_PREFIX, FETCH_PREFIX)))
    except OSError:
        pass
    for name in names:
        path = os.path.join(tier.root, name)
        if private_dir_problem(path) is not None:
            continue
        store = SlotStore(path)
        try:
            data = read_manifest_bytes(store)
            binding = SlotBinding.from_metadata(parse_manifest(data).metadata)
            present = store.list()
        except CheckpointError:
            continue
        if binding.foreign_to(run_id=run_id, node=None) is not None:
            continue
        if normalize_run_url(binding.run_dir) != normalize_run_url(run_dir):
            continue
        kind: HoldingKind = (
            "slot" if name.startswith("slot-") else "peer" if name.startswith(PEER_PREFIX) else "fetched"
        )
        ckpt_id = checkpoint_id(data)
        files = {p: s for p, s in present.items() if p not in (MANIFEST_NAME, LOCK_NAME)}
        if kind == "slot":
            files = own_files(binding, node, files)
        holdings.append(Holding(node=node, path=path, kind=kind, checkpoint_id=ckpt_id, step=binding.step, files=files))
        manifests[ckpt_id] = data
    return holdings, manifests


def held_files(manifest: Manifest, holdings: Iterable[Holding], ckpt_id: str) -> dict[str, list[Holding]]:
    """Each file of ``manifest`` -> the holdings of ``ckpt_id`` that have it at the manifest's size."""
    sizes = {f.path: f.size for f in manifest.files}
    out: dict[str, list[Holding]] = {p: [] for p in sizes}
    for holding in holdings:
        if holding.checkpoint_id != ckpt_id:
            continue
        for path, size in holding.files.items():
            if sizes.get(path) == size:
                out[path].append(holding)
    return out


def complete(holdings: Sequence[Holding], manifests: Mapping[str, bytes]) -> list[tuple[int, str]]:
    """(step, checkpoint id) of every checkpoint whose every file is held somewhere, newest step first
    (ties: the checkpoint id, so that every coordinator orders alike)."""
    found: set[tuple[int, str]] = set()
    for holding in holdings:
        data = manifests.get(holding.checkpoint_id)
        if data is None or (holding.step, holding.checkpoint_id) in found:
            continue
        manifest = parse_manifest(data)
        if all(held_files(manifest, holdings, holding.checkpoint_id).values()):
            found.add((holding.step, holding.checkpoint_id))
    return sorted(found, reverse=True)
