"""What a trainer hands the manager to save or restore: a typed record of its live objects (:class:`TrainingState`),
and what the manager remembers between calls about the run it saves (:class:`Lineage`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .. import provenance as prov
from ..errors import UsageError
from . import api
from .api import Policy
from .state import HostBuffers, Snapshot


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint holds (as ``torch.distributed.checkpoint.stateful.Stateful``): a learning
    rate scheduler, a grad scaler, a data loader or sampler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingState:
    """The live objects of one training process, as a save captures them and a restore applies to them.

    ``sampler`` or ``loader`` holds the data position (at most one; neither: the manager's ``loader=``).
    ``generators``: named numpy generators whose state is saved beside torch's and Python's RNG.
    ``extra``: plain values saved as fields of their own. ``stateful``: any other objects with ``state_dict()`` and
    ``load_state_dict()`` (a DCP trainer's ``train_state``, say), each saved as a context field of its name and
    restored with the rest, all or nothing. ``mesh``: the parallelism mesh, by dimension name.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    config: object = None
    sampler: Stateful | None = None
    loader: Stateful | None = None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    generators: Mapping[str, np.random.Generator] | None = None
    extra: Mapping[str, object] | None = None
    stateful: Mapping[str, Stateful] | None = None
    mesh: Mapping[str, int] | None = None

    @classmethod
    def of(
        cls,
        state: TrainingState | None,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        config: object,
        sampler: Stateful | None,
        loader: Stateful | None,
        scheduler: Stateful | None,
        scaler: Stateful | None,
        generators: Mapping[str, np.random.Generator] | None,
        extra: Mapping[str, object] | None,
        mesh: Mapping[str, int] | None,
    ) -> TrainingState:
        """``state``, or the record the keyword arguments of a manager's method make (both, or neither, is an error)."""
        given = (model, optimizer, sampler, loader, scheduler, scaler, generators, extra, mesh)
        if state is not None:
            if config is not None or any(v is not None for v in given):
                raise UsageError("give the training state as a TrainingState or as keyword arguments, not both")
            return state
        if model is None:
            raise UsageError("the training state needs model=")
        return cls(
            model=model,
            optimizer=optimizer,
            config=config,
            sampler=sampler,
            loader=loader,
            scheduler=scheduler,
            scaler=scaler,
            generators=generators,
            extra=extra,
            mesh=mesh,
        )

    def with_loader(self, default: Stateful | None) -> TrainingState:
        """This state, with ``default`` as its data position when it names none."""
        if self.sampler is not None or self.loader is not None or default is None:
            return self
        return TrainingState(**{**self._fields(), "loader": default})

    def restore_targets(self) -> dict[str, Any]:
        """The live objects a restore applies a checkpoint to, by the names :func:`api.restore` and :func:`api.load`
        take them (``extra`` and ``mesh`` are saved, not applied)."""
        names = ("model", "optimizer", "sampler", "loader", "scheduler", "scaler", "stateful", "config", "generators")
        return {name: getattr(self, name) for name in names}

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True, kw_only=True)
class Lineage:
    """What the manager knows of the run it saves: the step of its last save or restore (did steps pass since?), the
    id of the newest checkpoint (a save's parent), the code's git state (looked up once), and how a data position
    that would repeat data is judged."""

    data_policy: Policy
    loader: Stateful | None = None  # the manager's default data position
    step: int | None = None
    last_checkpoint_id: str | None = None
    code: dict[str, object] = field(default_factory=dict)

    @classmethod
    def start(cls, *, data_policy: Policy, loader: Stateful | None) -> Lineage:
        return cls(data_policy=data_policy, loader=loader, code=prov.git_state() or {})

    def capture(self, step: int, state: TrainingState, *, defer: bool, buffers: HostBuffers | None = None) -> Snapshot:
        """The training state at ``step`` (the data position from its loader/sampler, else the manager's)."""
        optimizer = state.optimizer
        if optimizer is None:
            raise UsageError("a training checkpoint needs optimizer=")
        state = state.with_loader(self.loader)
        return api.capture(
            step=step,
            model=state.model,
            optimizer=optimizer,
            sampler=state.sampler,
            loader=state.loader,
            config=state.config,
            scheduler=state.scheduler,
            scaler=state.scaler,
            stateful=state.stateful,
            generators=state.generators,
            extra=state.extra,
            mesh=state.mesh,
            data_policy=self.data_policy,
            steps_passed=step > (self.step or 0),
            parent=self.last_checkpoint_id,
            buffers=buffers,
            code=self.code,
            defer=defer,
        )
