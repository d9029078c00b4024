"""A read-only store over several directories that each hold some files of one checkpoint.

A checkpoint of a job spanning several nodes lies in pieces after a failure: this node's slot holds its
ranks' files, a peer copy the files of another node, a directory the files fetched from elsewhere. The
overlay answers each path from one directory that has it, so the ordinary reader reads (and verifies)
the checkpoint as one; it never writes, and it records where each file it read came from.

Which directory answers: a path can be in several (a stale file a slot kept after a change of placement, a
rotted one, beside a good peer copy). Given ``sizes`` (the caller's manifest's), the first layer that lists the
path at that size answers, so a copy of the wrong size never hides one of the right size. Bytes of the right
size can still be wrong, and only the digests, which the reader checks and the store never sees, tell: a
caller that finds a file bad asks :meth:`OverlayStore.fall_back` for the next copy and reads again.
"""

from __future__ import annotations

import builtins
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import MissingFileError, UsageError
from .base import DEFAULT_MAX_READ, Capabilities, OutputFile, RangeReader, Store


@dataclass(frozen=True, slots=True)
class _Copy:
    label: str
    store: Store
    layer: int  # its index in ``layers``


class OverlayStore(Store):
    """``layers``: (label, store) pairs. Each path is answered by the first layer that lists it at ``sizes[path]``
    (when given), else by the first that lists it; :meth:`fall_back` moves it on to the next layer holding it.
    Only the paths listed when the overlay was made are answered."""

    def __init__(self, layers: Sequence[tuple[str, Store]], *, sizes: Mapping[str, int] | None = None) -> None:
        if not layers:
            raise UsageError("an overlay needs at least one store")
        self.layers = builtins.list(layers)
        self.url = layers[0][1].url
        self.capabilities = Capabilities(
            exclusive_create=False, local=all(s.capabilities.local for _, s in self.layers)
        )
        listed: dict[str, builtins.list[tuple[int, _Copy]]] = {}
        for index, (label, store) in enumerate(self.layers):
            for path, size in store.list().items():
                listed.setdefault(path, []).append((size, _Copy(label, store, index)))
        want = sizes or {}
        # sort is stable: among the copies of the expected size (or among all, without one), layer order decides
        self._copies: dict[str, builtins.list[_Copy]] = {
            path: [c for _, c in sorted(found, key=lambda sc: path in want and sc[0] != want[path])]
            for path, found in listed.items()
        }
        self.sources: dict[str, str] = {}  # path -> label of the layer it was read from

    def _layer(self, path: str) -> Store:
        copies = self._copies.get(path)
        if not copies:
            raise MissingFileError("held by none of the directories read", path=path)
        self.sources[path] = copies[0].label
        return copies[0].store

    def fall_back(self, path: str) -> str | None:
        """Answer ``path`` from the next layer that holds it, the current copy having been found bad by whoever
        checked its digests; that layer's label, or None when no other holds it (the current one still answers)."""
        copies = self._copies.get(path, [])
        if len(copies) < 2:
            return None
        del copies[0]
        return copies[0].label

    def holders(self, path: str) -> builtins.list[str]:
        """The labels of the layers holding ``path``, the one answering first."""
        return [c.label for c in self._copies.get(path, [])]

    def create(self, path: str) -> OutputFile:
        raise UsageError("an overlay is read-only", path=path)

    def put_exclusive(self, path: str, data: bytes) -> None:
        raise UsageError("an overlay is read-only", path=path)

    def read(self, path: str, *, max_size: int = DEFAULT_MAX_READ) -> bytes:
        return self._layer(path).read(path, max_size=max_size)

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        self._layer(path).read_into(path, begin, out)

    def read_ranges(self, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        self._layer(path).read_ranges(path, requests, keep_cached=keep_cached)

    def reader(self, path: str) -> RangeReader:
        return self._layer(path).reader(path)

    def drop_cached(self, path: str, begin: int, end: int) -> None:
        self._layer(path).drop_cached(path, begin, end)

    def mapping(self, path: str) -> mmap.mmap | None:
        return self._layer(path).mapping(path)

    def size(self, path: str) -> int:
        return self._layer(path).size(path)

    def exists(self, path: str) -> bool:
        return path in self._copies

    def list(self) -> dict[str, int]:
        """Each path with its size in the layer that answers for it, as that layer lists it now."""
        now: dict[int, dict[str, int]] = {}
        out: dict[str, int] = {}
        for path, copies in self._copies.items():
            first = copies[0]
            if first.layer not in now:
                now[first.layer] = first.store.list()
            if path in now[first.layer]:
                out[path] = now[first.layer][path]
        return out

    def delete(self, path: str) -> None:
        raise UsageError("an overlay is read-only", path=path)

    def pending_uploads(self) -> builtins.list[tuple[str, str]]:
        return []

    def close(self) -> None:
        for _, store in self.layers:
            store.close()
