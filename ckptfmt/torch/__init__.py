"""PyTorch integration: save and resume the full training state, a resumable DataLoader and sampler, a
checkpoint manager.

Importing this module imports torch; ``import ckptfmt`` alone does not.
"""

from __future__ import annotations

from .api import Restored, capture, load, save, topology
from .loader import InexactResumeWarning, ResumableDataLoader
from .manager import CheckpointManager
from .options import DurableOptions, MemoryOptions, PreemptionOptions, RestoreOptions, RetentionOptions
from .prewarm import prewarm
from .replica_batches import ReplicaBatches, StepRecord
from .restore_report import RestoreReport
from .sampler import DatasetIdentity, ResumableSampler
from .training_state import Stateful, TrainingState

__all__ = [
    "CheckpointManager",
    "DatasetIdentity",
    "DurableOptions",
    "InexactResumeWarning",
    "MemoryOptions",
    "PreemptionOptions",
    "ReplicaBatches",
    "Restored",
    "ResumableDataLoader",
    "ResumableSampler",
    "RestoreOptions",
    "RestoreReport",
    "RetentionOptions",
    "Stateful",
    "StepRecord",
    "TrainingState",
    "capture",
    "load",
    "prewarm",
    "save",
    "topology",
]
