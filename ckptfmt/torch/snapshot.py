"""The snapshot: a training state in host memory, and the machinery that copies it there.

A :class:`Snapshot` holds field -> tensors and field -> context; :class:`HostBuffers` are the reusable (pinned, on
CUDA) host copies it is taken into, and :class:`Source` what tells that a tensor copied late (deferred) changed
in place since capture. :mod:`ckptfmt.torch.state` fills a snapshot from the live objects and applies one back;
:mod:`ckptfmt.torch.write_state` writes one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..arrays import as_array
from ..errors import SourceChangedError
from .in_place import Checked
from .sharding import LocalShard, TargetShard, is_dtensor, shard_of

# a whole tensor, this rank's piece, a loaded region, a region checked for a live tensor (in_place.py)
Stored = np.ndarray[Any, Any] | LocalShard | TargetShard | Checked


class Source(NamedTuple):
    """A deferred tensor's live tensor as capture found it: what tells that it changed before its copy was done.
    (A tuple: one is made per tensor on the trainer's thread, and a tuple is made fastest.)"""

    field: str
    name: str
    live: torch.Tensor  # a parameter (whose ``.data`` a trainer may replace) or an optimizer state tensor
    captured: torch.Tensor  # what the snapshot copies: a detached alias of ``live`` at capture
    versions: tuple[int, ...]  # _versions(live) at capture

    def changed(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(versions at capture, now) when the captured data was changed in place since; else None."""
        now = _versions(self.live)
        if now == self.versions:
            return None
        if _local(self.live).data_ptr() != _local(self.captured).data_ptr():
            # ``p.data = x`` gave the parameter other storage, which took over its version counter: what moved is
            # the new storage's, while the snapshot holds the captured one, as it was at capture
            return None
        return self.versions, now


def _source(field: str, name: str, live: torch.Tensor, captured: torch.Tensor) -> Source:
    return Source(field, name, live, captured, _versions(live))


def _versions(tensor: torch.Tensor) -> tuple[int, ...]:
    """The version counters that an in-place change of ``tensor`` bumps (views share their base's).

    A DTensor's own counter moves with ops on the DTensor, its local tensor's with ops on ``to_local()``: neither
    sees the other's. An inference tensor has none: it is not checked. Nor is a change made through ``.data``,
    which by design bumps no counter."""
    if tensor.is_inference():
        return ()
    if is_dtensor(tensor):
        with torch.no_grad():  # to_local() is then an alias of the live local tensor, sharing its counter
            return (tensor._version, _local(tensor)._version)
    return (tensor._version,)


@dataclass(slots=True)
class Snapshot:
    """Everything one checkpoint holds, in host memory: field -> tensors, field -> context.

    ``deferred`` lists tensors not copied yet (field, name, live tensor): parameters and optimizer
    state, which only ``optimizer.step()`` changes, so an async save may copy them while the next
    forward and backward run. :meth:`materialize` copies them.

    ``sources`` records their version counters at capture. Once their bytes are taken (copied, or, as views,
    written), :meth:`check_sources` refuses a snapshot of which one changed in place meanwhile (an EMA update or a
    schedule-free ``optimizer.eval()`` between a save and the next step): a torn snapshot is never committed.
    """

    tensors: dict[str, dict[str, Stored]] = field(default_factory=dict)
    contexts: dict[str, dict[str, Any]] = field(default_factory=dict)
    deferred: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)  # the deferred tensors' live tensors, not checked yet
    copy_in: Callable[[], None] | None = None  # fills the Checked tensors: the last step of applying a load
    forget: Callable[[], None] | None = None  # drops what was checked for copy_in from the page cache

    def discard(self) -> None:
        """A load that will not be applied: what its check left in the page cache for :attr:`copy_in` leaves it
        (a checkpoint read once does not stay cached, as after the copy-in)."""
        if self.forget is not None:
            self.forget()

    def materialize(self, buffers: HostBuffers | None) -> None:
        """Take the deferred tensors: copies into ``buffers``, or (None) views of CPU tensors as they are,
        which the caller must then write before the next ``optimizer.step()`` changes them.

        With ``buffers``, raises :class:`~ckptfmt.errors.SourceChangedError` when a tensor changed in place since
        capture; views are checked by :func:`stage_snapshot`, once written."""
        for fname, name, tensor in self.deferred:
            self.tensors[fname][name] = _host(f"{fname}/{name}", tensor, buffers)
        self.deferred.clear()
        if buffers is not None:
            buffers.synchronize()
            # After the copies landed: a change made while one ran has bumped its counter by now. (On CUDA the
            # counter moves when the op is queued, and the copies wait for everything queued before them.)
            self.check_sources()

    def check_sources(self) -> None:
        """Raise :class:`~ckptfmt.errors.SourceChangedError` naming the first tensor (and how many) that changed in
        place since capture; call it once the deferred tensors' bytes are taken, before the next step may run."""
        changed = [(source, moved) for source in self.sources if (moved := source.changed()) is not None]
        self.sources.clear()
        if not changed:
            return
        source, (then, now) = changed[0]
        others = f"; {len(changed) - 1} more tensors changed too" if len(changed) > 1 else ""
        raise SourceChangedError(
            f"changed in place while the snapshot was copied (version {_counter(then)} at capture, {_counter(now)} "
            f"after{others}): the snapshot would mix two training states, so it is refused, not committed. Between a "
            "save or memory snapshot and the next optimizer.step(), change parameters and optimizer state only in "
            "step(), or wait for the save first (CheckpointManager.wait, wait_memory)",
            field=source.field,
            tensor=source.name,
        )


class HostBuffers:
    """Reusable host copies of tensors, so repeated snapshots allocate nothing new.

    With ``pinned`` (device tensors, CUDA), buffers are page-locked and the copies are issued on a side
    stream that first waits for the training stream's work (``source_stream``, captured by the trainer's
    thread): the training stream never waits on a copy, and :meth:`synchronize` (called by the thread that
    writes the snapshot) waits for the copies' event, not for the device.
    """

    def __init__(self, *, pinned: bool = False) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.pinned = pinned
        self._stream: Any = None
        self._event: Any = None
        self.source_stream: Any = None

    def copy(self, key: str, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
        t = _local(tensor.detach())
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned and t.is_cuda)
            self._buffers[key] = buf
        if t.is_cuda and self.pinned:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=t.device)  # type: ignore[no-untyped-call]
            if self._event is None:  # first device copy of this round: order it after the training stream's work
                self._stream.wait_stream(self.source_stream or torch.cuda.current_stream(t.device))
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(self._stream):
                buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t)
        return as_array(buf)[0]

    def synchronize(self) -> None:
        """Wait until every copy issued since the last call has landed in host memory."""
        if self._event is not None:
            self._event.record(self._stream)
            self._event.synchronize()
            self._event = None


def _counter(versions: tuple[int, ...]) -> str:
    return "/".join(str(v) for v in versions)


def _host(key: str, tensor: torch.Tensor, buffers: HostBuffers | None) -> Stored:
    """A host copy (or a view, for CPU tensors without ``buffers``); a DTensor becomes its :class:`LocalShard`."""
    host = buffers.copy(key, tensor) if buffers is not None else None
    if is_dtensor(tensor):
        return shard_of(key, tensor, host)
    return host if host is not None else as_array(tensor)[0]


def _local(tensor: Any) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[no-any-return]
