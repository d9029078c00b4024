"""PyTorch Lightning: save and resume through ckptfmt with a ``CheckpointIO`` plugin.

    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO
    trainer = Trainer(plugins=[CkptfmtCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, loader)                      # each save: a ckptfmt checkpoint directory
    trainer.fit(model, loader, ckpt_path=path)      # resume: read, verify, then restore

Every path Lightning hands the plugin (``epoch=1-step=8.ckpt``) becomes a committed ckptfmt
checkpoint *directory* of that name: ``state_dict`` as ``weights``, ``optimizer_states`` as
``optimizer``, the rest of Lightning's dict losslessly in ``lightning`` (see
:mod:`ckptfmt.convert.lightning`), plus what Lightning does not save itself: every RNG the step
used (``rng``, restored on load unless ``restore_rng=False``), the topology and provenance.

Lightning calls a ``CheckpointIO`` on rank 0 only, so on more than one rank the plugin's
``rng_callback`` must be among the Trainer's callbacks: it gathers every rank's generators while
Lightning builds the checkpoint (on every rank) and hands them to the plugin; each rank restores its own
on resume. Without it a multi-rank save is refused rather than written with rank 0's generators alone::

    io = CkptfmtCheckpointIO()
    trainer = Trainer(strategy="ddp", plugins=[io], callbacks=[io.rng_callback, ModelCheckpoint(...)])

Loading reads and verifies every byte before returning, so a corrupt checkpoint fails before
Lightning touches the model. Subclasses the ``CheckpointIO`` of ``pytorch_lightning`` (tested), or of
``lightning.pytorch`` when only that is installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import provenance as prov
from ..convert.lightning import split_checkpoint, to_checkpoint
from ..errors import UsageError

try:  # pytorch_lightning's base classes (the package the tests pin), else the unified lightning package's
    from lightning_fabric.plugins import CheckpointIO
    from pytorch_lightning import Callback
except ImportError:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch import Callback

_RANKS_RNG = "ckptfmt.rng"  # the checkpoint dict's key for every rank's generators, from the callback to rank 0


class RankRngCallback(Callback):  # type: ignore[misc]
    """Gathers every rank's generators into the checkpoint dict rank 0's :class:`CkptfmtCheckpointIO` writes.

    ``on_save_checkpoint`` runs on every rank while Lightning builds a (full) checkpoint: a collective.
    """

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        from ..torch import rng
        from ..torch.collective import default_collective

        field = rng.gather(rng.capture(), default_collective())
        if field is not None:
            checkpoint[_RANKS_RNG] = field


class CkptfmtCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` writing and reading ckptfmt checkpoints (training profile).

    ``storage_options`` go to fsspec (``s3://`` paths and the like); ``restore_rng`` puts Python's,
    numpy's and torch's generators back as they were at the save, so the data order and dropout
    masks after a resume match an uninterrupted run; ``config`` (a dict or dataclass) replaces the
    hyper-parameters as the ``config`` field when given.
    """

    def __init__(
        self,
        *,
        storage_options: Mapping[str, Any] | None = None,
        restore_rng: bool = True,
        config: object = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.restore_rng = restore_rng
        self.config = config
        self.rng_callback = RankRngCallback()  # among the Trainer's callbacks on more than one rank
        self._code = prov.git_state()  # once, not at every save

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        import torch.distributed as dist

        from ..convert.base import ConvertResult, NoProgress
        from ..convert.training import write_training
        from ..torch import rng, topology
        from ..torch.state import config_field

        initialized = dist.is_available() and dist.is_initialized()
        if initialized and dist.get_rank() != 0:
            return  # one writer: Lightning's unsharded strategies gather the full state on rank 0
        url = os.fspath(path)
        checkpoint = dict(checkpoint)
        generators = checkpoint.pop(_RANKS_RNG, None)
        if generators is None and initialized and dist.get_world_size() > 1:
            if "optimizer_states" in checkpoint:
                raise UsageError(
                    f"CkptfmtCheckpointIO on {dist.get_world_size()} ranks writes every rank's random generators, "
                    "which only its callback can gather: pass it to the Trainer too, "
                    "Trainer(plugins=[io], callbacks=[io.rng_callback, ...])",
                    path=url,
                )
            generators = {"generators": {}}  # a weights-only save (no callback ran): nothing to resume with
        fields = split_checkpoint(checkpoint, url)
        contexts = dict(fields.contexts)
        if self.config is not None:
            contexts["config"] = config_field(self.config)
        contexts["rng"] = generators if generators is not None else rng.capture()
        contexts["topology"] = topology()
        step = checkpoint.get("global_step")
        provenance = prov.capture(step=step if type(step) is int else None, code=self._code or {})
        provenance["lightning"] = {"missing": {k: v for k, v in fields.missing.items() if k != "config"}}
        contexts["provenance"] = provenance
        result = ConvertResult(source="", source_format="lightning", destination=url, destination_format="ckptfmt")
        extra_options = storage_options if isinstance(storage_options, Mapping) else {}
        write_training(
            url,
            weights=fields.weights,
            optimizer=(fields.optimizer, fields.optimizer_context),
            contexts=contexts,
            extra_tensors={"lightning_tensors": fields.extra_tensors},
            result=result,
            progress=NoProgress(),
            storage_options={**self.storage_options, **extra_options},
            overwrite=True,  # Lightning overwrites a path it saves to again (last.ckpt)
            target_file_size=None,
        )

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The dict Lightning saved, tensors on the CPU (Lightning moves them to the module's device);
        nothing is unpickled, so ``weights_only`` is always in effect."""
        import ckptfmt

        from ..torch import rng

        with ckptfmt.open(os.fspath(path), self.storage_options) as ckpt:
            checkpoint = to_checkpoint(ckpt)
            generators = ckpt.read_context("rng") if self.restore_rng and ckpt.has_context("rng") else None
        if generators and generators.get("generators"):
            rng.restore(generators)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        from ..convert.base import fs_call, locate

        loc = locate(os.fspath(path), self.storage_options)
        if fs_call(loc.url, loc.fs.exists, loc.path):
            fs_call(loc.url, loc.fs.rm, loc.path, recursive=True)


__all__ = ["CkptfmtCheckpointIO", "RankRngCallback"]
