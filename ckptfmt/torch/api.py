"""Save and resume the full training state of a PyTorch trainer as one checkpoint."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch

from .. import provenance as prov
from ..canonical import canonical_json
from ..errors import ResumeMismatchError, UsageError
from ..reader import Checkpoint, open_checkpoint
from ..run import check_replaceable_url
from ..storage import open_store
from ..writer import CheckpointWriter
from . import data_position, in_place, read_state, rng, sharding, state

# the all-or-nothing apply (apply_snapshot.py) is part of this module's face: api.apply, api.missing_fields
from .apply_snapshot import apply, missing_fields
from .state import HostBuffers, Snapshot

log = logging.getLogger("ckptfmt")
Policy = Literal["strict", "warn", "ignore"]
__all__ = [
    "DEDICATED_TIMEOUT",
    "Policy",
    "Restored",
    "apply",
    "capture",
    "data_source",
    "live_targets",
    "load",
    "load_checkpoint",
    "missing_fields",
    "restore",
    "resume_mismatches",
    "save",
    "topology",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """What :func:`load` restored."""

    step: int | None
    checkpoint_id: str
    url: str
    mismatches: tuple[str, ...]


DEDICATED_TIMEOUT = timedelta(minutes=5)


def _collective(
    process_group: Any = None, *, dedicated: bool = False, timeout: timedelta | None = None, purpose: str = ""
) -> Any:
    """A :class:`~ckptfmt.torch.collective.TorchCollective` when several ranks save together, else None.

    ``dedicated``: over a gloo group of its own (made here, collectively), for exchanges from a background
    thread that must never interleave with the trainer's own collectives on the default group; a rank that
    does not answer fails it after ``DEDICATED_TIMEOUT``.
    """
    from .collective import default_collective

    if not dedicated:
        return default_collective(process_group)
    return default_collective(process_group, timeout=timeout or DEDICATED_TIMEOUT, purpose=purpose)


def data_source(*, sampler: Any = None, loader: Any = None) -> Any:
    """The one object that holds the data position: ``loader`` or ``sampler`` (both is an error)."""
    if sampler is not None and loader is not None:
        raise UsageError("pass the data position as loader= or sampler=, not both")
    return loader if loader is not None else sampler


def topology(mesh: Mapping[str, int] | None = None) -> dict[str, Any]:
    """World size and rank from torch.distributed when it is initialized; device kinds; the parallelism mesh."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    out: dict[str, Any] = {
        "world_size": dist.get_world_size() if initialized else 1,
        "rank": dist.get_rank() if initialized else 0,
        "device_kinds": ["cuda:" + torch.cuda.get_device_name(0)] if torch.cuda.is_available() else ["cpu"],
        "threads": torch.get_num_threads(),
    }
    if mesh:
        out["mesh"] = {"dims": list(mesh), "shape": list(mesh.values())}
    return out


def capture(
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: object,
    sampler: Any = None,
    loader: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    generators: Mapping[str, np.random.Generator] | None = None,
    extra: Mapping[str, Any] | None = None,
    stateful: Mapping[str, Any] | None = None,
    mesh: Mapping[str, int] | None = None,
    parent: str | None = None,
    buffers: HostBuffers | None = None,
    code: Mapping[str, object] | None = None,
    defer: bool = False,
    data_policy: Policy = "strict",
    steps_passed: bool = True,
    optimizer_by_name: bool = True,
) -> Snapshot:
    """Snapshot all seven fields (plus scheduler, scaler and extras) into host memory.

    The data position comes from ``loader`` (a :class:`ResumableDataLoader`, a torchdata
    ``StatefulDataLoader``, a ``DataLoader`` over a :class:`ResumableSampler`) or ``sampler``; one of them
    is required. A position that would repeat data (a sampler that handed out samples but was never
    advanced while ``steps_passed``; a loader whose sampler cannot report its position) is refused under
    ``data_policy="strict"``, warned about under ``"warn"``.
    ``code``: the training code's git state if already known (see :func:`ckptfmt.provenance.capture`).
    ``optimizer_by_name``: key optimizer state by parameter name (the default: it survives a change of
    parallelism); False keys it by the parameter's index in the optimizer, as ckptfmt.torch did before it keyed by name.
    """
    source = data_source(sampler=sampler, loader=loader)
    if source is None:
        raise UsageError(
            "a training checkpoint needs the data position: pass loader= (a ckptfmt.torch.ResumableDataLoader) "
            "or sampler= (a ResumableSampler)"
        )
    data = data_position.data_field(source, policy=data_policy, steps_passed=steps_passed)
    snap = Snapshot()
    state.capture_model(model, snap, buffers, defer=defer)
    state.capture_optimizer(optimizer, snap, buffers, defer=defer, model=model if optimizer_by_name else None)
    snap.contexts["rng"] = rng.capture(generators)
    snap.contexts["data"] = data
    snap.contexts["config"] = state.config_field(config)
    snap.contexts["topology"] = topology(mesh)
    saved_mesh, placed = sharding.placements(model)
    if placed:  # the layout the state was saved in (spec/fields.md, topology.tensors); loads may use another
        snap.contexts["topology"]["tensors"] = placed
        snap.contexts["topology"].setdefault("mesh", saved_mesh)
    snap.contexts["provenance"] = prov.capture(step=step, parent=parent, code=code)
    if scheduler is not None:
        state.capture_stateful("scheduler", scheduler, snap)
    if scaler is not None:
        state.capture_stateful("grad_scaler", scaler, snap)
    for name, value in (extra or {}).items():
        if name in snap.contexts or name in snap.tensors:
            raise UsageError(f"extra field {name!r} collides with a standard field")
        snap.contexts[name] = state._plain(value, name)
    for name, obj in (stateful or {}).items():
        state.check_stateful_name(name, taken=set(snap.contexts) | set(snap.tensors))
        state.capture_stateful(name, obj, snap)
    return snap


