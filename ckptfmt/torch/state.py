"""Turning PyTorch training objects into ckptfmt fields and back.

A training state is captured into a :class:`~ckptfmt.torch.snapshot.Snapshot` (host-memory tensors plus context
maps) by :func:`capture_model`, :func:`capture_optimizer` and :func:`capture_stateful`, written by
:func:`ckptfmt.torch.write_state.write_snapshot`, read back whole by
:func:`ckptfmt.torch.read_state.read_snapshot` — every byte read and verified before anything is applied — and only
then applied to the live objects by :func:`apply_model`, :func:`apply_optimizer` and :func:`apply_stateful`
(:func:`ckptfmt.torch.apply_snapshot.apply` calls them). So a corrupt checkpoint is refused before the model is
touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import optimizer_layout, paths
from ..arrays import as_array, to_torch, torchify
from ..canonical import config_hash, config_to_dict
from ..errors import ContextError, UsageError
from .in_place import Checked
from .sharding import LocalShard, TargetShard, is_dtensor, to_target

# Snapshot, HostBuffers and Source (snapshot.py) and the writing (write_state.py) are re-exported here, where
# they lived before: `from ckptfmt.torch.state import Snapshot, write_snapshot` keeps working.
from .snapshot import HostBuffers, Snapshot, Source, Stored, _host, _local, _source
from .write_state import stage_snapshot, write_snapshot

__all__ = [
    "HostBuffers",
    "Snapshot",
    "Source",
    "Stored",
    "apply_model",
    "apply_optimizer",
    "apply_stateful",
    "capture_model",
    "capture_optimizer",
    "capture_stateful",
    "config_field",
    "optimizer_keys",
    "stage_snapshot",
    "stored_param_names",
    "write_snapshot",
]


def _to_torch(value: Stored) -> Any:
    """A stored value as what ``load_state_dict`` takes: a tensor, or a DTensor placed like its target."""
    if isinstance(value, TargetShard):
        return to_target(to_torch(value.array), value.like)
    if isinstance(value, Checked):
        return value.live  # loaded into itself (nothing copied); its bytes arrive with Snapshot.copy_in
    if isinstance(value, LocalShard):
        raise UsageError("a rank's own shard cannot be applied without its target placement")
    return to_torch(value)


def _plain(value: Any, where: str) -> Any:
    """A context-safe copy of a non-tensor value (tensors become numpy arrays)."""
    if isinstance(value, torch.Tensor):
        return as_array(value)[0].copy()
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ContextError(f"{where}: a {type(value).__name__} cannot be stored in a checkpoint")


# ------------------------------------------------------------------ model


_NOT_YET: np.ndarray[Any, Any] = np.empty(0)  # the place of a deferred tensor, keeping write order


def capture_model(
    model: torch.nn.Module, snap: Snapshot, buffers: HostBuffers | None = None, *, defer: bool = False
) -> None:
    """Model state into ``weights``; a tensor shared under several names (tied weights) is stored once.

    With ``defer``, parameters are left for :meth:`Snapshot.materialize`; buffers (e.g. batch-norm
    statistics, which the next forward pass updates) are copied now.
    """
    params = {_local(p).data_ptr(): p for p in model.parameters()} if defer else {}
    tensors: dict[str, Stored] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        ident = (
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            tuple(tensor.shape),
            local.stride(),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        if local.data_ptr() in params and local.numel():
            snap.deferred.append(("weights", name, tensor))
            snap.sources.append(_source("weights", name, params[local.data_ptr()], tensor))
            tensors[name] = _NOT_YET
        else:
            tensors[name] = _host(f"weights/{name}", tensor, buffers)
    snap.tensors["weights"] = tensors
    snap.contexts["weights"] = {"aliases": aliases}


def apply_model(model: torch.nn.Module, snap: Snapshot, strict: bool = True) -> None:
    tensors = snap.tensors["weights"]
    aliases = snap.contexts.get("weights", {}).get("aliases", {})
    state: dict[str, torch.Tensor] = {name: _to_torch(value) for name, value in tensors.items()}
    live = model.state_dict(keep_vars=True)
    for alias, target in aliases.items():
        # a stored tensor filled in place fills its aliases' own tensors too (read_snapshot): each loads into itself
        checked = isinstance(tensors.get(target), Checked) and alias in live
        state[alias] = live[alias] if checked else state[target]
    model.load_state_dict(state, strict=strict)


# ------------------------------------------------------------------ optimizer


def capture_optimizer(
    optimizer: torch.optim.Optimizer,
    snap: Snapshot,
    buffers: HostBuffers | None = None,
    *,
    defer: bool = False,
    model: torch.nn.Module | None = None,
) -> None:
    """Per-parameter state tensors as ``<parameter name>/<key>`` (``state.<index>.<key>`` without ``model``);
    everything else as the field's context.

    Keyed by parameter name (FQN), optimizer state survives a change of parallelism: FSDP or tensor
    parallel moments are DTensors sharded like their parameters, saved as this rank's shards.
    With ``defer``, the state tensors are left for :meth:`Snapshot.materialize`.
    """
    if model is None:
        state_dict: dict[str, Any] = optimizer.state_dict()
        keyed = optimizer_layout.INDEX
    elif any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state_dict = dict(get_optimizer_state_dict(model, optimizer))  # FQN-keyed, DTensor state as is
        keyed = optimizer_layout.FQN
    else:
        state_dict = _by_name(optimizer.state_dict(), _param_names(model, optimizer))
        keyed = optimizer_layout.FQN

    def stored(name: str, tensor: torch.Tensor) -> Stored:
        if defer:
            # detached, as the model's state_dict gives parameters: a later ``.data = x`` on the live tensor leaves
            # the captured storage to the copy
            captured = tensor.detach()
            snap.deferred.append(("optimizer", name, captured))
            snap.sources.append(_source("optimizer", name, tensor, captured))
            return _NOT_YET
        return _host(f"optimizer/{name}", tensor, buffers)

    tensors, scalars = optimizer_layout.split_state(
        state_dict["state"],
        keyed,
        is_tensor=lambda value: isinstance(value, torch.Tensor),
        tensor=stored,
        value=lambda value, where: _plain(value, f"optimizer state {where}"),
    )
    snap.tensors["optimizer"] = tensors
    snap.contexts["optimizer"] = optimizer_layout.context(
        keys=keyed,
        param_groups=_plain(state_dict["param_groups"], "param_groups"),
        scalars=scalars,
        cls=type(optimizer).__name__,
    )


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer`` in its state_dict's index order (a tied parameter:
    its first name, as ``named_parameters`` gives it)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise UsageError("the optimizer holds a parameter that is not the model's: pass the model it trains")
            out.append(name)
    return out


def stored_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names a save records for the optimizer's parameters (in its index order)."""
    names = _param_names(model, optimizer)
    if any(is_dtensor(p) for p in model.parameters()):  # saved through get_optimizer_state_dict
        names = [_dcp_fqn(name) for name in names]
    return names


