"""Accelerate: ``save_state`` / ``load_state`` of an ``Accelerator`` through a ckptfmt checkpoint.

    from ckptfmt.integrations.accelerate import load_state, save_state
    save_state(accelerator, "s3://bucket/run1/step-200", step=200, data={"epoch": 1, "global_sample_offset": 6400})
    data = load_state(accelerator, "s3://bucket/run1/step-200")   # -> the data field, to skip batches

Accelerate's own ``save_state`` writes the state (models, optimizers, schedulers, scaler, samplers,
RNG of every process) into a staging directory, and the main process imports it (see
:mod:`ckptfmt.convert.accelerate`) with what Accelerate does not track: the step, the data position,
the config and the topology. ``load_state`` verifies every byte, writes the staging directory back
and hands it to ``accelerator.load_state``, which restores the models, optimizers, schedulers and
every process's RNG. Accelerate leaves the data position to the loop (``skip_first_batches``), so
the ``data`` field is returned for it. The staging directory is local, shared by the processes of
one node (multi-node runs need ``staging`` on a shared file system).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from ..convert.accelerate import export_accelerate, import_accelerate


def _staging(accelerator: Any, staging: str | os.PathLike[str] | None) -> str:
    if staging is not None:
        return os.fspath(staging)
    from accelerate.utils import broadcast_object_list

    path = [tempfile.mkdtemp(prefix="ckptfmt-accelerate-") if accelerator.is_main_process else None]
    broadcast_object_list(path)  # every process writes its RNG file into the same directory
    return str(path[0])


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
    dataclass stored with its hash.
    """
    from ..torch import topology
    from ..torch.state import config_field

    directory = _staging(accelerator, staging)
    accelerator.save_state(directory)
    accelerator.wait_for_everyone()
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
        finally:
            if staging is None:
                shutil.rmtree(directory, ignore_errors=True)
    accelerator.wait_for_everyone()


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
    try:
        if accelerator.is_main_process:
            export_accelerate(os.fspath(url), directory, storage_options=storage_options, overwrite=True)
        accelerator.wait_for_everyone()
        accelerator.load_state(directory)
        accelerator.wait_for_everyone()
    finally:
        if staging is None and accelerator.is_main_process:
            shutil.rmtree(directory, ignore_errors=True)
    with ckptfmt.open(os.fspath(url), storage_options) as ckpt:
        out = dict(ckpt.read_context("data"))
        step = ckpt.read_context("provenance").get("step")
    if type(step) is int:
        out["step"] = step
    return out


__all__ = ["load_state", "save_state"]
