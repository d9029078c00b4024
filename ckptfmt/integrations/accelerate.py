"""Accelerate: ``save_state`` / ``load_state`` of an ``Accelerator`` through a ckptfmt checkpoint.

    from ckptfmt.integrations.accelerate import load_state, save_state
    save_state(accelerator, "s3://bucket/run1/step-200", step=200, data={"epoch": 1, "global_sample_offset": 6400})
    data = load_state(accelerator, "s3://bucket/run1/step-200")   # -> the data field, to skip batches

Accelerate's own ``save_state`` writes the state (models, optimizers, schedulers, scaler, samplers,
RNG of every process) into a staging directory of each process's own, on its local disk; every other
process sends the main process the one file it owns there (``random_states_<index>.pkl``, over
``torch.distributed``), and the main process imports the whole (see :mod:`ckptfmt.convert.accelerate`)
with what Accelerate does not track: the step, the data position, the config and the topology.
``load_state`` has every process read and verify the checkpoint into a staging directory of its own
and hand it to ``accelerator.load_state``, which restores the models, optimizers, schedulers and this
process's RNG. No process touches another's staging directory, so processes on nodes with different
local disks save and load alike; ``url`` is read by every process (shared storage). Accelerate leaves
the data position to the loop (``skip_first_batches``), so the ``data`` field is returned for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from ..convert.accelerate import export_accelerate, import_accelerate
from ..errors import CollectiveError

_RNG_FILE = "random_states_{}.pkl"  # what Accelerate's save_state writes on process <index>


def _staging(accelerator: Any, staging: str | os.PathLike[str] | None) -> str:
    """This process's own staging directory: a new temporary one (its local disk), else ``process-<index>``
    under ``staging`` (so that processes given one shared path never write into each other's)."""
    if staging is None:
        return tempfile.mkdtemp(prefix="ckptfmt-accelerate-")
    path = os.path.join(os.fspath(staging), f"process-{accelerator.process_index}")
    os.makedirs(path, exist_ok=True)
    return path


def _collect_rng_files(accelerator: Any, directory: str) -> None:
    """Every process's ``random_states_<index>.pkl`` (the file ``save_state`` writes per process) into the main
    process's ``directory``, sent as bytes over ``torch.distributed``; every process calls it."""
    from ..torch.collective import default_collective

    collective = default_collective()
    if collective is None:
        return
    path = os.path.join(directory, _RNG_FILE.format(collective.rank))
    data = b""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            data = f.read()
    gathered = collective.gather(data, dst=0)
    for rank, blob in enumerate(gathered or []):
        if rank and blob:
            with open(os.path.join(directory, _RNG_FILE.format(rank)), "wb") as f:
                f.write(blob)


def save_state(
    accelerator: Any,
    url: str | os.PathLike[str],
    *,
    step: int | None = None,
    data: Mapping[str, object] | None = None,
    config: object = None,
    storage_options: Mapping[str, Any] | None = None,
    staging: str | os.PathLike[str] | None = None,
) -> None:
    """Save the accelerator's full state as one committed ckptfmt checkpoint at ``url`` (call on every process).

    ``data`` is the ``data`` field (``epoch`` and ``global_sample_offset`` at least); ``config`` a dict or
    dataclass stored with its hash. ``staging``: a directory under which each process stages in
    ``process-<index>/`` and leaves it there (default: a temporary directory, removed).
    """
    from ..torch import topology
    from ..torch.state import config_field

    directory = _staging(accelerator, staging)
    failure: BaseException | None = None
    try:
        accelerator.save_state(directory)
        _collect_rng_files(accelerator, directory)
        if accelerator.is_main_process:
            known: dict[str, Mapping[str, object]] = {"topology": topology()}
            if data is not None:
                known["data"] = dict(data)
            if config is not None:
                known["config"] = config_field(config)
            try:
                import_accelerate(
                    directory, os.fspath(url), storage_options=storage_options, overwrite=True, known=known, step=step
                )
            except BaseException as exc:
                failure = exc
    finally:
        if staging is None:
            shutil.rmtree(directory, ignore_errors=True)
    _share_outcome(failure)
    if failure is not None:
        raise failure
    accelerator.wait_for_everyone()


def _share_outcome(failure: BaseException | None) -> None:
    """The main process tells the others whether it committed the checkpoint; they raise if it did not. Without
    this they waited in the last barrier for a main process that had raised, until the job's timeout."""
    from ..torch.collective import default_collective

    collective = default_collective()
    if collective is None:
        return
    if collective.rank == 0:
        collective.broadcast(b"" if failure is None else f"{type(failure).__name__}: {failure}".encode(), src=0)
        return
    message = collective.broadcast(None, src=0)
    if message:
        raise CollectiveError(f"the main process did not save the checkpoint: {message.decode(errors='replace')}")


def load_state(
    accelerator: Any,
    url: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    staging: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Restore the accelerator's state from ``url`` (call on every process, after ``prepare``); returns the
    checkpoint's ``data`` field, with ``step`` added from its provenance."""
    import ckptfmt

    directory = _staging(accelerator, staging)
    try:  # every process reads (and verifies) the checkpoint into its own directory
        export_accelerate(os.fspath(url), directory, storage_options=storage_options, overwrite=True)
        accelerator.load_state(directory)
    finally:
        if staging is None:
            shutil.rmtree(directory, ignore_errors=True)
    accelerator.wait_for_everyone()
    with ckptfmt.open(os.fspath(url), storage_options) as ckpt:
        out = dict(ckpt.read_context("data"))
        step = ckpt.read_context("provenance").get("step")
    if type(step) is int:
        out["step"] = step
    return out


__all__ = ["load_state", "save_state"]
