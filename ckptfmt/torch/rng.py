"""Every generator in play, as the ``rng`` field: Python, numpy (global and passed Generators), torch CPU and CUDA."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import rng as base_rng
from ..errors import ContextError

TORCH_CPU = "torch.cpu"
TORCH_CUDA = "torch.cuda"


def capture(generators: Mapping[str, np.random.Generator] | None = None) -> dict[str, object]:
    """The ``rng`` field for every generator that shapes a PyTorch training step."""
    field = base_rng.capture_default(generators)
    entries: dict[str, object] = field["generators"]  # type: ignore[assignment]
    entries["torch"] = {"kind": TORCH_CPU, "state": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            state = torch.cuda.get_rng_state(device).numpy().copy()
            entries[f"cuda:{device}"] = {"kind": TORCH_CUDA, "state": state, "device": device}
    return field


def restore(field: Mapping[str, Any], generators: Mapping[str, np.random.Generator] | None = None) -> None:
    """Put every generator back; a generator in play that the checkpoint lacks is an error."""
    base_rng.restore_default(field, generators)
    entries = field["generators"]
    entry = entries.get("torch")
    if not isinstance(entry, Mapping) or entry.get("kind") != TORCH_CPU:
        raise ContextError("the checkpoint has no torch CPU generator state", field="rng")
    torch.set_rng_state(torch.from_numpy(np.asarray(entry["state"], dtype=np.uint8).copy()))
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            entry = entries.get(f"cuda:{device}")
            if not isinstance(entry, Mapping) or entry.get("kind") != TORCH_CUDA:
                raise ContextError(f"the checkpoint has no state for CUDA device {device}", field="rng")
            torch.cuda.set_rng_state(torch.from_numpy(np.asarray(entry["state"], dtype=np.uint8).copy()), device)
