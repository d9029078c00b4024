"""A :class:`~ckptfmt.collective.Collective` for ranks that are separate processes, without torch.

The parent makes a full mesh of Unix socket pairs (:func:`mesh`) before it forks the ranks; each
child keeps its own ends (:func:`keep_only`) and builds a :class:`SocketCollective` over them.
Messages are length-prefixed bytes on the pair of the two ranks concerned, as point to point as
gloo's: a broadcast is ``src`` sending to each rank, a gather each rank sending to ``dst``.

A peer that dies closes its ends (the kernel does it, SIGKILL included): a pending receive from it
sees end of file and a send to it fails with EPIPE at once, and either raises
:class:`~ckptfmt.errors.CollectiveError`. A peer that lives but does not answer makes the call raise
after ``timeout`` seconds. So no collective blocks for longer than ``timeout``, as the protocol asks.
"""

from __future__ import annotations

import socket
import struct
import time

from ckptfmt.collective import refuse_length
from ckptfmt.errors import CollectiveError, MessageTooLargeError

HEADER = struct.Struct("!Q")
MAX_MESSAGE = 64 << 20  # a rank's records are kilobytes; a larger length is a broken stream


def mesh(world_size: int) -> list[dict[int, socket.socket]]:
    """``ends[r][p]``: rank ``r``'s end of the socket pair it shares with rank ``p``."""
    ends: list[dict[int, socket.socket]] = [{} for _ in range(world_size)]
    for a in range(world_size):
        for b in range(a + 1, world_size):
            ends[a][b], ends[b][a] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ends


def keep_only(ends: list[dict[int, socket.socket]], rank: int | None) -> dict[int, socket.socket]:
    """Close every end but ``rank``'s (all of them when ``rank`` is None, in the parent); returns its own.

    Every process must: an end left open in another process keeps a dead peer's pair from reporting
    end of file, and a survivor would wait out the timeout instead.
    """
    for r, own in enumerate(ends):
        if r != rank:
            for sock in own.values():
                sock.close()
    return ends[rank] if rank is not None else {}


class SocketCollective:
    """Rank ``rank`` of ``world_size``, talking to each peer over ``peers[p]`` (see :func:`mesh`)."""

    def __init__(self, rank: int, world_size: int, peers: dict[int, socket.socket], *, timeout: float = 30.0) -> None:
        if set(peers) != set(range(world_size)) - {rank}:
            raise ValueError(f"rank {rank} needs one socket per other rank of {world_size}")
        self._rank = rank
        self._world_size = world_size
        self._peers = peers
        self.timeout = timeout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        if self._rank != src:
            return self._recv(src, "broadcast")
        if data is None:
            raise CollectiveError(f"rank {src} broadcast nothing")
        for peer in sorted(self._peers):
            self._send(peer, data, "broadcast")
        return data

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        if self._rank != dst:
            self._send(dst, data, "gather")
            return None
        out: list[bytes] = []
        refused: MessageTooLargeError | None = None
        for r in range(self._world_size):
            try:
                out.append(data if r == dst else self._recv(r, "gather", max_size))
            except MessageTooLargeError as exc:  # the others are still received: none is left blocked in a send
                refused = refused or exc
                out.append(b"")
        if refused is not None:
            raise refused
        return out

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close()

    def _send(self, peer: int, data: bytes, what: str) -> None:
        sock = self._peers[peer]
        try:
            sock.settimeout(self.timeout)
            sock.sendall(HEADER.pack(len(data)) + data, socket.MSG_NOSIGNAL)
        except OSError as exc:  # EPIPE / ECONNRESET: the peer is gone; TimeoutError: it stopped reading
            raise CollectiveError(f"rank {self._rank}: {what}: sending to rank {peer} failed: {exc!r}") from exc

    def _recv(self, peer: int, what: str, max_size: int | None = None) -> bytes:
        deadline = time.monotonic() + self.timeout
        (length,) = HEADER.unpack(self._read(peer, HEADER.size, deadline, what))
        refuse_length(length, max_size, src=peer, what=f"its part of a {what}")
        if length > MAX_MESSAGE:
            raise CollectiveError(f"rank {self._rank}: {what}: rank {peer} sent a length of {length}")
        return self._read(peer, length, deadline, what)

    def _read(self, peer: int, size: int, deadline: float, what: str) -> bytes:
        sock = self._peers[peer]
        parts: list[bytes] = []
        left = size
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveError(f"rank {self._rank}: {what}: rank {peer} did not answer in {self.timeout:g} s")
            try:
                sock.settimeout(remaining)
                part = sock.recv(min(left, 1 << 20))
            except TimeoutError:
                raise CollectiveError(
                    f"rank {self._rank}: {what}: rank {peer} did not answer in {self.timeout:g} s"
                ) from None
            except OSError as exc:
                raise CollectiveError(f"rank {self._rank}: {what}: receiving from rank {peer} failed: {exc!r}") from exc
            if not part:
                raise CollectiveError(f"rank {self._rank}: {what}: rank {peer} is gone (end of stream)")
            parts.append(part)
            left -= len(part)
        return b"".join(parts)
