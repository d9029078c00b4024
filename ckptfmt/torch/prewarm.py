"""Import, while rendezvous is pending, what a restarted worker would otherwise import on its first steps.

A worker restarted by torchrun pays for its imports before its first step: ``import torch``, then, lazily,
``torch._dynamo`` on the first ``optimizer.step()`` (optimizers consult it), the distributed-checkpoint
state-dict helpers on the first restore, FSDP on wrapping: seconds each (docs/memory-tier.md, "Restart time").
:func:`prewarm` imports those on a background thread, so they overlap with rendezvous and the process
group's set-up instead of following them. ``import torch`` itself cannot be overlapped from Python code
that needs torch to run; it is the first line of any trainer.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger("ckptfmt")

MODULES = (
    "torch._dynamo",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.optim",
    "ckptfmt.torch.state",
    "ckptfmt.torch.read_state",
    "ckptfmt.tier",
)


def prewarm(modules: tuple[str, ...] = MODULES, *, background: bool = True) -> threading.Thread | None:
    """Import ``modules`` (those a training step and a restore import lazily); returns the thread doing it,
    or None when ``background=False`` (done on return). A module that fails to import is logged and skipped."""

    def run() -> None:
        started = time.perf_counter()
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a prewarm must never break the trainer: the real import will say why
                log.debug("prewarm: %s not imported: %s", name, exc)
        log.debug("prewarm: %d modules in %.2f s", len(modules), time.perf_counter() - started)

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name="ckptfmt-prewarm", daemon=True)
    thread.start()
    return thread
