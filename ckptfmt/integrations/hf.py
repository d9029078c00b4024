"""Hugging Face ``Trainer``: a ckptfmt checkpoint at every save, and a resume from one.

    from ckptfmt.integrations.hf import CkptfmtCallback, prepare_resume
    trainer = Trainer(..., callbacks=[CkptfmtCallback("s3://bucket/run1")])
    trainer.train()                                   # checkpoint-N/ -> s3://bucket/run1/checkpoint-N
    trainer.train(resume_from_checkpoint=prepare_resume("s3://bucket/run1/checkpoint-500"))

The callback runs after each Trainer save (``on_save``) and imports the ``checkpoint-N/``
directory the Trainer has just written (see :mod:`ckptfmt.convert.hf_trainer`): the Trainer's own
save stays the authority on what its resume needs, and the copy is one verifiable, pickle-free
training checkpoint with all seven fields. ``keep_hf_checkpoint=False`` deletes the Trainer's
directory once the ckptfmt one is committed.

The Trainer resumes only from its own directory layout, so :func:`prepare_resume` writes one from
the ckptfmt checkpoint (``ckpt convert URL DIR --to hf-trainer``): every byte verified on the way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback

from ..convert.hf_trainer import export_hf_trainer, import_hf_trainer


class CkptfmtCallback(TrainerCallback):  # type: ignore[misc]
    """Write ``<root>/checkpoint-<step>`` (a ckptfmt checkpoint) after each Trainer save.

    ``root`` is a local path or any fsspec URL (default: ``<output_dir>/ckptfmt``). Only the main
    process writes, after every process has saved (the Trainer's ``on_save`` follows its barrier),
    so per-process RNG files are all there.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        keep_hf_checkpoint: bool = True,
    ) -> None:
        self.root = os.fspath(root) if root is not None else None
        self.storage_options = dict(storage_options or {})
        self.keep_hf_checkpoint = keep_hf_checkpoint
        self.written: list[str] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        name = f"checkpoint-{state.global_step}"
        source = os.path.join(args.output_dir, name)
        root = self.root if self.root is not None else os.path.join(args.output_dir, "ckptfmt")
        url = f"{root.rstrip('/')}/{name}"
        import_hf_trainer(source, url, storage_options=self.storage_options, overwrite=True)
        self.written.append(url)
        if not self.keep_hf_checkpoint:
            shutil.rmtree(source)


def prepare_resume(
    url: str | os.PathLike[str],
    directory: str | os.PathLike[str] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write the Trainer directory for ``url`` (into ``directory``, or a new temporary one) and return its path,
    for ``trainer.train(resume_from_checkpoint=...)``."""
    out = os.fspath(directory) if directory is not None else tempfile.mkdtemp(prefix="ckptfmt-resume-")
    export_hf_trainer(os.fspath(url), out, storage_options=storage_options, overwrite=True)
    return out


__all__ = ["CkptfmtCallback", "prepare_resume"]
