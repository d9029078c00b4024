"""A :class:`~ckptfmt.collective.PeerChannel` over one byte stream: the messages of one transfer, in order.

The memory tier's transfers (:mod:`ckptfmt.tier.wire`) are written for a channel between two ranks; a heal between
torchft replica groups carries the same messages in one HTTP response instead. Each message is its length (8
bytes, little-endian) then its bytes; the stream is one direction of one transfer, so ``tag`` only has to match
what the other side used, and ``src``/``dst`` name the peer in errors.

A length is checked against the receiver's bound before anything is allocated for it (a peer's stream is hostile
input), and a stream that ends inside a message is a :class:`~ckptfmt.errors.CollectiveError`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from ..collective import refuse_length
from ..errors import CollectiveError, MessageTooLargeError

_LENGTH = struct.Struct("<Q")
READ_BYTES = 1 << 20  # a receive reads at most this much per call: a short read is retried, never over-allocated


class StreamChannel:
    """One side of a transfer over a stream: ``read(n)`` returns up to ``n`` bytes (b"" at its end), or ``read_into``
    fills a buffer and returns the bytes it read (0 at its end); ``write`` sends.

    ``peer`` names the other side in errors (an address); ``rank`` is this side's number in the wire's messages.
    """

    def __init__(
        self,
        *,
        peer: str,
        rank: int = 0,
        read: Callable[[int], bytes] | None = None,
        read_into: Callable[[memoryview], int | None] | None = None,
        write: Callable[[bytes | memoryview], object] | None = None,
    ) -> None:
        self.peer = peer
        self._rank = rank
        self._read = read
        self._read_into = read_into
        self._write = write
        self.bytes_received = 0
        self.bytes_sent = 0

    @property
    def rank(self) -> int:
        return self._rank

    def send(self, data: bytes, *, dst: int, tag: int) -> None:
        self.send_parts((data,), dst=dst, tag=tag)

    def send_parts(self, parts: Sequence[bytes | memoryview], *, dst: int, tag: int) -> None:
        """One message made of ``parts``, written as they are (a file's piece is not copied to be framed)."""
        if self._write is None:
            raise CollectiveError(f"the stream to {self.peer} is read-only")
        length = sum(len(p) for p in parts)
        try:
            self._write(_LENGTH.pack(length))
            for part in parts:
                self._write(part)
        except OSError as exc:
            raise CollectiveError(f"{self.peer} stopped reading: {exc}") from exc
        self.bytes_sent += _LENGTH.size + length

    def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        try:
            refuse_length(length, max_size, src=src, what="a message")
        except MessageTooLargeError as exc:
            raise MessageTooLargeError(f"{self.peer}: {exc.message}") from exc
        return self._exactly(length)

    def _exactly(self, length: int) -> bytes:
        """The next ``length`` bytes, read into one buffer (no parts joined: a file's piece is copied once)."""
        if self._read is None and self._read_into is None:
            raise CollectiveError(f"the stream from {self.peer} is write-only")
        out = bytearray(length)
        view = memoryview(out)
        done = 0
        while done < length:
            want = min(length - done, READ_BYTES)
            try:
                if self._read_into is not None:
                    got = self._read_into(view[done : done + want])
                else:
                    assert self._read is not None
                    part = self._read(want)
                    got = len(part)
                    view[done : done + got] = part
            except OSError as exc:
                raise CollectiveError(f"the stream from {self.peer} failed: {exc}") from exc
            if not got:
                raise CollectiveError(f"the stream from {self.peer} ended {length - done:,} bytes short of a message")
            done += got
        self.bytes_received += length
        return out  # type: ignore[return-value]  # a bytearray: what a receiver slices and hashes, never mutates
