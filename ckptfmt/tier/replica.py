"""Replicas: each rank's files of a committed memory snapshot, copied to its partners on other nodes.

A **round** replicates one snapshot: every rank that has partners (:meth:`NodeMap.partners`: ``replicas`` of
them, on nodes of distinct failure domains, :mod:`.placement`) sends the files it wrote to each, and every rank
receives from the ranks that chose it, each transfer on a thread of its own, beside training. The copy lands in
the receiver's memory directory, beside its own slots, as
``peer-<source rank>-<k>`` (a ring of two per source, so the copy being written never replaces the newest one),
and counts only once every file arrived and checked and its manifest was written last (:mod:`.wire`).

Every rank takes part in the same rounds in the same order (the snapshot's writer decides them together, after
each commit): a round still running when the next snapshot commits makes every rank skip replicating that one,
so a slow partner costs a lagging replica, never a stalled step.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..collective import PeerChannel
from ..errors import CheckpointError, CollectiveError, MalformedMessageError, UnsafePathError
from ..jsonio import load_json
from ..manifest import FileRecord, checkpoint_id
from ..manifest_parse import parse_manifest
from ..paths import LOCK_NAME, MANIFEST_NAME
from ..storage.slot import SlotStore
from .holdings import PEER_PREFIX
from .link_rate import RateLimitedChannel
from .nodes import NodeMap
from .persist import lower_thread_priority
from .ring import MemoryTier, private_dir_problem
from .wire import HEADER_BYTES, ReplicaDropped, header_bound, receive_bounded, receive_files, send_files

log = logging.getLogger("ckptfmt")
ROUND_TAGS = 1 << 30  # rounds use tags below this; transfers at a restore, tags above
_HAVE = ROUND_TAGS // 2  # a round's have-lists travel on its tag plus this: a thread never receives another's message


DROPPED = "replica dropped"  # how a ReplicaDropped's message begins (the receiver's says which rank sent it)
ACK_BYTES = HEADER_BYTES  # an ack: {"ok", "error"}, the error cut at 2,000 characters (each JSON-escaped to <= 12 B)


def peer_dir(tier: MemoryTier, source: int, round_no: int) -> str:
    return os.path.join(tier.root, f"{PEER_PREFIX}{source:05d}-{round_no % 2}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """What one rank did in one round."""

    round_no: int
    step: int
    sent: int = 0  # bytes
    received: int = 0  # bytes
    committed: tuple[int, ...] = ()  # sources whose copy this rank committed


@dataclass(frozen=True, slots=True)
class RoundInFlight:
    """This rank's part of one replica round while it runs: its send to the partner and its receives from its
    sources, for the snapshot of ``step``."""

    round_no: int
    step: int
    sending: list[Future[int]]
    receiving: list[Future[int]]

    def done(self) -> bool:
        return all(f.done() for f in (*self.sending, *self.receiving))


class Replicator:
    """One rank's side of replication over ``channel`` (its own process group: rounds run beside training)."""

    def __init__(
        self, tier: MemoryTier, channel: PeerChannel, nodes: NodeMap, rank: int, *, rate: float | None = None
    ) -> None:
        """``rate``: bytes a second on each link this rank sends on (None: as fast as the channel goes)."""
        self.tier = tier
        self.channel: PeerChannel = channel if rate is None else RateLimitedChannel(channel, rate)
        self.rank = rank
        self.partners = nodes.partners().get(rank, ())
        self.sources = nodes.sources_of(rank)
        self._pool = ThreadPoolExecutor(
            max_workers=len(self.partners) + len(self.sources) or 1, thread_name_prefix="ckptfmt-replica"
        )
        self._round: RoundInFlight | None = None
        self._lock = threading.Lock()
        self.rounds = 0
        self.skipped = 0  # snapshots not replicated: the previous round was still running (every rank alike)
        self.dropped = 0  # rounds given up: their slot was rewritten before the copy was done
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last: RoundResult | None = None
        self.failures: list[str] = []
        self.skipped_bytes = 0  # not sent: the partner held them already (data-parallel replicas)
        self._replicated: int | None = None  # the newest step whose every copy of this rank's files is committed

    def replicated_step(self) -> int | None:
        """The newest step whose round this rank finished with every partner acknowledging its copy."""
        current = self._round
        done = current is not None and current.done() and all(f.exception() is None for f in current.sending)
        if done and current is not None and (self._replicated is None or current.step > self._replicated):
            self._replicated = current.step
        return self._replicated

    def busy(self) -> bool:
        """Whether this rank's part of the last round is still running."""
        current = self._round
        return current is not None and not current.done()

    def start(
        self,
        round_no: int,
        *,
        step: int,
        slot_path: str,
        manifest_bytes: bytes,
        files: list[str],
        local: Mapping[int, Sequence[FileRecord]] | None = None,
    ) -> None:
        """Begin this rank's part of round ``round_no`` (every rank calls it for the same rounds, in order).

        ``local``: for a source rank, files of its share this rank already wrote into that source's copy directory
        from its own identical state (data-parallel replicas, :meth:`local_dir`); those whose size and digest are
        the manifest's are not sent again."""
        tag = 1 + round_no % (_HAVE - 1)
        if self._round is not None:
            self.replicated_step()
            self.wait()  # done already (every rank agreed it was), but not yet accounted
        local = local or {}
        sending = [self._pool.submit(self._send, tag, dst, slot_path, manifest_bytes, files) for dst in self.partners]
        receiving = [
            self._pool.submit(self._receive, tag, src, round_no, manifest_bytes, local.get(src, ()))
            for src in self.sources
        ]
        self._round = RoundInFlight(round_no, step, sending, receiving)
        self.rounds += 1

    def _settle(self, round_no: int, step: int, sending: list[Future[int]], receiving: list[Future[int]]) -> None:
        with self._lock:
            if self.last is not None and self.last.round_no == round_no:
                return
            sent = sum(_value(f, self.failures, f"round {round_no} (step {step}): send") for f in sending)
            got = [_value(f, self.failures, f"round {round_no} (step {step}): receive") for f in receiving]
            self.bytes_sent += sent
            self.bytes_received += sum(got)
            committed = tuple(s for s, f in zip(self.sources, receiving, strict=True) if f.exception() is None)
            if any(_dropped(f) for f in (*sending, *receiving)):
                self.dropped += 1
            self.last = RoundResult(round_no=round_no, step=step, sent=sent, received=sum(got), committed=committed)

    def local_dir(self, src: int, round_no: int) -> str:
        """Where this rank writes, from its own state, the files of ``src``'s share that it holds identically."""
        path = peer_dir(self.tier, src, round_no)
        if private_dir_problem(path) == "absent":
            os.makedirs(path, mode=0o700, exist_ok=True)
        problem = private_dir_problem(path)
        if problem is not None:  # a sender's side then fails on its own (its group's timeout)
            raise UnsafePathError(f"peer copy directory refused: {problem}", path=path)
        return path

    def _send(self, tag: int, dst: int, slot_path: str, manifest_bytes: bytes, files: list[str]) -> int:
        """The partner ``dst`` first says which files it has already (written from its own identical state); the
        rest go. Each of a rank's partners gets its own send, on its own thread."""
        lower_thread_priority()
        listed = parse_manifest(manifest_bytes).files
        have = self._message(dst, tag + _HAVE, header_bound(len(listed)), "a have-list")
        if not isinstance(have, list) or not all(isinstance(p, str) for p in have):
            raise MalformedMessageError(f"rank {dst} sent a malformed have-list")
        held = set(have)
        self.skipped_bytes += sum(f.size for f in listed if f.path in held)
        source = SlotStore(slot_path)

        def rewritten() -> ReplicaDropped | None:
            """Why the slot can no longer be sent: a newer snapshot un-committed it to rewrite it."""
            try:
                same = source.read(MANIFEST_NAME, max_size=len(manifest_bytes) + 1) == manifest_bytes
            except CheckpointError:
                same = False
            return None if same else ReplicaDropped(f"{DROPPED}: its slot was rewritten by a newer snapshot")

        sent = send_files(
            self.channel,
            dst=dst,
            tag=tag,
            source=source,
            manifest_bytes=manifest_bytes,
            paths=[p for p in files if p not in held],
            still_valid=rewritten,
        )
        # The partner's word that the copy is committed: a send returns once gloo has the bytes, not once they are
        # in the partner's memory (a node killed right after its send could leave the copy cut off).
        ack = self._message(dst, tag + _HAVE, ACK_BYTES, "an ack")
        if not isinstance(ack, dict) or ack.get("ok") is not True:
            why = ack.get("error") if isinstance(ack, dict) else None
            raise rewritten() or CollectiveError(f"rank {dst} did not commit the copy: {why}")
        return sent

    def _message(self, src: int, tag: int, max_size: int, what: str) -> object:
        """The partner ``src``'s next JSON message on ``tag``: refused unread past ``max_size``, parsed by the
        bounded reader; either refusal names the partner."""
        data = receive_bounded(self.channel, src, tag, max_size, what)
        return load_json(data, error=MalformedMessageError, what=f"{what} from rank {src}")

    def _receive(self, tag: int, src: int, round_no: int, manifest_bytes: bytes, local: Sequence[FileRecord]) -> int:
        """One source's files into ``peer-<src>-<k>``: un-committed first, manifest written last. Files this rank
        wrote there from its own state count only where the manifest lists the same size and digest."""
        store = SlotStore(self.local_dir(src, round_no))
        store.delete(MANIFEST_NAME)  # un-commit before a byte changes (as MEM-5 for slots)
        files = parse_manifest(manifest_bytes).files
        listed = {(f.path, f.size, f.digest) for f in files}
        have = sorted(f.path for f in local if (f.path, f.size, f.digest) in listed)
        self.channel.send(json.dumps(have).encode("utf-8"), dst=src, tag=tag + _HAVE)
        try:
            # the sender names at most the files of this round's manifest
            received = receive_files(self.channel, src=src, tag=tag, destination=store, max_paths=len(files))
            if received.checkpoint_id != checkpoint_id(manifest_bytes):  # our files were checked against another
                raise CollectiveError(
                    f"rank {src} sent checkpoint {received.checkpoint_id}, not this round's", path=MANIFEST_NAME
                )
            keep = {f.path for f in received.files} | set(have)
            for stale in store.list():
                if stale not in keep and stale not in (MANIFEST_NAME, LOCK_NAME):
                    store.delete(stale)
            store.put_exclusive(MANIFEST_NAME, received.manifest_bytes)
        except CheckpointError as exc:
            self._ack(src, tag, str(exc))
            raise
        self._ack(src, tag, None)
        return received.nbytes

    def _ack(self, src: int, tag: int, error: str | None) -> None:
        """Tell the sender whether its copy is committed here (its round ends on it)."""
        doc = {"ok": True} if error is None else {"ok": False, "error": error[:2000]}
        try:
            self.channel.send(json.dumps(doc).encode("utf-8"), dst=src, tag=tag + _HAVE)
        except CheckpointError as exc:  # the sender is gone: its side fails on its own
            log.warning("replica of rank %d: the sender could not be told: %s", src, exc)

    def wait(self) -> RoundResult | None:
        """Block until this rank's part of the last round is done; failures are logged, never raised (a
        replica is a second copy: losing one costs protection against a node loss, not the run)."""
        current = self._round
        if current is not None:
            for future in (*current.sending, *current.receiving):
                try:
                    future.result()
                except Exception:
                    pass
            self._settle(current.round_no, current.step, current.sending, current.receiving)
        return self.last

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


def _dropped(future: Future[int]) -> bool:
    return isinstance(future.exception(), ReplicaDropped)


def _value(future: Future[int], failures: list[str], what: str) -> int:
    exc = future.exception()
    if exc is None:
        return future.result()
    if isinstance(exc, ReplicaDropped):
        log.info("replica %s: %s", what, exc)  # the partner lags: an older copy stays, the next round catches up
        return 0
    message = f"{what} failed: {type(exc).__name__}: {exc}"
    failures.append(message)
    log.warning("replica %s", message)
    return 0
