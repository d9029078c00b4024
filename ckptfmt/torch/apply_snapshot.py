"""Applying a verified snapshot to the live objects, all or nothing.

:func:`apply` checks everything first (the fields the restore needs, :func:`missing_fields`; the weights' names and
shapes; the optimizer's class and groups; the data position's kind), then applies, the model last, and puts back
what it applied already if one of them still fails. :func:`ckptfmt.torch.api.restore` calls it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import optimizer_layout
from ..errors import ContextError, FieldNotFoundError, UsageError
from . import data_position, rng, state
from .snapshot import Snapshot

log = logging.getLogger("ckptfmt")


def missing_fields(
    snap: Snapshot,
    *,
    optimizer: object = None,
    sampler: object = None,
    scheduler: object = None,
    scaler: object = None,
    stateful: Mapping[str, object] | None = None,
    restore_rng: bool = True,
) -> list[str]:
    """The fields this restore needs that the checkpoint does not hold (e.g. a ``weights``-profile checkpoint)."""
    needed = [("weights", "tensors")]
    needed += [("optimizer", "tensors"), ("optimizer", "context")] if optimizer is not None else []
    needed += [("data", "context")] if sampler is not None else []
    needed += [("scheduler", "context")] if scheduler is not None else []
    needed += [("grad_scaler", "context")] if scaler is not None else []
    needed += [(name, "context") for name in stateful or {}]
    # a model-only load (e.g. of a weights-profile checkpoint) restores the RNG if there is one
    training = optimizer is not None or sampler is not None
    needed += [("rng", "context")] if restore_rng and training else []
    missing = []
    for name, kind in needed:
        where = snap.tensors if kind == "tensors" else snap.contexts
        if name not in where and name not in missing:
            missing.append(name)
    return missing


def _check_model(model: torch.nn.Module, snap: Snapshot) -> None:
    """Refuse, before anything is applied, weights that ``load_state_dict`` would only partly load."""
    tensors = snap.tensors["weights"]
    aliases = snap.contexts.get("weights", {}).get("aliases", {})
    if not isinstance(aliases, Mapping) or not all(isinstance(t, str) and t in tensors for t in aliases.values()):
        raise ContextError("'aliases' must map names to tensors of the field", field="weights")
    live = model.state_dict()
    stored = set(tensors) | set(aliases)
    absent, unexpected = sorted(set(live) - stored), sorted(stored - set(live))
    if absent or unexpected:
        raise UsageError(
            f"the checkpoint's weights do not fit the model: missing {absent[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in live.items():
        array = tensors[aliases.get(name, name)]
        if tuple(array.shape) != tuple(tensor.shape):
            raise UsageError(
                f"weight {name!r} has shape {list(array.shape)} in the checkpoint, {list(tensor.shape)} in the model"
            )


def _check_optimizer(optimizer: torch.optim.Optimizer, snap: Snapshot) -> None:
    context = snap.contexts["optimizer"]
    optimizer_layout.check_class(context, type(optimizer).__name__)
    groups = context.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        raise ContextError("'param_groups' must be a list of maps with 'params'", field="optimizer")
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise UsageError(f"the checkpoint's parameter groups have {sizes} parameters, the optimizer's differ")
    if state.optimizer_keys(snap) == "index":  # keyed by parameter name (fqn), any name is a parameter's
        for name in snap.tensors["optimizer"]:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
                raise ContextError(f"optimizer tensor {name!r} is not named state.<index>.<key>", field="optimizer")


def _rollback_point(
    *,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    stateful: Mapping[str, Any],
    generators: Mapping[str, np.random.Generator] | None,
) -> list[tuple[str, Any]]:
    """What to put back if applying fails half-way (the model is applied last, after every check)."""
    saved: list[tuple[str, Any]] = []
    # Not the data source: it is applied after all of these, and asking some loaders for their state has
    # side effects (a fresh torchdata StatefulDataLoader's state_dict() changes its next epoch's order).
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler), *stateful.items()):
        if obj is not None and hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            # load_state_dict gives an optimizer new state tensors and leaves the old ones alone: references
            # suffice there (no second copy of the optimizer state); the others are small.
            previous = obj.state_dict()
            saved.append((name, (obj, previous if name == "optimizer" else copy.deepcopy(previous))))
    saved.append(("rng", rng.capture(generators)))
    return saved


def _roll_back(saved: list[tuple[str, Any]], generators: Mapping[str, np.random.Generator] | None) -> None:
    for name, value in saved:
        try:
            if name == "rng":
                rng.restore(value, generators)
            else:
                obj, previous = value
                obj.load_state_dict(previous)
        except Exception:  # a rollback that fails must not hide the original error
            log.exception("could not put the previous %s state back", name)


def apply(
    snap: Snapshot,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    stateful: Mapping[str, Any] | None = None,
    generators: Mapping[str, np.random.Generator] | None = None,
    restore_rng: bool = True,
) -> None:
    """Put a verified snapshot into the live objects, all or nothing.

    Everything is checked first (fields present, weights' names and shapes, optimizer class and groups,
    the data position's kind); then the scheduler, scaler, other stateful objects, optimizer, RNG and data position
    are applied,
    and the model last. If one of them still fails, the ones already applied are put back.
    """
    missing = missing_fields(
        snap,
        optimizer=optimizer,
        sampler=sampler,
        scheduler=scheduler,
        scaler=scaler,
        stateful=stateful,
        restore_rng=restore_rng,
    )
    if missing:
        raise FieldNotFoundError(
            f"the checkpoint has no {', '.join(missing)} field(s), which this restore needs"
            " (a 'weights'-profile checkpoint holds weights only: load it with model= alone)"
        )
    restore_rng = restore_rng and "rng" in snap.contexts
    _check_model(model, snap)
    if optimizer is not None:
        _check_optimizer(optimizer, snap)
    if sampler is not None:
        data_position.check_restorable(sampler, snap.contexts["data"])
    stateful = dict(stateful or {})
    saved = _rollback_point(
        optimizer=optimizer, scheduler=scheduler, scaler=scaler, stateful=stateful, generators=generators
    )
    try:
        if scheduler is not None:
            state.apply_stateful("scheduler", scheduler, snap)
        if scaler is not None:
            state.apply_stateful("grad_scaler", scaler, snap)
        for name, obj in stateful.items():
            state.apply_stateful(name, obj, snap)
        if optimizer is not None:
            state.apply_optimizer(optimizer, snap, model)
        if restore_rng:
            rng.restore(snap.contexts["rng"], generators)
        if sampler is not None:
            data_position.restore_data(sampler, snap.contexts["data"])
        state.apply_model(model, snap)
        if snap.copy_in is not None:  # last: the bytes of tensors loaded in place (in_place.py)
            snap.copy_in()
    except BaseException:
        _roll_back(saved, generators)
        raise
