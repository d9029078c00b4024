"""``torch.distributed.checkpoint``'s storage layer for ckptfmt: ``dcp.save``/``dcp.load`` write and read verified
ckptfmt checkpoints (issue 41, first part). Needs torch; the rest of the library imports without it."""

from .reader import StorageReader
from .writer import StorageWriter, TrainingFields

__all__ = ["StorageReader", "StorageWriter", "TrainingFields"]