def save(
    url: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: object,
    sampler: Any = None,
    loader: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    codec: str | None = None,
    base: str | os.PathLike[str] | None = None,
    frozen: Collection[str] = (),
    **kwargs: Any,
) -> str:
    """Write the full training state to ``url`` as one committed checkpoint; returns its id.

    ``codec="zstd"`` (or ``"zstd:LEVEL"``) compresses floating tensors (spec/codecs.md); default raw.

    ``base=`` an earlier checkpoint beside ``url`` (same run directory): chunks whose bytes equal the base's are
    referenced, not written (spec/references.md); ``frozen=`` names tensors declared unchanged since the base
    (a LoRA base model), referenced without being hashed.

    ``loader=`` (or ``sampler=``) gives the data position; see :func:`capture`. Once ``torch.distributed``
    is initialized with more than one rank (in ``process_group``, default the whole world), every rank
    calls this together: each writes its own shards, optimizer state is keyed by parameter name, and the
    commit is collective.
    """
    collective = _collective(process_group)
    snap = capture(
        step=step,
        model=model,
        optimizer=optimizer,
        sampler=sampler,
        loader=loader,
        config=config,
        **kwargs,
    )
    store = open_store(url, storage_options)
    writer = CheckpointWriter(
        store,
        profile="training",
        overwrite=overwrite,
        collective=collective,
        codec=codec,
        base=base,
        frozen=frozen,
        # a checkpoint other checkpoints of its directory reference is not replaced (REF-14)
        before_replace=functools.partial(check_replaceable_url, url, storage_options) if overwrite else None,
    )
    try:
        return state.write_snapshot(writer, snap)
    except BaseException:
        writer.abort()
        raise


def resume_mismatches(
    snap: Snapshot, *, config: object = None, sampler: Any = None, cwd: str | None = None
) -> list[str]:
    """What differs between the checkpoint and the current run: config hash, code commit, dataset.

    ``sampler``: the data source (a loader or a sampler) whose dataset identity is compared.
    """
    out = []
    stored_config = snap.contexts.get("config", {})
    if config is not None:
        stored = stored_config.get("hash")
        current = state.config_field(config)["hash"]
        if stored != current:
            ours, theirs = state.config_field(config)["config"], stored_config.get("config", {})
            # compared as canonical JSON, as the hash is: a tuple now and the list it was stored as are equal
            keys = sorted(
                k
                for k in set(ours) | set(theirs)
                if k not in ours or k not in theirs or canonical_json(ours[k]) != canonical_json(theirs[k])
            )
            out.append(f"config hash {stored} in the checkpoint, {current} now (differing keys: {', '.join(keys)})")
    code = snap.contexts.get("provenance", {}).get("code")
    now = prov.git_state(cwd)
    if isinstance(code, Mapping) and now is not None and code.get("commit") != now["commit"]:
        out.append(f"code commit {code.get('commit')} in the checkpoint, {now['commit']} now")
    dataset = snap.contexts.get("data", {}).get("dataset")
    current_ds = data_position.dataset_identity(sampler) if sampler is not None else None
    if isinstance(dataset, Mapping) and current_ds is not None:
        mine = current_ds.to_dict()
        for key in ("name", "version", "digest"):
            if dataset.get(key) != mine.get(key):
                out.append(f"dataset {key} {dataset.get(key)!r} in the checkpoint, {mine.get(key)!r} now")
    return out


