"""torchtitan's CheckpointManager with its DCP path going through ckptfmt's storage layer.

torchtitan 0.3.0 has no option for a storage writer: ``dcp_save`` and ``dcp_load``
(components/checkpointer/dcp.py:228, :330) call ``dcp.save``/``dcp.load`` with a ``checkpoint_id`` only.
This subclass passes ``ckptfmt.dcp.StorageWriter``/``StorageReader`` there instead, and teaches
``_find_load_step`` (dcp.py:640) that a step directory with a ``manifest.json`` is a committed checkpoint:
upstream accepts only DCP's ``.metadata`` or an HF index, so without it a resume silently starts fresh.
torchtitan's state goes out unmodified, its dataloader's pickled bytes included (stored as bytes, never
unpickled by ckptfmt).

Environment (read by the trainer processes):
- ``CKPTFMT_TITAN_STORAGE``: ``ckptfmt`` (default) or ``fs``, DCP's own FileSystemWriter/Reader passed the
  same way (the control).
- ``CKPTFMT_TITAN_KILL_AT_STEP``: SIGKILL the process right after that step's checkpoint is saved.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools import filesystem

import ckptfmt.dcp


def _use_ckptfmt() -> bool:
    storage = os.environ.get("CKPTFMT_TITAN_STORAGE", "ckptfmt")
    if storage not in ("ckptfmt", "fs"):
        raise ValueError(f"CKPTFMT_TITAN_STORAGE={storage!r}: expected 'ckptfmt' or 'fs'")
    return storage == "ckptfmt"


def _writer(path: str) -> dcp.StorageWriter:
    return ckptfmt.dcp.StorageWriter(path) if _use_ckptfmt() else dcp.FileSystemWriter(path)


def _reader(path: str) -> dcp.StorageReader:
    return ckptfmt.dcp.StorageReader(path) if _use_ckptfmt() else dcp.FileSystemReader(path)


class CkptfmtCheckpointManager(CheckpointManager):
    # torchtitan builds a component from its nested Config class (trainer.py:591 builds config.checkpoint)
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | Any | None:
        if to_hf:  # HF safetensors export keeps torchtitan's own writer
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, storage_writer=_writer(checkpoint_id), process_group=self.pg)
        if async_mode != AsyncMode.DISABLED:
            # the pinned-memory mode runs the save in another process: not tried with this writer yet
            raise NotImplementedError(f"checkpoint.async_mode={async_mode.value!r} is not wired in this example")
        dcp.save(state_dict, storage_writer=_writer(checkpoint_id))
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, storage_reader=_reader(checkpoint_id))
        # as upstream: the model's states are flattened into state_dict, so the model loads them itself
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        self.save_future = None

    def _find_load_step(self, folder: str = "") -> int:
        step = super()._find_load_step(folder)
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return step
        for name in filesystem.listdir(folder):
            number = name.removeprefix("step-")
            # manifest.json is written last, by the commit: a step without it was never committed
            if number.isdigit() and filesystem.isfile(filesystem.join(filesystem.join(folder, name), "manifest.json")):
                step = max(step, int(number))
        return step

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super().save(curr_step, last_step)
        if saved and curr_step == int(os.environ.get("CKPTFMT_TITAN_KILL_AT_STEP", "-1")):
            self.maybe_wait_for_saving()  # an async save must be committed before the crash
            os.kill(os.getpid(), signal.SIGKILL)
        return saved
