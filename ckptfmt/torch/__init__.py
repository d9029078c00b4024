"""PyTorch integration: save and resume the full training state, a resumable sampler, a checkpoint manager.

Importing this module imports torch; ``import ckptfmt`` alone does not.
"""

from __future__ import annotations

from .api import Restored, capture, load, save, topology
from .manager import CheckpointManager
from .sampler import DatasetIdentity, ResumableSampler

__all__ = [
    "CheckpointManager",
    "DatasetIdentity",
    "Restored",
    "ResumableSampler",
    "capture",
    "load",
    "save",
    "topology",
]