def load_checkpoint(ckpt: Checkpoint, *, fresh: bool = False, **kwargs: Any) -> Restored:
    """Resume from an open checkpoint: read and verify every field, then compare and apply (see :func:`restore`).
    ``fresh``: the model and optimizer hold nothing of value (see :func:`load`)."""
    # everything read and verified before anything is applied; for a model's DTensors, only this rank's region;
    # tensors with a home in host memory checked where they are stored, and copied in as the last step of applying
    model = kwargs.get("model")
    live = live_targets(model, kwargs.get("optimizer"), kwargs.get("skip_fields", ())) if model is not None else None
    targets = read_state.load_targets(model) if model is not None else None
    snap = read_state.read_snapshot(ckpt, targets, live, fresh=fresh)
    return restore(snap, checkpoint_id=ckpt.id, url=ckpt.url, **kwargs)


def live_targets(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, skip_fields: Sequence[str] = ()
) -> dict[tuple[str, str], Any]:
    """What a load may fill in place (``in_place.live_tensors``): the model's tensors, and the optimizer's state
    unless the load leaves it out."""
    if "optimizer" in skip_fields:
        optimizer = None
    names = None
    if optimizer is not None:
        try:
            names = state.stored_param_names(model, optimizer)
        except UsageError:
            optimizer = None  # applying it raises the same error, after every check
    return in_place.live_tensors(model, optimizer, names)


def restore(
    snap: Snapshot,
    *,
    checkpoint_id: str,
    url: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    loader: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    stateful: Mapping[str, Any] | None = None,
    config: object = None,
    generators: Mapping[str, np.random.Generator] | None = None,
    on_mismatch: Policy = "warn",
    restore_rng: bool = True,
    skip_fields: Sequence[str] = (),
) -> Restored:
    """Compare a verified snapshot with the current run (``on_mismatch``), then apply it to the live objects.

    ``loader=`` (or ``sampler=``) takes the data position back. ``skip_fields`` (``rng``, ``data``,
    ``optimizer``) are left out of the apply.
    """
    source = data_source(sampler=sampler, loader=loader)
    try:
        mismatches = resume_mismatches(snap, config=config, sampler=source)
        if mismatches:
            message = f"resuming {url} under a different run: " + "; ".join(mismatches)
            if on_mismatch == "strict":
                raise ResumeMismatchError(message, path=url)
            if on_mismatch == "warn":
                log.warning(message)
        apply(
            snap,
            model=model,
            optimizer=None if "optimizer" in skip_fields else optimizer,
            sampler=None if "data" in skip_fields else source,
            scheduler=scheduler,
            scaler=scaler,
            stateful=stateful,
            generators=generators,
            restore_rng=restore_rng and "rng" not in skip_fields,
        )
    except BaseException:
        snap.discard()  # refused after its check: what was checked for the copy-in leaves the page cache
        raise
    step = snap.contexts.get("provenance", {}).get("step")
    return Restored(
        step=step if isinstance(step, int) else None, checkpoint_id=checkpoint_id, url=url, mismatches=tuple(mismatches)
    )


def load(url: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Restored:
    """Resume from one checkpoint: all fields read and verified, then applied together (all or nothing).

    Takes :func:`restore`'s arguments: ``model=`` and optionally ``optimizer=``, ``loader=`` or
    ``sampler=``, ``scheduler=``, ``scaler=``, ``config=``, ``generators=``, ``on_mismatch=``.
    A plain ``DataLoader`` with ``generator=None``, or whose sampler cannot report its position, is
    restored with an :class:`~ckptfmt.torch.InexactResumeWarning` saying why the resume will not be exact.

    ``fresh=True``: the model and optimizer were just built and hold nothing of value (a restart), so tensors loaded
    in place are read, hashed and placed in one pass. A refused checkpoint then raises as always, but leaves them
    holding part of it (the default checks every byte before any live tensor changes: a second pass).
    """
    with open_checkpoint(url, storage_options) as ckpt:
        return load_checkpoint(ckpt, **kwargs)
