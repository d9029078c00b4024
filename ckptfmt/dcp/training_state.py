"""A DCP trainer's state dict as the manager's :class:`~ckptfmt.torch.TrainingState`: what lets a trainer that saves
through ``dcp.save`` take memory snapshots, guarded roll-backs and heals from :class:`~ckptfmt.torch.CheckpointManager`
with the state dict it already builds.

    states = {"model": ModelWrapper(model), "optimizer": optimizers, "lr_scheduler": schedulers,
              "dataloader": loader, "train_state": train_state}
    state = ckptfmt.dcp.training_state(states, model=model, optimizer=optimizer, config=cfg)
    mgr.checkpoint_if_due(step, state=state)

DCP's state dict holds *copies of references*: its tensors are the model's and the optimizer's own, which only the
live objects can take back in place (and which the manager captures, keyed by parameter name, DTensor shards and
all). So the model and the optimizer are given, and every entry of ``states`` must be one of:

- the model, the optimizer, or a mapping or ``Stateful`` whose tensors are all theirs, or that is an optimizer's
  state dict (it has ``param_groups``): ``get_state_dict``'s dicts, torchtitan's ``ModelWrapper`` and
  ``OptimizersContainer``; saved through the model and the optimizer;
- the data loader, under ``data`` (default ``"dataloader"``): the ``data`` field;
- any other ``Stateful`` (a scheduler, a ``train_state``): a context field of its key, restored by its
  ``load_state_dict``;
- a mapping of plain values (``{"step": 7}``): a context field of its key, restored into the same dict in place,
  as ``dcp.load`` does.

Anything else is refused, naming its key, before anything is saved: a tensor that is not the model's or the
optimizer's (the manager could not put it back), or a bare value that no restore can change in place.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from ..torch.training_state import Stateful, TrainingState


class _DictState:
    """A mapping of plain values, saved as it is and restored into the same mapping (cleared, then updated)."""

    def __init__(self, values: MutableMapping[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.values))

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.values.clear()
        self.values.update(state_dict)


def training_state(
    states: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: object = None,
    data: str | None = "dataloader",
    generators: Mapping[str, np.random.Generator] | None = None,
    mesh: Mapping[str, int] | None = None,
) -> TrainingState:
    """The :class:`TrainingState` of a DCP state dict (module doc). Build it once and pass it to every call: it
    reads each entry's ``state_dict()`` to tell the model's and optimizer's entries from the others."""
    own = _own_storages(model, optimizer)
    loader: Stateful | None = None
    stateful: dict[str, Stateful] = {}
    for key, value in states.items():
        if value is model or value is optimizer:
            continue
        if key == data:  # not asked for its state here: a fresh torchdata loader's state_dict() reshuffles its epoch
            if not isinstance(value, Stateful):
                raise UsageError(f"DCP state entry {key!r} is the data position but has no state_dict()")
            loader = value
            continue
        content = value.state_dict() if isinstance(value, Stateful) else value
        tensors = list(_tensors(content))
        if tensors or _is_optimizer_state(content):  # an optimizer's holds no tensor before its first step
            foreign = [name for name, t in tensors if _storage(t) not in own]
            if foreign:
                raise UsageError(
                    f"DCP state entry {key!r} holds tensors that are not the model's or the optimizer's "
                    f"({', '.join(foreign[:3])}): the manager restores tensors through those two only",
                    tensor=f"{key}.{foreign[0]}",
                )
            continue  # the model's or the optimizer's state, saved through them
        if isinstance(value, Stateful):
            stateful[key] = value
        elif isinstance(value, MutableMapping):
            stateful[key] = _DictState(value)
        else:
            raise UsageError(
                f"DCP state entry {key!r} is a {type(value).__name__}: a restore cannot change it in place; "
                "keep it in a dict or a Stateful"
            )
    return TrainingState(
        model=model,
        optimizer=optimizer,
        config=config,
        loader=loader,
        stateful=stateful,
        generators=generators,
        mesh=mesh,
    )


def _is_optimizer_state(content: object) -> bool:
    """An optimizer's state dict, as DCP's ``get_optimizer_state_dict`` gives it or flattened (torchtitan's)."""
    return isinstance(content, Mapping) and any(str(k).split(".")[0] == "param_groups" for k in content)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()


def _own_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages of the model's parameters and buffers and of the optimizer's state tensors."""
    own = {_storage(t) for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
    for entry in optimizer.state.values():
        own.update(_storage(t) for t in entry.values() if isinstance(t, torch.Tensor))
    own.discard(0)  # an empty tensor's storage has no address
    return own


def _tensors(value: object, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state dict that holds elements on this rank, with its dotted path."""
    if isinstance(value, torch.Tensor):
        if _local(value).numel():  # a rank's empty shard of a DTensor has no storage to match
            yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{where}.{index}" if where else str(index))
