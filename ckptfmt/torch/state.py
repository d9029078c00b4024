"""Turning PyTorch training objects into ckptfmt fields and back.

A training state is captured into a :class:`Snapshot` (host-memory tensors plus context maps),
written by :func:`write_snapshot`, read back whole by :func:`read_snapshot` — every byte read and
verified before anything is applied — and only then applied to the live objects by
:func:`apply_snapshot`. So a corrupt checkpoint is refused before the model is touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..arrays import as_array
from ..canonical import config_hash, config_to_dict
from ..convert.torch_bridge import to_torch
from ..errors import ContextError, UsageError
from ..reader import Checkpoint
from ..writer import CheckpointWriter


@dataclass(slots=True)
class Snapshot:
    """Everything one checkpoint holds, in host memory: field -> tensors, field -> context.

    ``deferred`` lists tensors not copied yet (field, name, live tensor): parameters and optimizer
    state, which only ``optimizer.step()`` changes, so an async save may copy them while the next
    forward and backward run. :meth:`materialize` copies them.
    """

    tensors: dict[str, dict[str, np.ndarray[Any, Any]]] = field(default_factory=dict)
    contexts: dict[str, dict[str, Any]] = field(default_factory=dict)
    deferred: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)

    def materialize(self, buffers: HostBuffers) -> None:
        for fname, name, tensor in self.deferred:
            self.tensors[fname][name] = buffers.copy(f"{fname}/{name}", tensor)
        self.deferred.clear()


class HostBuffers:
    """Reusable host copies of device tensors, so repeated snapshots allocate nothing new."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
        t = tensor.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=False)
            self._buffers[key] = buf
        buf.copy_(t)
        return as_array(buf)[0]


def _host(key: str, tensor: torch.Tensor, buffers: HostBuffers | None) -> np.ndarray[Any, Any]:
    if buffers is not None:
        return buffers.copy(key, tensor)
    return as_array(tensor)[0]


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
    params = {p.data_ptr() for p in model.parameters()} if defer else set()
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        ident = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if tensor.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        if tensor.data_ptr() in params and tensor.numel():
            snap.deferred.append(("weights", name, tensor))
            tensors[name] = _NOT_YET
        else:
            tensors[name] = _host(f"weights/{name}", tensor, buffers)
    snap.tensors["weights"] = tensors
    snap.contexts["weights"] = {"aliases": aliases}


def apply_model(model: torch.nn.Module, snap: Snapshot, strict: bool = True) -> None:
    tensors = snap.tensors["weights"]
    aliases = snap.contexts.get("weights", {}).get("aliases", {})
    state: dict[str, torch.Tensor] = {name: to_torch(arr, _dtype_name(arr)) for name, arr in tensors.items()}
    for alias, target in aliases.items():
        state[alias] = state[target]
    model.load_state_dict(state, strict=strict)


def _dtype_name(array: np.ndarray[Any, Any]) -> str:
    return as_array(array)[1]


# ------------------------------------------------------------------ optimizer


def capture_optimizer(
    optimizer: torch.optim.Optimizer, snap: Snapshot, buffers: HostBuffers | None = None, *, defer: bool = False
) -> None:
    """Per-parameter state tensors as ``state.<param index>.<key>``; everything else as the field's context.

    With ``defer``, the state tensors are left for :meth:`Snapshot.materialize`.
    """
    state_dict = optimizer.state_dict()
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and defer:
                snap.deferred.append(("optimizer", f"state.{pid}.{key}", value))
                tensors[f"state.{pid}.{key}"] = _NOT_YET
            elif isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = _host(f"optimizer/{pid}/{key}", value, buffers)
            else:
                scalars.setdefault(str(pid), {})[key] = _plain(value, f"optimizer state {pid}.{key}")
    snap.tensors["optimizer"] = tensors
    snap.contexts["optimizer"] = {
        "class": type(optimizer).__name__,
        "param_groups": _plain(state_dict["param_groups"], "param_groups"),
        "scalars": scalars,
    }


def apply_optimizer(optimizer: torch.optim.Optimizer, snap: Snapshot) -> None:
    context = snap.contexts["optimizer"]
    if context.get("class") != type(optimizer).__name__:
        raise UsageError(f"checkpoint holds {context.get('class')} state, the optimizer is {type(optimizer).__name__}")
    state: dict[int, dict[str, Any]] = {}
    for name, array in snap.tensors["optimizer"].items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = to_torch(array, _dtype_name(array))
    for pid, entries in context.get("scalars", {}).items():
        # non-tensor state may hold tensors inside lists (LBFGS's history): they come back as tensors
        state.setdefault(int(pid), {}).update(_torchify(entries))
    optimizer.load_state_dict({"state": state, "param_groups": _groups(context["param_groups"])})


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # msgpack turns tuples (betas) into lists; torch's optimizers accept either, but keep them tuples
    return [{k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in g.items()} for g in groups]


# ------------------------------------------------------------------ anything with state_dict()


def capture_stateful(name: str, obj: Any, snap: Snapshot) -> None:
    """An LR scheduler, grad scaler, or any object with state_dict(), as a context field."""
    snap.contexts[name] = {"state": _plain(obj.state_dict(), name)}


def apply_stateful(name: str, obj: Any, snap: Snapshot) -> None:
    state = snap.contexts[name]["state"]
    obj.load_state_dict(_torchify(state))


def _torchify(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return to_torch(value, _dtype_name(value)).clone()
    if isinstance(value, dict):
        return {k: _torchify(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_torchify(v) for v in value]
    return value


# ------------------------------------------------------------------ config


def config_field(config: object) -> dict[str, Any]:
    as_dict = config_to_dict(config) if dataclasses.is_dataclass(config) or isinstance(config, Mapping) else None
    if as_dict is None:
        raise UsageError(f"config must be a dict or a dataclass instance, got {type(config).__name__}")
    return {"config": as_dict, "hash": config_hash(as_dict)}


# ------------------------------------------------------------------ I/O


def write_snapshot(writer: CheckpointWriter, snap: Snapshot) -> str:
    """Write every field of ``snap`` and commit; returns the checkpoint id."""
    if snap.deferred:
        raise UsageError("the snapshot has tensors not copied yet: call materialize() first")
    for name, tensors in snap.tensors.items():
        writer.write_tensors(name, tensors)
    for name, context in snap.contexts.items():
        writer.write_context(name, context)
    return writer.commit()


def read_snapshot(ckpt: Checkpoint) -> Snapshot:
    """Every field, every byte read and digest-checked, before anything is applied anywhere."""
    snap = Snapshot()
    for name, record in ckpt.fields.items():
        if record.kind == "tensors":
            snap.tensors[name] = ckpt.read_tensors(name)
        if record.context is not None:
            snap.contexts[name] = ckpt.read_context(name)
    return snap
