"""Every generator in play, as the ``rng`` field: Python, numpy (global and passed Generators), torch CPU and CUDA."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import rng as base_rng
from ..collective import Collective
from ..context import decode, encode
from ..errors import ContextError

log = logging.getLogger("ckptfmt")
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


def with_ranks(fields: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``rng`` field for a multi-rank checkpoint from every rank's own, in rank order.

    ``generators`` stays rank 0's (what a single-process resume and any 1.0 reader use); ``ranks``
    holds each rank's ``{"generators": ...}``, since every rank draws from its own generators.
    """
    return {**fields[0], "ranks": [{"generators": f["generators"]} for f in fields]}


def gather(field: Mapping[str, Any], collective: Collective | None) -> dict[str, Any] | None:
    """Every rank's ``rng`` field (this process's is ``field``) as one, on rank 0 of ``collective``
    (:func:`with_ranks`), None on the others; ``field`` itself without a collective. Every rank calls it."""
    if collective is None:
        return dict(field)
    gathered = collective.gather(encode(field, where="field 'rng'"), dst=0)
    return None if gathered is None else with_ranks([decode(g, field="rng") for g in gathered])


def for_this_rank(field: Mapping[str, Any]) -> Mapping[str, Any]:
    """The generators this process resumes with: its rank's entry of ``ranks`` when the checkpoint has one.

    On a different world size the states cannot carry over exactly; rank r takes the saved rank
    ``r mod N``'s, and a warning says so.
    """
    ranks = field.get("ranks")
    if ranks is None:
        return field
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, Mapping) and "generators" in r for r in ranks):
        raise ContextError("'ranks' must be a non-empty array of maps with 'generators'", field="rng")
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    if world != len(ranks):
        log.warning(
            "resuming on %d rank(s) from a checkpoint saved on %d: random number generator states are "
            "reused (rank r takes saved rank r mod %d), so random draws will not match the original run",
            world,
            len(ranks),
            len(ranks),
        )
    return {**field, "generators": ranks[rank % len(ranks)]["generators"]}


def restore(field: Mapping[str, Any], generators: Mapping[str, np.random.Generator] | None = None) -> None:
    """Put every generator back; a generator in play that the checkpoint lacks is an error."""
    field = for_this_rank(field)
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
