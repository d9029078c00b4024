"""The checks a data file passes before any byte of it is used: its size (MAN-19) and its safetensors header
against the manifest (SAF-2..13). Shared by reads and verification; each file is checked once per open."""

from __future__ import annotations

import threading

from .errors import CheckpointError, SafetensorsHeaderError, SizeMismatchError
from .manifest import RAW, ChunkRecord, Manifest
from .safetensors_io import header_length, parse_header
from .storage import Store


class FileChecks:
    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self._sizes = {f.path: f.size for f in (*manifest.files, *manifest.referenced_files)}
        self._checked: set[str] = set()
        self._lock = threading.Lock()
        self._chunks_by_file: dict[str, list[tuple[str, str, ChunkRecord]]] | None = None

    def chunks_in(self, path: str) -> list[tuple[str, str, ChunkRecord]]:
        """(field, tensor, chunk) of every chunk the manifest places in data file ``path``."""
        if self._chunks_by_file is None:
            index: dict[str, list[tuple[str, str, ChunkRecord]]] = {}
            for fname, record in self.manifest.fields.items():
                for tname, tensor in record.tensors.items():
                    for chunk in tensor.chunks:
                        index.setdefault(chunk.path, []).append((fname, tname, chunk))
            self._chunks_by_file = index
        return self._chunks_by_file.get(path, [])

    def header_span(self, path: str, size: int) -> int:
        """The bytes of a data file its header should fill: up to where the manifest's first chunk begins."""
        return min(max(min((c.begin for _, _, c in self.chunks_in(path)), default=8), 8), size)

    def header_problems(self, path: str, size: int, head: bytearray | None = None) -> list[CheckpointError]:
        """Parse a data file's safetensors header (SAF-2..12) and compare it with the manifest (SAF-13).

        One ranged read (none if the caller fetched ``head``, the first :meth:`header_span` bytes, already):
        the manifest's first chunk begins where the header ends. Raises for a malformed header; returns one
        error per chunk the header contradicts.
        """
        placed = self.chunks_in(path)
        if head is None:
            head = bytearray(self.header_span(path, size))
            self.store.read_into(path, 0, memoryview(head))
        length = header_length(bytes(head[:8]), size, path)
        if len(head) < 8 + length:  # the manifest's hint was short (a file that disagrees with it)
            head = bytearray(8 + length)
            self.store.read_into(path, 0, memoryview(head))
        entries = parse_header(bytes(head[8 : 8 + length]), size, path)
        problems: list[CheckpointError] = []
        for fname, tname, chunk in placed:
            entry = entries.get(chunk.key)
            dtype = self.manifest.fields[fname].tensors[tname].dtype
            shape = chunk.shape
            if entry is not None and chunk.codec.name != RAW:
                # SAF-13 compares only the range of an encoded chunk (a U8 entry, COD-1): a codec this reader
                # does not know then refuses its tensor alone (TEN-14), never the file.
                dtype, shape = entry.dtype, entry.shape
            if entry is None:
                message = f"key {chunk.key!r} is not in the header"
            elif (entry.dtype, entry.shape, entry.begin, entry.end) != (dtype, shape, chunk.begin, chunk.end):
                message = (
                    f"header says {entry.dtype}{list(entry.shape)} at [{entry.begin}, {entry.end}), manifest says "
                    f"{dtype}{list(shape)} at [{chunk.begin}, {chunk.end})"
                )
            else:
                continue
            problems.append(SafetensorsHeaderError(message, path=path, field=fname, tensor=tname, requirement="SAF-13"))
        return problems

    def check(self, path: str, head: bytearray | None = None) -> None:
        """Before the first read from a data file: its size (MAN-19) and header (SAF-2..13); once per open."""
        with self._lock:
            if path in self._checked:
                return
        actual = self.check_size(path)
        problems = self.header_problems(path, actual, head)
        if problems:
            raise problems[0]
        with self._lock:
            self._checked.add(path)

    def checked(self, path: str) -> bool:
        with self._lock:
            return path in self._checked

    def check_size(self, path: str) -> int:
        actual = self.store.size(path)
        expected = self._sizes[path]
        if actual != expected:
            raise SizeMismatchError(
                f"file has {actual} bytes, manifest says {expected}", path=path, requirement="MAN-19"
            )
        return actual
