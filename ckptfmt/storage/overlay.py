"""A read-only store over several directories that each hold some files of one checkpoint.

A checkpoint of a job spanning several nodes lies in pieces after a failure: this node's slot holds its
ranks' files, a peer copy the files of another node, a directory the files fetched from elsewhere. The
overlay answers each path from the first directory that has it, so the ordinary reader reads (and verifies)
the checkpoint as one; it never writes, and it records where each file it read came from.
"""

from __future__ import annotations

import builtins
import mmap
from collections.abc import Sequence

from ..errors import MissingFileError, UsageError
from .base import DEFAULT_MAX_READ, Capabilities, OutputFile, RangeReader, Store


class OverlayStore(Store):
    """``layers``: (label, store) pairs, the first that lists a path answers for it."""

    def __init__(self, layers: Sequence[tuple[str, Store]]) -> None:
        if not layers:
            raise UsageError("an overlay needs at least one store")
        self.layers = list(layers)
        self.url = layers[0][1].url
        self.capabilities = Capabilities(
            exclusive_create=False, local=all(s.capabilities.local for _, s in self.layers)
        )
        self._where: dict[str, tuple[str, Store]] = {}
        for label, store in self.layers:
            for path in store.list():
                self._where.setdefault(path, (label, store))
        self.sources: dict[str, str] = {}  # path -> label of the layer it was read from

    def _layer(self, path: str) -> Store:
        found = self._where.get(path)
        if found is None:
            raise MissingFileError("held by none of the directories read", path=path)
        self.sources[path] = found[0]
        return found[1]

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
        return path in self._where

    def list(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, store in reversed(self.layers):
            out.update(store.list())
        return out

    def delete(self, path: str) -> None:
        raise UsageError("an overlay is read-only", path=path)

    def pending_uploads(self) -> builtins.list[tuple[str, str]]:
        return []

    def close(self) -> None:
        for _, store in self.layers:
            store.close()
