"""What a restore chose, from where, at what cost (:class:`RestoreReport`), and what it chose among."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..tier.restore_messages import MemoryOption
from .memory import MemoryCandidate

Tier = Literal["memory", "peer", "durable", "healed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreReport:
    """What :meth:`CheckpointManager.restore_latest` restored, from where, and what it cost."""

    step: int | None
    tier: Tier
    url: str
    checkpoint_id: str
    seconds: float
    bytes_read: int  # tensor bytes fetched (headers and context blobs not counted)
    skipped: tuple[str, ...] = ()  # newer candidates passed over, each with why
    # across nodes: each file this rank read -> "memory", "peer-copy" or "peer:rank R" (see ckptfmt.tier.agreed)
    sources: Mapping[str, str] = field(default_factory=dict)
    bytes_between_nodes: int = 0  # moved over the network at this restore, every rank's transfers together
    phases: Mapping[str, float] = field(default_factory=dict)  # seconds: agree, gather, read, apply
    held: tuple[Mapping[str, object], ...] = ()  # what the live nodes' memory held (complete checkpoints)

    def to_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "tier": self.tier,
            "url": self.url,
            "checkpoint_id": self.checkpoint_id,
            "seconds": round(self.seconds, 6),
            "bytes_read": self.bytes_read,
            "skipped": list(self.skipped),
            "sources": dict(self.sources),
            "bytes_between_nodes": self.bytes_between_nodes,
            "phases": dict(self.phases),
            "held": [dict(h) for h in self.held],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A checkpoint a restore may take: a memory slot or a run directory's checkpoint."""

    label: str
    step: int | None
    status: str
    url: str
    tier: Tier
    memory: MemoryCandidate | None = None
    option: MemoryOption | None = None  # a checkpoint spread over nodes' memory (a restore across nodes)


def estimated_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's share of a snapshot before its first one: the model's local tensors, and the optimizer's
    state, or twice the parameters while it has none yet (Adam's two moments, the common case)."""

    def nbytes(t: Any) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.numel() * local.element_size()) if isinstance(local, torch.Tensor) else 0

    weights = sum(nbytes(t) for t in model.state_dict().values())
    moments = sum(nbytes(v) for entry in optimizer.state.values() for v in entry.values())
    if not optimizer.state:
        moments = 2 * sum(nbytes(p) for group in optimizer.param_groups for p in group["params"])
    return weights + moments