_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _dcp_fqn(name: str) -> str:
    """A parameter's name as torch's get_optimizer_state_dict keys it (what a DTensor model's save records): without
    the segments that torch.compile, FSDP and activation checkpointing wrap modules in."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _by_name(state_dict: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state_dict keyed by parameter index, re-keyed by parameter name."""
    return {
        "state": {names[int(i)]: entry for i, entry in state_dict["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]],
    }


def _by_index(state_dict: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_by_name` for the optimizer whose parameters are ``names``."""
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for g in state_dict["param_groups"] for n in g["params"] if n not in index]
    unknown += [n for n in state_dict["state"] if n not in index]
    if unknown:
        raise UsageError(f"the checkpoint has optimizer state for parameters the model lacks: {sorted(unknown)[:5]}")
    return {
        "state": {index[n]: entry for n, entry in state_dict["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state_dict["param_groups"]],
    }


def optimizer_keys(snap: Snapshot) -> str:
    """How the snapshot's optimizer tensors are named: ``fqn`` (``<param>/<key>``) or ``index`` (older saves)."""
    return optimizer_layout.key_scheme(snap.contexts.get("optimizer", {}))


def apply_optimizer(optimizer: torch.optim.Optimizer, snap: Snapshot, model: torch.nn.Module | None = None) -> None:
    context = snap.contexts["optimizer"]
    optimizer_layout.check_class(context, type(optimizer).__name__)
    stored = optimizer_layout.join_state(snap.tensors["optimizer"], context, _to_torch)
    groups = optimizer_layout.param_groups(context["param_groups"])
    if optimizer_keys(snap) == optimizer_layout.FQN:
        if model is None:
            raise UsageError("optimizer state keyed by parameter name needs the model to restore it")
        loaded: dict[str, Any] = {"state": stored, "param_groups": groups}
        # By index, DTensor state included (it is placed like its parameter already): torch's
        # set_optimizer_state_dict first gives an optimizer without state its whole state by a step on zero
        # gradients, memory that the load then throws away.
        optimizer.load_state_dict(_by_index(loaded, stored_param_names(model, optimizer)))
        return
    optimizer.load_state_dict({"state": {int(pid): entries for pid, entries in stored.items()}, "param_groups": groups})


# ------------------------------------------------------------------ anything with state_dict()


def capture_stateful(name: str, obj: Any, snap: Snapshot) -> None:
    """An LR scheduler, grad scaler, or any object with state_dict(), as a context field."""
    snap.contexts[name] = {"state": _plain(obj.state_dict(), name)}


def check_stateful_name(name: str, *, taken: set[str]) -> None:
    """A stateful object's field name: a valid field name (spec/manifest.md, MAN-20) not taken by another field."""
    if not isinstance(name, str) or not paths.is_field_name(name):
        raise UsageError(f"stateful object {name!r}: its name is not a field name ([a-z][a-z0-9_]{{0,63}}, MAN-20)")
    if name in taken:
        raise UsageError(f"stateful object {name!r} collides with another field of that name")


def apply_stateful(name: str, obj: Any, snap: Snapshot) -> None:
    state = snap.contexts[name]["state"]
    obj.load_state_dict(torchify(state))


# ------------------------------------------------------------------ config


def config_field(config: object) -> dict[str, Any]:
    as_dict = config_to_dict(config) if dataclasses.is_dataclass(config) or isinstance(config, Mapping) else None
    if as_dict is None:
        raise UsageError(f"config must be a dict or a dataclass instance, got {type(config).__name__}")
    return {"config": as_dict, "hash": config_hash(as_dict)}
