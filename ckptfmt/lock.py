"""The writer lock, ``.writer-lock`` (spec/commit.md step 1): who holds a checkpoint root, and whether it is dead.

One rule serves the writer (may it take a stale lock over?) and garbage collection (may it delete
a root without a manifest?): a lock is dead only when its holder is known to be gone — a pid on
this host that no longer runs, or a lock this process abandoned because storage was unreachable.

Several writers may see one dead lock at once (a persist in the background and an operator's
``ckpt rescue``). Each takes it over only through :func:`takeover_marker`, a create-only name of
that one dead lock, so exactly one of them deletes it (commit.py ``Committer._take_over``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timezone

from .errors import CheckpointError
from .jsonio import load_json
from .paths import LOCK_NAME
from .storage import Store

MAX_LOCK_BYTES = 64 << 10  # a host name, a pid, a nonce and a time; anything larger is not a lock
MAX_PID = (1 << 31) - 1  # os.kill takes a C int; 0 and negative pids name process groups, never a writer

# Nonces of locks this process failed to remove while aborting (storage unreachable): their holder is
# known to be gone, so a later writer in this process may take them over.
_ABANDONED: set[str] = set()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterLock:
    host: str
    pid: int
    nonce: str
    started_at: str
    bases: tuple[str, ...] = ()  # the checkpoints (sibling names) the save references: gc keeps them (REF-13)

    @classmethod
    def mine(cls, bases: tuple[str, ...] = ()) -> WriterLock:
        return cls(
            host=socket.gethostname(), pid=os.getpid(), nonce=secrets.token_hex(8), started_at=_now(), bases=bases
        )

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {
            "host": self.host,
            "pid": self.pid,
            "nonce": self.nonce,
            "started_at": self.started_at,
        }
        if self.bases:
            doc["bases"] = list(self.bases)
        return json.dumps(doc, sort_keys=True).encode()

    def holder(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.started_at}"

    def holder_is_dead(self) -> bool:
        """Known gone: abandoned by this process, or a pid of this host that no longer runs."""
        if self.nonce in _ABANDONED:
            return True
        if self.host != socket.gethostname():
            return False
        if not 0 < self.pid <= MAX_PID:
            return False  # not a pid this host could have: unknown, so presumed live
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def age_seconds(self) -> float | None:
        """Seconds since ``started_at``; None when it is not a UTC ISO 8601 time (then the age is unknown)."""
        try:
            started = datetime.fromisoformat(self.started_at.replace("Z", "+00:00"))
        except ValueError:
            return None
        if started.utcoffset() is None:
            return None  # a time without a zone cannot be compared with now
        try:
            return (datetime.now(timezone.utc) - started).total_seconds()
        except OverflowError:
            return None

    def abandon(self) -> None:
        _ABANDONED.add(self.nonce)


def read_lock(store: Store, path: str = LOCK_NAME) -> WriterLock | None:
    """The lock at ``path``, or None when there is none or it cannot be read as a lock (not JSON, wrong
    types, a symlink or special file, too large): callers then presume its holder alive."""
    try:
        data = store.read(path, max_size=MAX_LOCK_BYTES)
        info = load_json(data, error=CheckpointError, what="writer lock", path=path)
    except CheckpointError:
        return None
    if not isinstance(info, dict):
        return None
    host, pid, nonce, started = info.get("host"), info.get("pid"), info.get("nonce"), info.get("started_at")
    if not (isinstance(host, str) and type(pid) is int and isinstance(nonce, str) and isinstance(started, str)):
        return None
    if not 0 < pid <= MAX_PID:
        return None
    bases = info.get("bases", [])
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        bases = []
    return WriterLock(host=host, pid=pid, nonce=nonce, started_at=started, bases=tuple(bases))


def takeover_marker(stale: WriterLock) -> str:
    """The file a writer creates (create-only) before it deletes the dead lock ``stale``: one name per dead lock,
    so of the writers that read it dead at once exactly one creates it and takes the lock over.

    Named by a digest of the lock's nonce (which is untrusted text, never part of a path), in the form of the
    lock's temp file (``..writer-lock.tmp-<12 hex>``, run.py ``writer_made``), so `ckpt gc` removes one that a
    taker killed halfway leaves behind.
    """
    digest = hashlib.sha256(stale.nonce.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f".{LOCK_NAME}.tmp-{digest}"
