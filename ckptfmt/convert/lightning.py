"""PyTorch Lightning checkpoints (the ``.ckpt`` dict) into the training profile, and back.

A Lightning checkpoint is one ``torch.save`` of a dict: ``state_dict``, ``optimizer_states`` (one
state dict per optimizer), ``lr_schedulers``, ``loops`` (progress counters), ``callbacks``
(their state by key), ``epoch``, ``global_step``, ``hyper_parameters`` and whatever a module's
``on_save_checkpoint`` added. It is read with ``torch.load(weights_only=True)`` only.

=========================  ==========================================  =====================
Lightning key              field                                       how
=========================  ==========================================  =====================
``state_dict``             ``weights``                                 tensors by their names
``optimizer_states``       ``optimizer``                               as :mod:`ckptfmt.torch`
``hyper_parameters``       ``config``                                  when plain JSON values
``epoch``, ``loops``       ``data``                                    epoch and batch counters; the
                                                                       sample offset when the loader
                                                                       is a ``ResumableDataLoader``
everything else            ``lightning`` (+ ``lightning_tensors``)     losslessly encoded
=========================  ==========================================  =====================

Lightning records no RNG state, no topology and no sample offset (but for a stateful loader's own state:
that of ckptfmt's ``ResumableDataLoader`` is its global position); :mod:`ckptfmt.integrations.lightning`
fills ``rng`` and ``topology`` when it writes, and an import says what the file lacked. The
``lightning`` field keeps the rest of the dict in a small tagged encoding (tuples, non-string keys
and tensors marked), so :func:`to_checkpoint` gives Lightning back the dict it saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..canonical import config_hash
from ..errors import CheckpointError, SourceFormatError, UsageError
from ..fields import check_config
from . import torch_pt
from .base import ConvertResult, Location, NoProgress, Progress, fs_call, locate, refuse_existing
from .destination import check_name, write_output
from .optimizer import join_optimizers, split_optimizers
from .torch_files import save_torch
from .training import TrainingSource, field_source, training_importer

_TENSOR, _TUPLE, _ITEMS = "$tensor", "$tuple", "$items"
_SPLIT = ("state_dict", "optimizer_states")


@dataclass(slots=True)
class Fields:
    """A Lightning checkpoint split into ckptfmt fields, with where each came from and what was missing."""

    weights: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    optimizer_context: dict[str, Any] = field(default_factory=dict)
    contexts: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra_tensors: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, object] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


def encode(value: Any, tensors: dict[str, Any], where: str, seen: dict[tuple[object, ...], str] | None = None) -> Any:
    """A nested value as a context value: tensors go to ``tensors`` (named by number, a tensor met again
    under the same name: stored once), tuples and maps with non-string keys are tagged, so :func:`decode`
    rebuilds the same structure."""
    from .bounded import tensor_key
    from .torch_bridge import is_tensor

    seen = {} if seen is None else seen
    if is_tensor(value):
        key = tensor_key(value)
        if key is not None and key in seen:
            return {_TENSOR: seen[key]}
        name = str(len(tensors))
        tensors[name] = value
        if key is not None:
            seen[key] = name
        return {_TENSOR: name}
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.ndarray)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, tensors, f"{where}.{i}", seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{where}.{i}", seen) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, tensors, f"{where}.{k}", seen) for k, v in value.items()}
        return {
            _ITEMS: [
                [encode(k, tensors, where, seen), encode(v, tensors, f"{where}.{k}", seen)] for k, v in value.items()
            ]
        }
    from .torch_bridge import context_value

    return context_value(value, where)  # torch.Size, dtype, device: as list or string, else an error


def decode(value: Any, tensors: Mapping[str, Any]) -> Any:
    """The inverse of :func:`encode`; ``tensors`` are the numbered tensors, already torch tensors."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(decode(v, tensors) for v in value[_TUPLE])
        if set(value) == {_ITEMS}:
            return {_key(decode(k, tensors)): decode(v, tensors) for k, v in value[_ITEMS]}
        return {k: decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    return value


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # a tuple key comes back hashable


def split_checkpoint(checkpoint: object, url: str) -> Fields:
    """A loaded Lightning checkpoint dict as ckptfmt fields (``rng``/``topology``/``provenance`` left to the caller)."""
    from .torch_bridge import context_value, is_tensor

    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise SourceFormatError("not a Lightning checkpoint: no 'state_dict' dict at the top level", path=url)
    out = Fields()
    for name, tensor in checkpoint["state_dict"].items():
        if not is_tensor(tensor):
            raise SourceFormatError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor", path=url)
        out.weights[str(name)] = tensor
    out.sources["weights"] = field_source("", "state_dict")
    optimizers = checkpoint.get("optimizer_states") or []
    if not isinstance(optimizers, list):
        raise SourceFormatError("'optimizer_states' must be a list of optimizer state dicts", path=url)
    # one optimizer: the layout ckptfmt.torch uses, so either side can resume the other
    urls = [f"{url}: optimizer_states.{i}" for i in range(len(optimizers))]
    out.optimizer, out.optimizer_context = split_optimizers(optimizers, urls)
    if optimizers:
        out.sources["optimizer"] = field_source("", "optimizer_states")
    else:
        out.missing["optimizer"] = "no optimizer_states (saved with save_weights_only?)"
    rest = {k: v for k, v in checkpoint.items() if k not in _SPLIT}
    out.contexts["lightning"] = {"checkpoint": encode(rest, out.extra_tensors, url)}
    out.sources["lightning"] = field_source("", ", ".join(str(k) for k in rest))

    step = checkpoint.get("global_step")
    epoch = checkpoint.get("epoch")
    progress = _batch_progress(checkpoint.get("loops"))
    position = _loader_position(checkpoint.get("loops"))
    if position is not None:  # a ckptfmt ResumableDataLoader: its global position, as ckptfmt.torch saves it
        out.contexts["data"] = {**position, "lightning": {"global_step": step, **progress}}
        out.sources["data"] = field_source("", "loops.fit_loop.state_dict.combined_loader, global_step")
    else:
        out.contexts["data"] = {
            "epoch": epoch if type(epoch) is int and epoch >= 0 else 0,
            "global_sample_offset": 0,
            "sample_offset_known": False,
            "lightning": {"global_step": step, **progress},
        }
        out.sources["data"] = field_source("", "epoch, global_step, loops.fit_loop")
        out.missing["data"] = "no sample offset (Lightning counts batches, not samples): global_sample_offset is 0"

    hparams = checkpoint.get("hyper_parameters")
    config: dict[str, Any] = {}
    if isinstance(hparams, Mapping):
        try:
            config = {"hyper_parameters": context_value(hparams, f"{url}: hyper_parameters")}
            check_config({"config": config, "hash": config_hash(config)})
            out.sources["config"] = field_source("", "hyper_parameters")
        except (CheckpointError, TypeError, ValueError):  # not plain JSON: they stay in the lightning field
            config = {}
    if not config:
        out.missing["config"] = "no hyper_parameters as plain JSON values (they stay in the 'lightning' field)"
    out.contexts["config"] = {"config": config, "hash": config_hash(config)}
    return out


def _loader_position(loops: object) -> dict[str, Any] | None:
    """The data position Lightning saved for its one train loader when that loader is ckptfmt's
    ``ResumableDataLoader`` (a stateful loader: ``loops.fit_loop.state_dict.combined_loader``); None otherwise."""
    fit = loops.get("fit_loop") if isinstance(loops, Mapping) else None
    state = fit.get("state_dict") if isinstance(fit, Mapping) else None
    loaders = state.get("combined_loader") if isinstance(state, Mapping) else None
    if not (isinstance(loaders, list) and len(loaders) == 1 and isinstance(loaders[0], Mapping)):
        return None
    position = loaders[0]
    sampler = position.get("sampler")
    epoch, offset = position.get("epoch"), position.get("global_sample_offset")
    if not (isinstance(sampler, Mapping) and sampler.get("kind") == "ckptfmt.resumable"):
        return None
    if not (type(epoch) is int and epoch >= 0 and type(offset) is int and offset >= 0):
        return None
    return {str(k): v for k, v in position.items()}


def _batch_progress(loops: object) -> dict[str, object]:
    """Batches done in total and in the current epoch, from ``loops.fit_loop`` when present."""
    fit = loops.get("fit_loop") if isinstance(loops, Mapping) else None
    progress = fit.get("epoch_loop.batch_progress") if isinstance(fit, Mapping) else None
    if not isinstance(progress, Mapping):
        return {}
    total, current = progress.get("total"), progress.get("current")
    out: dict[str, object] = {}
    if isinstance(total, Mapping) and type(total.get("completed")) is int:
        out["batches_completed"] = total["completed"]
    if isinstance(current, Mapping) and type(current.get("completed")) is int:
        out["batches_completed_in_epoch"] = current["completed"]
    return out


def join_checkpoint(
    weights: Mapping[str, Any],
    optimizer: Mapping[str, Any],
    optimizer_context: Mapping[str, Any],
    lightning: Mapping[str, Any],
    extra_tensors: Mapping[str, Any],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The Lightning dict back from the fields (tensors as numpy arrays or torch tensors); ``aliases`` (the
    weights context's) name tensors stored once under another name, given back as that same tensor."""
    from ..arrays import to_torch

    def torch_of(value: Any) -> Any:
        return to_torch(value).clone() if isinstance(value, np.ndarray) else value

    rest = decode(lightning.get("checkpoint", {}), {k: torch_of(v) for k, v in extra_tensors.items()})
    if not isinstance(rest, dict):
        raise UsageError("the 'lightning' field does not hold a checkpoint map")
    out: dict[str, Any] = {k: v for k, v in rest.items() if k not in _SPLIT}
    out["state_dict"] = {k: torch_of(v) for k, v in weights.items()}
    for alias, target in (aliases or {}).items():
        if target not in out["state_dict"]:
            raise UsageError(f"weights alias {alias!r} names {target!r}, which is not a weight")
        out["state_dict"][alias] = out["state_dict"][target]
    out["optimizer_states"] = join_optimizers(optimizer, optimizer_context)
    return out


def to_checkpoint(ckpt: Any) -> dict[str, Any]:
    """Read an open ckptfmt checkpoint (every byte verified) back into the dict Lightning saved."""
    if "lightning" not in ckpt.fields:
        raise UsageError("the checkpoint has no 'lightning' field: it was not written from Lightning", path=ckpt.url)
    tensors = {n: ckpt.read_tensors(n) for n, rec in ckpt.fields.items() if rec.kind == "tensors"}
    return join_checkpoint(
        tensors.get("weights", {}),
        tensors.get("optimizer", {}),
        ckpt.read_context("optimizer") if ckpt.has_context("optimizer") else {},
        ckpt.read_context("lightning"),
        tensors.get("lightning_tensors", {}),
        _aliases(ckpt.read_context("weights") if ckpt.has_context("weights") else {}),
    )


def _aliases(context: Mapping[str, Any]) -> dict[str, str]:
    found = context.get("aliases") or {}
    if not isinstance(found, Mapping) or not all(isinstance(v, str) for v in found.values()):
        raise UsageError("the weights context's 'aliases' must map names to tensor names")
    return {str(k): v for k, v in found.items()}


def read_lightning(loc: Location) -> TrainingSource:
    """What a Lightning ``.ckpt`` file holds for each field, and where each came from."""
    if not fs_call(loc.url, loc.fs.isfile, loc.path):
        raise SourceFormatError("a Lightning checkpoint is a single .ckpt file", path=loc.url)
    fields = split_checkpoint(torch_pt.load(loc), loc.url)
    name = loc.url.rpartition("/")[2]
    for source in fields.sources.values():
        if isinstance(source, dict):
            source["file"] = name
    fields.missing["rng"] = "Lightning saves no RNG state (the ckptfmt CheckpointIO plugin records it)"
    fields.missing["topology"] = "Lightning saves no world size or devices: one process is assumed"
    step = fields.contexts["data"]["lightning"].get("global_step")
    return TrainingSource(
        weights=fields.weights,
        optimizer=fields.optimizer,
        optimizer_context=fields.optimizer_context,
        contexts={**fields.contexts, "rng": {"generators": {}}, "topology": {"world_size": 1}},
        extra_tensors={"lightning_tensors": fields.extra_tensors},
        sources=fields.sources,
        missing=fields.missing,
        step=step if type(step) is int else None,
    )


import_lightning = training_importer("lightning", "Lightning", read_lightning)
import_lightning.__doc__ = "Import a Lightning ``.ckpt`` file as a training-profile checkpoint."


def export_lightning(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write the ``.ckpt`` file Lightning saved (from a checkpoint that has the ``lightning`` field)."""
    import ckptfmt

    out = locate(dst, storage_options)
    parent = locate(dst.rstrip("/").rpartition("/")[0] or ".", storage_options)
    name = out.url.rpartition("/")[2]
    refuse_existing(parent, [check_name(parent, name)], overwrite)
    result = ConvertResult(source=src, source_format="ckptfmt", destination=out.url, destination_format="lightning")
    with ckptfmt.open(src, storage_options) as ckpt:
        checkpoint = to_checkpoint(ckpt)
    data = save_torch(checkpoint)
    write_output(parent, name, data)  # a symlink in place of the file is refused, never written through
    result.tensors = len(checkpoint["state_dict"])
    result.bytes = len(data)
    result.files = [out.url.rpartition("/")[2]]
    (progress or NoProgress()).start(0)
    return result
