"""Save and resume the full training state of a PyTorch trainer as one checkpoint."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .. import provenance as prov
from ..canonical import canonical_json
from ..errors import ResumeMismatchError, UsageError
from ..reader import Checkpoint, open_checkpoint
from ..storage import open_store
from ..writer import CheckpointWriter
from . import rng, state
from .state import HostBuffers, Snapshot

log = logging.getLogger("ckptfmt")
Policy = Literal["strict", "warn", "ignore"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """What :func:`load` restored."""

    step: int | None
    checkpoint_id: str
    url: str
    mismatches: tuple[str, ...]


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


def _data_field(sampler: Any) -> dict[str, Any]:
    data = sampler.state_dict()
    if isinstance(data, Mapping) and "epoch" in data and "global_sample_offset" in data:
        return dict(data)
    # a StatefulDataLoader-style object with its own state shape: keep it whole beside the required keys
    epoch = data.get("epoch", 0) if isinstance(data, Mapping) else 0
    return {"epoch": int(epoch), "global_sample_offset": int(getattr(sampler, "consumed", 0)), "loader": data}


def capture(
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    config: object,
    scheduler: Any = None,
    scaler: Any = None,
    generators: Mapping[str, np.random.Generator] | None = None,
    extra: Mapping[str, Any] | None = None,
    mesh: Mapping[str, int] | None = None,
    parent: str | None = None,
    buffers: HostBuffers | None = None,
    code: Mapping[str, object] | None = None,
    defer: bool = False,
) -> Snapshot:
    """Snapshot all seven fields (plus scheduler, scaler and extras) into host memory.

    ``code``: the training code's git state if already known (see :func:`ckptfmt.provenance.capture`).
    """
    snap = Snapshot()
    state.capture_model(model, snap, buffers, defer=defer)
    state.capture_optimizer(optimizer, snap, buffers, defer=defer)
    snap.contexts["rng"] = rng.capture(generators)
    snap.contexts["data"] = _data_field(sampler)
    snap.contexts["config"] = state.config_field(config)
    snap.contexts["topology"] = topology(mesh)
    snap.contexts["provenance"] = prov.capture(step=step, parent=parent, code=code)
    if scheduler is not None:
        state.capture_stateful("scheduler", scheduler, snap)
    if scaler is not None:
        state.capture_stateful("grad_scaler", scaler, snap)
    for name, value in (extra or {}).items():
        if name in snap.contexts or name in snap.tensors:
            raise UsageError(f"extra field {name!r} collides with a standard field")
        snap.contexts[name] = state._plain(value, name)
    return snap


def save(
    url: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    config: object,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    **kwargs: Any,
) -> str:
    """Write the full training state to ``url`` as one committed checkpoint; returns its id."""
    snap = capture(step=step, model=model, optimizer=optimizer, sampler=sampler, config=config, **kwargs)
    writer = CheckpointWriter(open_store(url, storage_options), profile="training", overwrite=overwrite)
    try:
        return state.write_snapshot(writer, snap)
    except BaseException:
        writer.abort()
        raise


def compare(snap: Snapshot, *, config: object = None, sampler: Any = None, cwd: str | None = None) -> list[str]:
    """What differs between the checkpoint and the current run: config hash, code commit, dataset."""
    out = []
    if config is not None:
        stored = snap.contexts["config"].get("hash")
        current = state.config_field(config)["hash"]
        if stored != current:
            ours, theirs = state.config_field(config)["config"], snap.contexts["config"].get("config", {})
            # compared as canonical JSON, as the hash is: a tuple now and the list it was stored as are equal
            keys = sorted(
                k
                for k in set(ours) | set(theirs)
                if k not in ours or k not in theirs or canonical_json(ours[k]) != canonical_json(theirs[k])
            )
            out.append(f"config hash {stored} in the checkpoint, {current} now (differing keys: {', '.join(keys)})")
    code = snap.contexts["provenance"].get("code")
    now = prov.git_state(cwd)
    if isinstance(code, Mapping) and now is not None and code.get("commit") != now["commit"]:
        out.append(f"code commit {code.get('commit')} in the checkpoint, {now['commit']} now")
    dataset = snap.contexts["data"].get("dataset")
    current_ds = getattr(sampler, "dataset", None)
    if isinstance(dataset, Mapping) and current_ds is not None and hasattr(current_ds, "to_dict"):
        mine = current_ds.to_dict()
        for key in ("name", "version", "digest"):
            if dataset.get(key) != mine.get(key):
                out.append(f"dataset {key} {dataset.get(key)!r} in the checkpoint, {mine.get(key)!r} now")
    return out


def apply(
    snap: Snapshot,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    generators: Mapping[str, np.random.Generator] | None = None,
    restore_rng: bool = True,
) -> None:
    """Put a verified snapshot into the live objects."""
    state.apply_model(model, snap)
    if optimizer is not None:
        state.apply_optimizer(optimizer, snap)
    if scheduler is not None:
        state.apply_stateful("scheduler", scheduler, snap)
    if scaler is not None:
        state.apply_stateful("grad_scaler", scaler, snap)
    if sampler is not None:
        data = snap.contexts["data"]
        sampler.load_state_dict(data.get("loader", data))
    if restore_rng:
        rng.restore(snap.contexts["rng"], generators)


def load_checkpoint(ckpt: Checkpoint, **kwargs: Any) -> Restored:
    """Resume from an open checkpoint: read and verify every field, then compare and apply (see :func:`restore`)."""
    snap = state.read_snapshot(ckpt)  # everything read and verified before anything is applied
    return restore(snap, checkpoint_id=ckpt.id, url=ckpt.url, **kwargs)


def restore(
    snap: Snapshot,
    *,
    checkpoint_id: str,
    url: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    config: object = None,
    generators: Mapping[str, np.random.Generator] | None = None,
    on_mismatch: Policy = "warn",
    restore_rng: bool = True,
    skip_fields: Sequence[str] = (),
) -> Restored:
    """Compare a verified snapshot with the current run (``on_mismatch``), then apply it to the live objects.

    ``skip_fields`` (``rng``, ``data``, ``optimizer``) are left out of the apply.
    """
    mismatches = compare(snap, config=config, sampler=sampler)
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
        sampler=None if "data" in skip_fields else sampler,
        scheduler=scheduler,
        scaler=scaler,
        generators=generators,
        restore_rng=restore_rng and "rng" not in skip_fields,
    )
    step = snap.contexts["provenance"].get("step")
    return Restored(
        step=step if isinstance(step, int) else None, checkpoint_id=checkpoint_id, url=url, mismatches=tuple(mismatches)
    )


def load(url: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Restored:
    """Resume from one checkpoint: all fields read and verified, then applied together."""
    with open_checkpoint(url, storage_options) as ckpt:
        return load_checkpoint(ckpt, **kwargs)
