"""What a multi-rank save or load needs from its process group: two byte-level collectives.

Ranks exchange canonical JSON (their file and chunk records, a status), never pickles. Any transport
that can broadcast and gather bytes serves: ``ckptfmt.torch`` implements :class:`Collective` over
``torch.distributed`` (gloo or NCCL); :class:`ThreadCollective` runs ranks as threads of one process
(tests, and single-host tools); an MPI or RPC implementation is a dozen lines.

A collective MUST raise (a :class:`~ckptfmt.errors.CollectiveError`) rather than block forever when
a rank is gone: every rank then fails the save with an error instead of hanging.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Protocol, runtime_checkable

from .errors import CheckpointError, CollectiveError, MessageTooLargeError, error_from_dict
from .jsonio import load_json


@runtime_checkable
class Collective(Protocol):
    """A process group of ``world_size`` ranks; this process is ``rank``. Every rank calls each method."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        """``src`` passes bytes; every rank (``src`` included) returns them."""
        ...

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        """Every rank passes bytes; ``dst`` returns them in rank order, the others None.

        With ``max_size``, ``dst`` MUST NOT allocate for a rank that announces more: it raises a
        :class:`~ckptfmt.errors.MessageTooLargeError` naming that rank, after receiving the others (so that no
        honest rank is left blocked in its send)."""
        ...


@runtime_checkable
class PeerChannel(Protocol):
    """Point-to-point messages between two ranks of a group: only the two call, with the same ``tag``.

    Messages between one pair with one tag arrive in the order they were sent. Like the collectives, a peer
    that is gone or does not answer MUST fail the call (a :class:`~ckptfmt.errors.CollectiveError`)."""

    @property
    def rank(self) -> int: ...

    def send(self, data: bytes, *, dst: int, tag: int) -> None: ...

    def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
        """The next message from ``src`` on ``tag``. With ``max_size``, a longer announced length MUST be refused
        (a :class:`~ckptfmt.errors.MessageTooLargeError` naming ``src``) before anything is allocated for it."""
        ...


def refuse_length(length: int, max_size: int | None, *, src: int, what: str) -> None:
    """Raise when a peer announces a message longer than ``max_size`` (or a negative length): checked before
    a receiver allocates anything for it, so one bad length header costs nothing."""
    if length < 0:
        raise MessageTooLargeError(f"rank {src} announced {what} of {length} bytes")
    if max_size is not None and length > max_size:
        raise MessageTooLargeError(
            f"rank {src} announced {what} of {length:,} bytes; at most {max_size:,} are accepted"
        )


def encode_status(error: CheckpointError | None, **ok: object) -> bytes:
    """A rank's or the coordinator's outcome as bytes: ``{"ok": {...}}`` or ``{"error": {...}}``."""
    doc = {"error": error.to_dict()} if error is not None else {"ok": ok}
    return json.dumps(doc, sort_keys=True).encode("utf-8")


def decode_status(data: bytes) -> dict[str, object]:
    """The ``ok`` member of a status, or raise the error it carries (the same error on every rank)."""
    doc = load_json(data, error=CollectiveError, what="a rank's status")
    if not isinstance(doc, dict):
        raise CollectiveError("a rank's status is not an object")
    if "error" in doc:
        reported = doc["error"]
        if not isinstance(reported, dict):
            raise CollectiveError("a rank's status carries a malformed error")
        raise error_from_dict({str(k): str(v) for k, v in reported.items()})
    ok = doc.get("ok")
    return dict(ok) if isinstance(ok, dict) else {}


class ThreadCollective:
    """Ranks as threads of one process: ``ThreadCollective.group(n)`` makes one handle per rank."""

    def __init__(self, rank: int, shared: _Shared) -> None:
        self._rank = rank
        self._shared = shared

    @classmethod
    def group(cls, world_size: int, *, timeout: float = 60.0) -> list[ThreadCollective]:
        shared = _Shared(world_size, timeout)
        return [cls(r, shared) for r in range(world_size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._shared.world_size

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        slots = self._shared.exchange(self._rank, data)
        value = slots[src]
        if value is None:
            raise CollectiveError(f"rank {src} broadcast nothing")
        return value

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        slots = self._shared.exchange(self._rank, data)
        if self._rank != dst:
            return None
        out = [s if s is not None else b"" for s in slots]
        for rank, message in enumerate(out):
            refuse_length(len(message), max_size, src=rank, what="its part of a gather")
        return out

    def send(self, data: bytes, *, dst: int, tag: int) -> None:
        self._shared.mailbox(self._rank, dst, tag).put(bytes(data))

    def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
        try:
            message = self._shared.mailbox(src, self._rank, tag).get(timeout=self._shared.timeout)
        except queue.Empty:
            raise CollectiveError(
                f"rank {self._rank}: nothing from rank {src} (tag {tag}) within {self._shared.timeout:g} s"
            ) from None
        refuse_length(len(message), max_size, src=src, what=f"a message (tag {tag})")
        return message

    def abandon(self) -> None:
        """Simulate this rank dying: every rank waiting in a collective fails instead of hanging."""
        self._shared.barrier.abort()


class _Shared:
    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.barrier = threading.Barrier(world_size)
        self.slots: list[bytes | None] = [None] * world_size
        self._mailboxes: dict[tuple[int, int, int], queue.Queue[bytes]] = {}
        self._lock = threading.Lock()

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue[bytes]:
        with self._lock:
            return self._mailboxes.setdefault((src, dst, tag), queue.Queue())

    def exchange(self, rank: int, data: bytes | None) -> list[bytes | None]:
        try:
            self.barrier.wait(self.timeout)  # everyone arrived, previous round fully read
            self.slots[rank] = data
            self.barrier.wait(self.timeout)  # everyone wrote
            out = list(self.slots)
            self.barrier.wait(self.timeout)  # everyone read
        except threading.BrokenBarrierError:
            raise CollectiveError(
                f"rank {rank}: another rank failed or did not answer within {self.timeout:g} s"
            ) from None
        return out
