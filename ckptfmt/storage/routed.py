"""A read-only view of a checkpoint root that also answers for the files of the checkpoints it references.

A referencing checkpoint addresses a base's file by its virtual path ``../<name>/<path>`` (ckptfmt/references.py).
This store sends such a path to the base's store, which ``open_base`` hands over once the base has been checked
(its identity is the reader's business, not storage's); every other path goes to the checkpoint's own store.
"""

from __future__ import annotations

import builtins
import dataclasses
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import CheckpointError, UsageError
from .base import DEFAULT_MAX_READ, OutputFile, RangeReader, Store

PARENT = "../"
T = TypeVar("T")


class RoutedStore(Store):
    def __init__(self, own: Store, open_base: Callable[[str], Store]) -> None:
        self.own = own
        self.url = own.url
        self.capabilities = dataclasses.replace(own.capabilities, references=True)
        self._open_base = open_base
        self._bases: dict[str, Store] = {}
        self._lock = threading.Lock()

    def base(self, location: str) -> Store:
        """The store of the base at ``location`` (``../<name>``), opened (and checked) on first use."""
        with self._lock:  # the base is checked once, by one thread, before any of its bytes is read
            store = self._bases.get(location)
            if store is None:
                store = self._bases[location] = self._open_base(location)
        return store

    def _route(self, path: str) -> tuple[Store, str]:
        if not path.startswith(PARENT):
            return self.own, path
        name, _, rest = path[len(PARENT) :].partition("/")
        return self.base(PARENT + name), rest

    def _on(self, path: str, call: Callable[[Store, str], T]) -> T:
        """``call`` on the store that holds ``path``; an error names the path as this checkpoint knows it."""
        store, rest = self._route(path)
        try:
            return call(store, rest)
        except CheckpointError as exc:
            if store is not self.own and exc.path == rest:
                exc.path = path  # "../step-1/weights/...", not the base's own name for it
                exc.args = (exc._render(),)
            raise

    def create(self, path: str) -> OutputFile:
        raise UsageError("a checkpoint is read-only here", path=path)

    def put_exclusive(self, path: str, data: bytes) -> None:
        raise UsageError("a checkpoint is read-only here", path=path)

    def read(self, path: str, *, max_size: int = DEFAULT_MAX_READ) -> bytes:
        return self._on(path, lambda store, rest: store.read(rest, max_size=max_size))

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        self._on(path, lambda store, rest: store.read_into(rest, begin, out))

    def read_ranges(self, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        self._on(path, lambda store, rest: store.read_ranges(rest, requests, keep_cached=keep_cached))

    def reader(self, path: str) -> RangeReader:
        # the checkpoint's own files keep their store's reader; a base's go through read_ranges, which names
        # them as this checkpoint knows them when they fail
        return self.own.reader(path) if not path.startswith(PARENT) else RangeReader(self, path)

    def drop_cached(self, path: str, begin: int, end: int) -> None:
        self._on(path, lambda store, rest: store.drop_cached(rest, begin, end))

    def mapping(self, path: str) -> mmap.mmap | None:
        return self._on(path, lambda store, rest: store.mapping(rest))

    def size(self, path: str) -> int:
        return self._on(path, lambda store, rest: store.size(rest))

    def exists(self, path: str) -> bool:
        return self._on(path, lambda store, rest: store.exists(rest))

    def list(self) -> dict[str, int]:
        return self.own.list()

    def sibling(self, name: str) -> Store:
        return self.own.sibling(name)

    def delete(self, path: str) -> None:
        raise UsageError("a checkpoint is read-only here", path=path)

    def pending_uploads(self) -> builtins.list[tuple[str, str]]:
        return []

    def close(self) -> None:
        self.own.close()
        with self._lock:
            bases, self._bases = list(self._bases.values()), {}
        for store in bases:
            store.close()
