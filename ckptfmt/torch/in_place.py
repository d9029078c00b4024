"""Loading into the live tensors themselves: checked first, copied in last, all or nothing still.

A load keeps its promise (nothing changes unless every byte is good) by reading everything before applying
anything. Read into new memory, that costs a second copy of the state in RAM, new pages to fault in (on a VM
whose host reclaims freed memory, more than the disk read: see ``host_memory``) and a copy into the model. For a
tensor that already has a home in host memory (a CPU model, CPU-offloaded parameters, an optimizer's existing
state) the load goes in two passes instead: :meth:`Checkpoint.check_regions` reads and checks its bytes while
the snapshot is read, through bounded buffers, leaving them in the page cache; when the snapshot is applied,
after every other check, :func:`copy_in` reads them from there into the tensor, checking them again.

A second check that fails means the file changed between the two reads (something rewrote a committed
checkpoint in place): the error says the objects hold part of the checkpoint. What loading in place saves, in
time and memory: docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import optimizer_layout
from ..arrays import TORCH_DTYPES
from ..errors import CheckpointError
from ..manifest import RAW, TensorRecord
from ..read_plan import Target
from ..reader import Checkpoint
from .sharding import is_dtensor, local_region


@dataclass(slots=True)
class Checked:
    """A region whose bytes were checked where they are stored and go into ``live`` when the snapshot is applied.

    ``live`` is what ``load_state_dict`` is given (the parameter, DTensor or state tensor itself: loading it
    into itself copies nothing); ``local`` is the host memory that :func:`copy_in` fills."""

    target: Target
    live: Any
    local: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape of the tensor (what a whole-tensor check compares)."""
        return tuple(int(d) for d in self.live.shape)


def live_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, names: Sequence[str] | None
) -> dict[tuple[str, str], Any]:
    """The live tensors a load could fill in place, by (field, stored name): the model's parameters and buffers,
    and the optimizer's existing state keyed ``<parameter>/<key>`` (``names``: its parameters' stored names)."""
    out: dict[tuple[str, str], Any] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        out[("weights", name)] = tensor
    if optimizer is not None and names is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for name, param in zip(names, params, strict=True):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    out[("optimizer", optimizer_layout.tensor_name(name, key, optimizer_layout.FQN))] = value
    return out


def plan(
    records: Mapping[tuple[str, str], TensorRecord], live: Mapping[tuple[str, str], Any]
) -> dict[tuple[str, str], Checked]:
    """Which of ``live`` a load fills in place: host memory, contiguous, of the stored dtype and of the shape of the
    region this rank loads, stored raw (an encoded chunk is checked by decoding it: it is read as before)."""
    out: dict[tuple[str, str], Checked] = {}
    for key, tensor in live.items():
        record = records.get(key)
        if record is None or any(chunk.codec.name != RAW for chunk in record.chunks):
            continue
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        if local.layout != torch.strided or local.device.type != "cpu" or local.numel() == 0:
            continue
        if not local.is_contiguous():
            continue
        if TORCH_DTYPES.get(record.dtype) != str(local.dtype).removeprefix("torch."):
            continue
        if is_dtensor(tensor):
            if tuple(int(d) for d in tensor.shape) != tuple(record.shape):
                continue
            offsets, shape = local_region(tensor)
        else:
            offsets, shape = (0,) * len(record.shape), tuple(record.shape)
        if tuple(local.shape) != tuple(shape):
            continue
        target = Target(key[0], key[1], record.dtype, tuple(offsets), tuple(shape))
        out[key] = Checked(target, tensor, local)
    return out


def same_memory(a: Any, b: Any) -> bool:
    """Whether two live tensors are one (a tied parameter under two names)."""
    if a is b:
        return True
    la, lb = (t.to_local() if is_dtensor(t) else t for t in (a, b))
    return bool(la.data_ptr() == lb.data_ptr() and la.shape == lb.shape and la.device == lb.device)


def _bytes_of(local: torch.Tensor, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """``local``'s memory as unsigned integers of its element width, shaped ``shape`` (no copy)."""
    raw = local.detach().reshape(-1).view(torch.uint8).numpy()
    return raw.view(np.dtype(f"u{local.element_size()}")).reshape(shape)


def copy_in(ckpt: Checkpoint, checked: Sequence[Checked]) -> None:
    """Fill every checked tensor from ``ckpt``, its bytes checked again on the way."""
    if not checked:
        return
    try:
        ckpt.read_regions([c.target for c in checked], into=[_bytes_of(c.local, c.target.shape) for c in checked])
    except CheckpointError as exc:
        exc.add_note(
            "the checkpoint's bytes were good when checked and are not now (its files changed during the load): "
            "the model and optimizer hold part of it; load again"
        )
        raise


def fill_fresh(ckpt: Checkpoint, checked: Sequence[Checked]) -> None:
    """Read every checked region straight into its tensor, each byte hashed once on the way (a restore into memory
    that holds nothing of value: on a mismatch the tensors hold part of what was read, and the caller must not use
    them; see ``RestoreOptions.fresh``)."""
    if checked:
        ckpt.read_regions([c.target for c in checked], into=[_bytes_of(c.local, c.target.shape) for c in checked])


__all__ = ["Checked", "copy_in", "fill_fresh", "live_tensors", "plan", "same_memory"]
