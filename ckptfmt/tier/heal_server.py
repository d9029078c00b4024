"""One replica group's offer of its checkpoint to a peer that heals from it, served over HTTP.

A heal (torchft: a replica group that joins, or fell behind, takes the state of one that is up to date) moves one
committed checkpoint: the one the sender offers for the step the quorum agreed on. The server answers
``GET /heal/<step>`` with one stream of length-prefixed messages (:class:`~ckptfmt.tier.stream_channel.StreamChannel`):
the offer (canonical JSON: what kind of state, at which step, from where), then the transfer of the memory tier's
replicas (:func:`ckptfmt.tier.wire.send_files`: header, manifest, every file in checked pieces). The receiver trusts
none of it until it checks out (:mod:`ckptfmt.tier.heal_fetch`).

The sender checks its own bytes as it sends them: each file's digest is computed from the pieces read and compared
with the manifest before the file's last piece goes out. A copy that does not match (a bit flipped in memory) aborts
the transfer before the damage leaves the node, and the owner is told (``on_damaged``), so that its next offer is
made from something else.

A request for a step not offered yet waits for it (up to the timeout), as torchft's sender offers its state from its
quorum thread at about the time the receiver asks; a request for another step is refused (409) naming the step
offered. :meth:`HealServer.withdraw` stops new transfers and waits for those in flight, so the owner may delete
what it offered. With a ``token``, a request that does not carry it (the ``X-Ckptfmt-Heal-Token`` header) is refused
(403): the offer is the whole training state, and torch.distributed authenticates nobody.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..digests import algorithm_of, format_digest
from ..errors import CheckpointError, DigestMismatchError
from ..manifest import FileRecord
from ..manifest_parse import parse_manifest
from ..storage import Store
from ..tree_digests import file_hasher
from .stream_channel import StreamChannel
from .wire import send_files

log = logging.getLogger("ckptfmt")
TAG = 0  # one transfer per stream
TOKEN_HEADER = "X-Ckptfmt-Heal-Token"
OFFER_BYTES = 64 << 10  # the offer's JSON


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """A committed checkpoint offered for ``step``: where its files are, its manifest, and what the receiver is told
    about it (``info``: plain JSON values). ``on_damaged`` hears of a file whose bytes do not match the manifest."""

    step: int
    source: Store
    manifest_bytes: bytes
    info: Mapping[str, object]
    on_damaged: Callable[[CheckpointError], None] | None = None


class _CheckedSource:
    """``source`` as :func:`send_files` reads it (each file once, from its start), each file's digest checked
    against ``records`` as its last piece is read: a mismatch raises instead of returning the piece."""

    def __init__(self, source: Store, records: Mapping[str, FileRecord]) -> None:
        self._source = source
        self._records = records
        self._hashers: dict[str, Any] = {}

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        record = self._records[path]
        if begin == 0:
            self._hashers[path] = file_hasher(algorithm_of(record.digest))
        self._source.read_into(path, begin, out)
        hasher = self._hashers[path]
        hasher.update(out)
        if begin + len(out) == record.size and format_digest(algorithm_of(record.digest), hasher) != record.digest:
            raise DigestMismatchError("this replica's copy does not match its manifest digest: not sent", path=path)


class HealServer:
    """Serves the current :class:`Offer` to peers that heal from it (module doc). ``host``: the address peers reach
    this process at, bound as given; ``port`` 0 picks a free one."""

    def __init__(self, *, host: str, port: int = 0, timeout: float = 60.0, token: str | None = None) -> None:
        self.timeout = timeout
        self._token = token  # a request must carry it (TOKEN_HEADER) when set
        self._offer: Offer | None = None
        self._active = 0
        self._changed = threading.Condition()
        self.transfers = 0  # completed, since construction
        self.bytes_sent = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    server._serve(self)
                except OSError as exc:  # the peer gave up (its timeout) and closed the connection
                    log.debug("heal server: %s went away: %s", self.client_address, exc)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("heal server: " + format, *args)

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.address = f"http://{host}:{self._http.server_address[1]}"
        # polled every 50 ms for shutdown (the default 0.5 s is what each transport's shutdown would wait)
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="ckptfmt-heal-server", daemon=True
        )
        self._thread.start()

    def offer(self, offer: Offer) -> None:
        """Serve ``offer`` from now on (replacing the previous one, whose transfers in flight finish)."""
        parse_manifest(offer.manifest_bytes)  # our own, but a malformed one must not reach a peer
        with self._changed:
            self._offer = offer
            self._changed.notify_all()

    def withdraw(self, timeout: float | None = None) -> bool:
        """Serve nothing from now on; wait (up to ``timeout``, default the server's) for the transfers in flight.
        Returns whether none is left."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._changed:
            self._offer = None
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("heal server: %d transfers still in flight after the offer was withdrawn", self._active)
                    return False
                self._changed.wait(left)
        return True

    def shutdown(self) -> None:
        self.withdraw(timeout=0)
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    # ---------------------------------------------------------------- one request

    def _wanted(self, path: str) -> int | None:
        parts = path.split("/")
        if len(parts) != 3 or parts[1] != "heal" or not parts[2].isdigit() or len(parts[2]) > 19:
            return None
        return int(parts[2])

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        if self._token is not None:
            given = request.headers.get(TOKEN_HEADER, "")
            if not hmac.compare_digest(given.encode("utf-8"), self._token.encode("utf-8")):
                request.send_error(403, "the heal token does not match")
                return
        step = self._wanted(request.path)
        if step is None:
            request.send_error(404, "expected /heal/<step>")
            return
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while self._offer is None or self._offer.step < step:
                left = deadline - time.monotonic()
                if left <= 0:
                    request.send_error(503, f"step {step} was not offered within {self.timeout:g} s: timed out")
                    return
                self._changed.wait(left)
            offer = self._offer
            if offer.step != step:
                request.send_error(409, f"serving step {offer.step}, not step {step}")
                return
            self._active += 1
        try:
            request.send_response(200)
            request.send_header("Content-Type", "application/octet-stream")
            request.end_headers()
            request.close_connection = True
            peer = "{}:{}".format(*request.client_address[:2])
            channel = StreamChannel(peer=peer, write=request.wfile.write)
            channel.send(json.dumps(dict(offer.info), sort_keys=True).encode("utf-8"), dst=1, tag=TAG)
            manifest = parse_manifest(offer.manifest_bytes)
            records = {f.path: f for f in manifest.files}
            source: Any = _CheckedSource(offer.source, records)
            sent = send_files(
                channel, dst=1, tag=TAG, source=source, manifest_bytes=offer.manifest_bytes, paths=list(records)
            )
            with self._changed:
                self.transfers += 1
                self.bytes_sent += sent
        except DigestMismatchError as exc:
            log.error("heal server: the offer of step %d is damaged and was not sent: %s", step, exc)
            if offer.on_damaged is not None:
                offer.on_damaged(exc)
        except CheckpointError as exc:
            log.warning("heal server: the transfer of step %d to %s failed: %s", step, request.client_address, exc)
        finally:
            with self._changed:
                self._active -= 1
                self._changed.notify_all()
