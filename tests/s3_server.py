"""A real S3 HTTP endpoint on loopback for the tests: moto's server mode in its own process.

Also a byte-counting TCP proxy, so a test can measure what actually crossed the wire, and which can
play a misbehaving store by editing request headers on their way (a Range or If-None-Match dropped).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1; can be killed and restarted on the same port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **CREDENTIALS}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + 60  # a hang guard: it answers in about a second
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        self.kill()  # not left running for the rest of the session, or after it
        raise RuntimeError("moto server did not come up within 60 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        return {
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def create_bucket(self) -> str:
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return name

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )


_RANGE = re.compile(rb"bytes=(\d+)-(\d+)")


@dataclass
class CountingProxy:
    """Forwards 127.0.0.1:port to the target, counting bytes each way, and requests in flight: a
    connection is busy from a request's first byte upstream to its answer's first byte back (HTTP/1.1
    without pipelining), so ``requests`` counts requests and ``max_busy`` is the most in flight at once.

    Misbehaving stores, for connections opened while set: ``drop_headers`` (lower-case names) are removed
    from every request, so ``{"range"}`` makes the server answer 200 with the whole object and
    ``{"if-none-match"}`` makes a create-only PUT overwrite; ``shift_range`` moves every ``Range`` that many
    bytes on, so a 206 carries other bytes than asked (its Content-Range says which). ``edited`` counts the
    requests changed. Requests are then framed (Content-Length or chunked) rather than passed through, and
    each one's method and path logged in ``request_log`` (also with ``log_requests``, the headers unchanged)."""

    target_port: int
    port: int = field(default_factory=free_port)
    sent_to_server: int = 0
    cut_after: int | None = None  # cut the network once this many bytes went upstream
    received_from_server: int = 0
    requests: int = 0
    busy: int = 0
    max_busy: int = 0
    drop_headers: frozenset[str] = frozenset()
    shift_range: int = 0
    edited: int = 0
    log_requests: bool = False
    request_log: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _cut: threading.Event = field(default_factory=threading.Event)
    _sockets: list[socket.socket] = field(default_factory=list)

    def cut(self) -> None:
        """A network partition: every open connection dropped, new ones closed at once."""
        self._cut.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def heal(self) -> None:
        self._cut.clear()

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._lock:
            self.sent_to_server = self.received_from_server = self.requests = 0
            self.request_log.clear()
            self.max_busy = self.busy

    def _forward(self, dst: socket.socket, data: bytes, upstream: bool, busy: list[bool]) -> bool:
        """Count ``data``, then send it on; False once the network is cut (``cut_after``)."""
        # count before forwarding: a reader that has its bytes always sees them counted
        with self._lock:
            if upstream:
                self.sent_to_server += len(data)
            else:
                self.received_from_server += len(data)
            if busy[0] != upstream:  # a request starts, or its answer arrives
                busy[0] = upstream
                self.busy += 1 if upstream else -1
                self.requests += upstream
                self.max_busy = max(self.max_busy, self.busy)
            trip = upstream and self.cut_after is not None and self.sent_to_server >= self.cut_after
        if trip:
            self.cut_after = None
            self.cut()
            return False
        dst.sendall(data)
        return True

    def _edit(self, head: bytes) -> tuple[bytes, int, bool]:
        """A request head with the misbehaviour applied; its body's Content-Length, and whether it is chunked."""
        lines = head.split(b"\r\n")
        kept, length, chunked, changed = [lines[0]], 0, False, False
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(b":")
            key = name.strip().lower().decode("latin-1")
            if key in self.drop_headers:
                changed = True
                continue
            if key == "range" and self.shift_range:
                match = _RANGE.fullmatch(value.strip())
                if match is not None:
                    first, last = (int(g) + self.shift_range for g in match.groups())
                    line, changed = b"Range: bytes=%d-%d" % (first, last), True
            if key == "content-length":
                length = int(value)
            if key == "transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            kept.append(line)
        method, path, _ = lines[0].decode("latin-1").split(" ", 2)
        with self._lock:
            self.edited += changed
            self.request_log.append(f"{method} {path}")
        return b"\r\n".join([*kept, b"", b""]), length, chunked

    def _pump_requests(self, src: socket.socket, dst: socket.socket, busy: list[bool]) -> bool:
        """Forward requests one by one, each head edited (``_edit``); True at an orderly close."""
        reader = src.makefile("rb")

        def copy(n: int) -> bool:
            while n:
                data = reader.read(min(n, 1 << 16))
                if not data or not self._forward(dst, data, True, busy):
                    return False
                n -= len(data)
            return True

        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = reader.readline(1 << 16)
                if not line:
                    return not head
                head += line
            head, length, chunked = self._edit(head)
            if not self._forward(dst, head, True, busy):
                return False
            if not chunked:
                if not copy(length):
                    return False
                continue
            while True:  # chunk-size line, chunk and its CRLF; after the last (empty) chunk, trailers
                line = reader.readline(1 << 16)
                if not line or not self._forward(dst, line, True, busy):
                    return False
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    break
                if not copy(size + 2):
                    return False
            while line != b"\r\n":
                line = reader.readline(1 << 16)
                if not line or not self._forward(dst, line, True, busy):
                    return False

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool, busy: list[bool], edit: bool) -> None:
        clean = False
        try:
            if upstream and edit:
                clean = self._pump_requests(src, dst, busy)
            else:
                while True:
                    data = src.recv(1 << 16)
                    if not data:
                        clean = True
                        break
                    if not self._forward(dst, data, upstream, busy):
                        break
        except OSError:
            pass
        with self._lock:
            if busy[0]:  # the connection ends with a request unanswered
                busy[0] = False
                self.busy -= 1
        if clean:  # an orderly close travels on as one
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            return
        # one side died (a killed server, a cut): close both, as a reset would, so no sender blocks forever
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self, listener: socket.socket) -> None:
        listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if self._cut.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:  # the target is down: the client sees its connection refused too
                client.close()
                continue
            with self._lock:
                self._sockets.extend((client, server))
            busy = [False]  # shared by the connection's two directions
            edit = bool(self.drop_headers or self.shift_range or self.log_requests)
            threading.Thread(target=self._pump, args=(client, server, True, busy, edit), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False, busy, edit), daemon=True).start()
        listener.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[CountingProxy]:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        thread = threading.Thread(target=self._serve, args=(listener,), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=5)
