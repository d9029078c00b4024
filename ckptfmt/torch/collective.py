"""The :class:`~ckptfmt.collective.Collective` of a ``torch.distributed`` process group.

Bytes travel as uint8 tensors (lengths first), never as pickled objects: ``broadcast_object_list``
and friends unpickle what other ranks send, which ckptfmt never does. The exchange runs on a CPU
(gloo) group: the messages are small, and NCCL groups need device tensors and a device per rank.
A rank that dies or does not answer fails the collective on the others after the group's timeout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..collective import refuse_length
from ..errors import CollectiveError, MessageTooLargeError

# (id of the user's group, timeout, purpose) -> (that group, our gloo group over its ranks). The user's group is
# held so that its id cannot be reused by another group while the entry lives.
_CPU_GROUPS: dict[tuple[int, float | None, str], tuple[Any, Any]] = {}


def _cpu_group(group: Any, timeout: timedelta | None, purpose: str = "") -> Any:
    """A gloo group over the same ranks as ``group`` (itself when it is gloo and neither a timeout nor a
    purpose is asked); one per ``purpose``, so that two background threads never share a group. A group of
    ours that torch has destroyed since (``destroy_process_group``, then a new ``init_process_group`` in the same
    process: an in-process restart) is made again, never handed out."""
    if dist.get_backend(group) == "gloo" and timeout is None and not purpose:
        return group
    key = (id(group), timeout.total_seconds() if timeout is not None else None, purpose)
    cached = _CPU_GROUPS.get(key)
    if cached is not None and cached[0] is group and _registered(cached[1]):
        return cached[1]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    made = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    _CPU_GROUPS[key] = (group, made)
    return made


def _registered(group: Any) -> bool:
    """Whether torch still knows ``group`` (destroying the default group destroys every group)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


class TorchCollective:
    """Every rank of ``process_group`` (the default group if None) constructs one, together."""

    def __init__(self, process_group: Any = None, *, timeout: timedelta | None = None, purpose: str = "") -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CollectiveError("torch.distributed is not initialized")
        self._user_group = process_group
        self._group = _cpu_group(process_group, timeout, purpose)
        self._rank = dist.get_rank(process_group)
        self._world_size = dist.get_world_size(process_group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _global(self, group_rank: int) -> int:
        return group_rank if self._user_group is None else dist.get_global_rank(self._user_group, group_rank)

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        try:
            length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
            dist.broadcast(length, self._global(src), group=self._group)
            payload = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if data is not None and self._rank == src and len(data)
                else torch.empty(int(length.item()), dtype=torch.uint8)
            )
            if payload.numel():
                dist.broadcast(payload, self._global(src), group=self._group)
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"rank {self._rank}: broadcast from rank {src} failed: {exc}") from exc
        return payload.numpy().tobytes()

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        """Lengths gathered to ``dst``, then each payload sent to it point to point: only ``dst`` holds
        everything, and nobody pads to the longest message (an all-gather made every rank allocate
        world x the longest). Every length is checked before anything is allocated; a rank over ``max_size``
        is refused after the others' payloads are in (they are not left blocked in their sends)."""
        try:
            mine = torch.tensor([len(data)], dtype=torch.int64)
            lengths = (
                [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)] if self._rank == dst else None
            )
            dist.gather(mine, lengths, dst=self._global(dst), group=self._group)
            if self._rank != dst:
                if data:
                    dist.send(
                        torch.frombuffer(bytearray(data), dtype=torch.uint8), self._global(dst), group=self._group
                    )
                return None
            assert lengths is not None
            out: list[bytes] = []
            refused: MessageTooLargeError | None = None
            for rank, length in enumerate(int(t.item()) for t in lengths):
                if rank == dst or not length:
                    out.append(data if rank == dst else b"")
                    continue
                try:
                    refuse_length(length, max_size, src=rank, what="its part of a gather")
                except MessageTooLargeError as exc:
                    refused = refused or exc
                    out.append(b"")
                    continue
                buffer = torch.empty(length, dtype=torch.uint8)
                dist.recv(buffer, self._global(rank), group=self._group)
                out.append(buffer.numpy().tobytes())
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"rank {self._rank}: gather to rank {dst} failed: {exc}") from exc
        if refused is not None:
            raise refused
        return out

    def send(self, data: bytes, *, dst: int, tag: int) -> None:
        """Length, then payload, to ``dst`` (a :class:`~ckptfmt.collective.PeerChannel`)."""
        try:
            dist.send(torch.tensor([len(data)], dtype=torch.int64), self._global(dst), group=self._group, tag=tag)
            if data:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                dist.send(payload, self._global(dst), group=self._group, tag=tag)
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"rank {self._rank}: send to rank {dst} failed: {exc}") from exc

    def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
        try:
            length = torch.zeros(1, dtype=torch.int64)
            dist.recv(length, self._global(src), group=self._group, tag=tag)
            size = int(length.item())
            refuse_length(size, max_size, src=src, what=f"a message (tag {tag})")  # before allocating it
            buffer = torch.empty(size, dtype=torch.uint8)
            if size:
                dist.recv(buffer, self._global(src), group=self._group, tag=tag)
        except (RuntimeError, ValueError) as exc:
            raise CollectiveError(f"rank {self._rank}: receive from rank {src} failed: {exc}") from exc
        return buffer.numpy().tobytes()


def default_collective(
    process_group: Any = None, *, timeout: timedelta | None = None, purpose: str = ""
) -> TorchCollective | None:
    """The collective of ``process_group`` when torch.distributed runs with more than one rank, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) <= 1:
        return None
    return TorchCollective(process_group, timeout=timeout, purpose=purpose)
