"""How the manager makes a save: an engine behind one small protocol, chosen once, at construction.

Two engines implement :class:`SaveEngine`:

- :class:`~ckptfmt.torch.durable.DurableEngine` writes into the run directory: at once (sync), from host copies
  made by a background thread (``async_save``), referencing the previous save's unchanged chunks (``incremental``);
- :class:`~ckptfmt.torch.memory_engine.MemoryEngine` writes into a slot of node memory every ``memory_every``
  steps and persists it from there (``memory_every``, ``replicate``).

Call sequence (the manager drives it, every rank together)::

    due = engine.due(step, every=100, preempted=False)
    if due.write:
        engine.save(step, state, persist=due.durable)   # may return before the bytes are written
    engine.raise_background_error()                      # a failure in the background, raised on the next call
    engine.wait()                                        # every save made so far is durable
    engine.close(persist=True)
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Protocol

import torch

from .training_state import TrainingState


class Due(NamedTuple):
    """Whether ``checkpoint_if_due`` writes at a step (``write``), and whether what it writes becomes durable then
    (``durable``: the value ``checkpoint_if_due`` returns)."""

    write: bool
    durable: bool


class SaveEngine(Protocol):
    """One way of making saves (see the module docstring for the call sequence)."""

    @property
    def held_seconds(self) -> float:
        """Total time ``optimizer.step()`` waited for a save's copy of the state."""
        ...

    def due(self, step: int, *, every: int, preempted: bool) -> Due: ...

    def save(self, step: int, state: TrainingState, *, persist: bool) -> None:
        """Save ``state`` at ``step``; with ``persist`` it is (or becomes, in the background) durable."""
        ...

    def wait(self) -> str | None:
        """Block until every save made so far is durable; its checkpoint id (None: nothing saved); raise a failure."""
        ...

    def raise_background_error(self) -> None: ...

    def protected(self) -> set[str]:
        """Names in the run directory a gc must not delete now (a save in flight)."""
        ...

    def close(self, *, persist: bool) -> None: ...


class StepGate:
    """An optimizer step pre-hook that holds the next ``optimizer.step()`` until a save's copy of parameters and
    optimizer state is taken (:meth:`open`), counting how long it held."""

    def __init__(self) -> None:
        self.copied = threading.Event()
        self.copied.set()
        self.held_seconds = 0.0
        self._handle: Any = None
        self._optimizer: torch.optim.Optimizer | None = None

    def close_on(self, optimizer: torch.optim.Optimizer) -> None:
        """Hold ``optimizer``'s next step until :meth:`open` (the hook is registered once per optimizer)."""
        self.copied.clear()
        if self._optimizer is optimizer:
            return
        self.remove()

        def hold_step(opt: object, args: object, kwargs: object) -> None:
            if not self.copied.is_set():
                start = time.perf_counter()
                self.copied.wait()
                self.held_seconds += time.perf_counter() - start

        self._handle = optimizer.register_step_pre_hook(hold_step)
        self._optimizer = optimizer

    def open(self) -> None:
        self.copied.set()

    def remove(self) -> None:
        """Unregister the hook (on the trainer's thread, never while ``step()`` runs)."""
        if self._handle is not None:
            self._handle.remove()
        self._handle = None
        self._optimizer = None
