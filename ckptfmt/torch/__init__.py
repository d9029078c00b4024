"""PyTorch integration: save and resume the full training state, a resumable DataLoader and sampler, a
checkpoint manager.

Importing this module imports torch; ``import ckptfmt`` alone does not.
"""

from __future__ import annotations

from .api import Restored, capture, load, save, topology
from .loader import InexactResumeWarning, ResumableDataLoader
from .manager import CheckpointManager
from .prewarm import prewarm
from .restore_report import RestoreReport
from .sampler import DatasetIdentity, ResumableSampler

__all__ = [
    "CheckpointManager",
    "DatasetIdentity",
    "InexactResumeWarning",
    "Restored",
    "ResumableDataLoader",
    "ResumableSampler",
    "RestoreReport",
    "capture",
    "load",
    "prewarm",
    "save",
    "topology",
]
