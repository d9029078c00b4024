"""Reading a training state back: every field of a checkpoint read and digest-checked into a :class:`Snapshot`
before anything is applied (:mod:`ckptfmt.torch.state` captures, writes and applies it).

For a live DTensor only this rank's region is read, from the chunks that overlap it, whatever the saving topology;
tensors that can be filled in place are checked now and copied in later (:mod:`ckptfmt.torch.in_place`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..manifest import FieldRecord, Manifest
from ..read_plan import Target, whole
from ..reader import Checkpoint
from . import in_place
from .in_place import Checked
from .sharding import TargetShard, is_dtensor, local_region
from .state import Snapshot


def _placed(field_name: str, record: FieldRecord, targets: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of a field that load into a live DTensor (only its region is read): name -> the DTensor."""
    placed: dict[str, Any] = {}
    for tname, tensor in record.tensors.items():
        owner = tname if field_name == "weights" else tname.rpartition("/")[0] if field_name == "optimizer" else ""
        like = targets.get(owner)
        if like is not None and tuple(tensor.shape) == tuple(int(d) for d in like.shape):
            placed[tname] = like
    return placed


def files_needed(manifest: Manifest, targets: Mapping[str, Any] | None = None) -> set[str]:
    """The files :func:`read_snapshot` reads from a checkpoint with ``manifest`` on this rank: every context
    blob, and the data files of the chunks it reads (for a placed tensor, those overlapping this rank's region)."""
    targets = targets or {}
    needed: set[str] = set()
    for name, record in manifest.fields.items():
        if record.context is not None:
            needed.add(record.context)
        placed = _placed(name, record, targets) if record.kind == "tensors" else {}
        for tname, tensor in record.tensors.items():
            like = placed.get(tname)
            region = local_region(like) if like is not None else None
            for chunk in tensor.chunks:
                if region is None or _overlaps(chunk.offsets, chunk.shape, region[0], region[1]):
                    needed.add(chunk.path)
    return needed


def _overlaps(offsets: Any, shape: Any, lo: Any, size: Any) -> bool:
    return all(o < b + s and b < o + n for o, n, b, s in zip(offsets, shape, lo, size, strict=True))


def read_snapshot(
    ckpt: Checkpoint,
    targets: Mapping[str, Any] | None = None,
    live: Mapping[tuple[str, str], Any] | None = None,
    *,
    fresh: bool = False,
) -> Snapshot:
    """Every field, every byte read and digest-checked, before anything is applied anywhere.

    ``targets`` maps a parameter's name to the live DTensor it will be loaded into (:func:`load_targets`):
    for it, and for optimizer state shaped like it (``<name>/exp_avg``...), only the region this rank
    holds is read, from the chunks that overlap it, whatever the saving topology.

    ``live`` (:func:`in_place.live_tensors`) are tensors the load may fill in place: those that qualify are
    checked now and become :class:`Checked` entries, filled by ``snap.copy_in()`` while ``ckpt`` is open (two passes:
    a refusal leaves them untouched). ``fresh``: they hold nothing of value, so they are filled now, each byte read
    and hashed once; if a check fails they hold part of what was read (the caller must not use them).
    """
    snap = Snapshot()
    targets = targets or {}
    records = {(n, t): tensor for n, r in ckpt.fields.items() if r.kind == "tensors" for t, tensor in r.tensors.items()}
    # in place only where a second read is a copy out of the page cache: on an object store it would be a second GET
    checked = in_place.plan(records, live or {}) if ckpt.store.capabilities.local else {}
    # One read plan for every tensor of every field: each file's pieces are read together and files in parallel.
    regions: list[Target] = []
    likes: list[Any] = []
    for name, record in ckpt.fields.items():
        if record.kind != "tensors":
            continue
        placed = _placed(name, record, targets)
        snap.tensors[name] = {}
        for tname, tensor in record.tensors.items():
            if (name, tname) in checked:
                snap.tensors[name][tname] = checked[(name, tname)]
                continue
            like = placed.get(tname)
            if like is None:
                regions.append(whole(name, tname, tensor))
            else:
                offsets, shape = local_region(like)
                regions.append(Target(name, tname, tensor.dtype, tuple(offsets), tuple(shape)))
            likes.append(like)
    # The context blobs (small files: a disk's latency each) are read beside the tensors, not after them.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-contexts") as side:
        contexts = side.submit(
            lambda: {name: ckpt.read_context(name) for name, record in ckpt.fields.items() if record.context}
        )
        # checked first: its streams run across the small tensors between the large ones, which the read then
        # finds in the page cache instead of seeking for each
        check = [c.target for c in checked.values()]
        if fresh:
            in_place.fill_fresh(ckpt, list(checked.values()))
            check = []  # filled already: nothing to forget, nothing to copy in
        else:
            ckpt.check_regions(check)
        try:
            arrays = ckpt.read_regions(regions)
            snap.contexts.update(contexts.result())
        except BaseException:
            ckpt.forget_regions(check)  # refused: what was checked will not be copied in, so not kept cached
            raise
    for region, like, array in zip(regions, likes, arrays, strict=True):
        snap.tensors[region.field][region.tensor] = array if like is None else TargetShard(array, like)
    if checked:
        aliased = _untied_aliases(ckpt, snap, checked, records, live or {})  # may take some out of checked
        if fresh:
            in_place.fill_fresh(ckpt, aliased)  # an untied alias's own tensor: the stored bytes once more
            return snap
        fills = list(checked.values()) + aliased
        snap.copy_in = functools.partial(in_place.copy_in, ckpt, fills)
        snap.forget = functools.partial(ckpt.forget_regions, [c.target for c in fills])
    return snap


def _untied_aliases(
    ckpt: Checkpoint,
    snap: Snapshot,
    checked: dict[tuple[str, str], Checked],
    records: Mapping[tuple[str, str], Any],
    live: Mapping[tuple[str, str], Any],
) -> list[Checked]:
    """A tensor saved tied (stored once, the other names aliases) loaded into a model where it is not: each alias's
    own tensor is filled from the stored one too; where it cannot be (another device...), the stored tensor is
    read into memory instead, as without in-place loads, and copied to both."""
    out: list[Checked] = []
    for alias, name in snap.contexts.get("weights", {}).get("aliases", {}).items():
        stored, mine = checked.get(("weights", name)), live.get(("weights", alias))
        if stored is None or mine is None or in_place.same_memory(mine, stored.live):
            continue
        fits = in_place.plan({("weights", alias): records[("weights", name)]}, {("weights", alias): mine})
        if fits:
            out.append(Checked(stored.target, mine, fits[("weights", alias)].local))
        else:
            snap.tensors["weights"][name] = ckpt.read_regions([stored.target])[0]
            checked.pop(("weights", name))
    return [c for c in out if ("weights", c.target.tensor) in checked]


def load_targets(model: torch.nn.Module) -> dict[str, Any]:
    """The model's DTensors by name: where a load must place what it reads on this rank."""
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if is_dtensor(t)}
