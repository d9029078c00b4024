"""``torch.distributed.checkpoint``'s storage layer for ckptfmt: ``dcp.save``/``dcp.load`` write and read verified
ckptfmt checkpoints, and a DCP state dict is a :class:`~ckptfmt.torch.TrainingState` for the checkpoint manager and
its memory tier (:func:`training_state`). Needs torch; the rest of the library imports without it."""

from .reader import StorageReader
from .training_state import training_state
from .writer import StorageWriter, TrainingFields

__all__ = ["StorageReader", "StorageWriter", "TrainingFields", "training_state"]
