"""Deterministic edits of a checkpoint written by the reference writer, the raw material of the vectors.

A :class:`Tree` is a checkpoint directory. Edits keep the manifest consistent with the files unless
told otherwise: rewriting a file refreshes its ``size`` and ``digest`` (same algorithm as before),
and rewriting a data file's header shifts the ``range`` of its chunks, so that a vector breaks the
one rule it is about and is not caught first by a size or digest check.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ckptfmt.canonical import manifest_bytes
from ckptfmt.tree_digests import file_digest_of

MANIFEST = "manifest.json"
Json = Any  # a parsed manifest: nested dicts and lists


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root

    # -- manifest

    def manifest(self) -> Json:
        return json.loads((self.root / MANIFEST).read_bytes())

    def set_manifest(self, doc: Json) -> None:
        (self.root / MANIFEST).write_bytes(manifest_bytes(doc))

    def raw_manifest(self) -> bytes:
        return (self.root / MANIFEST).read_bytes()

    def set_raw_manifest(self, data: bytes) -> None:
        (self.root / MANIFEST).write_bytes(data)

    def edit(self, fn: Callable[[Json], object]) -> None:
        doc = self.manifest()
        fn(doc)
        self.set_manifest(doc)

    def chunks(self, doc: Json, path: str) -> Iterator[Json]:
        """Every chunk record of ``doc`` stored in the data file ``path`` of this checkpoint: not a referenced chunk,
        whose ``path`` is a file of its base (spec/references.md)."""
        for field in doc["fields"].values():
            for tensor in field.get("tensors", {}).values():
                for chunk in tensor["chunks"]:
                    if chunk["path"] == path and "base" not in chunk:
                        yield chunk

    # -- files

    def read(self, path: str) -> bytes:
        return (self.root / path).read_bytes()

    def write(self, path: str, data: bytes, *, refresh: bool = True) -> None:
        """Replace a file's bytes; with ``refresh``, its file record gets the new size and digest."""
        (self.root / path).write_bytes(data)
        if refresh:
            self.refresh(path)

    def refresh(self, path: str) -> None:
        data = self.read(path)

        def fix(doc: Json) -> None:
            for record in doc["files"]:
                if record["path"] == path:
                    algorithm = record["digest"].partition(":")[0]
                    record["size"] = len(data)
                    record["digest"] = file_digest_of(algorithm, data)

        self.edit(fix)

    def move(self, old: str, new: str) -> None:
        """Rename a file and every reference to it; ``files`` stays sorted."""
        target = self.root / new
        target.parent.mkdir(parents=True, exist_ok=True)
        (self.root / old).rename(target)
        parent = (self.root / old).parent
        while parent != self.root and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

        def fix(doc: Json) -> None:
            for record in doc["files"]:
                if record["path"] == old:
                    record["path"] = new
            doc["files"].sort(key=lambda r: r["path"])
            for chunk in self.chunks(doc, old):
                chunk["path"] = new
            for field in doc["fields"].values():
                if field.get("context", {}).get("path") == old:
                    field["context"]["path"] = new

        self.edit(fix)

    def remove(self, path: str) -> None:
        target = self.root / path
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()

    # -- safetensors data files

    def split_data_file(self, path: str) -> tuple[bytes, bytes]:
        """(header text without padding, data section) of a data file."""
        data = self.read(path)
        (length,) = struct.unpack("<Q", data[:8])
        return data[8 : 8 + length].rstrip(b" "), data[8 + length :]

    def header(self, path: str) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.split_data_file(path)[0])
        return parsed

    def rewrite_data_file(
        self,
        path: str,
        *,
        header: Callable[[dict[str, Any]], object] | None = None,
        raw_header: Callable[[bytes], bytes] | None = None,
        append: bytes = b"",
        pad: int = 0,
        length: int | None = None,
    ) -> None:
        """Rebuild a data file with an edited header (as a dict, or as raw text) and extra data bytes.

        The header is re-padded with spaces to the 8-byte alignment plus ``pad`` spaces, ``length``
        (if given) is written as the header length instead of the real one, chunk ranges move with
        the data section, and the file record is refreshed.
        """
        text, data = self.split_data_file(path)
        if header is not None:
            table = json.loads(text)
            header(table)
            text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
        if raw_header is not None:
            text = raw_header(text)
        text += b" " * ((-(8 + len(text)) % 8) + pad)
        old_start = self._data_start(path)
        new_start = 8 + len(text)
        prefix = struct.pack("<Q", len(text) if length is None else length)
        self.write(path, prefix + text + data + append, refresh=False)
        shift = new_start - old_start

        def fix(doc: Json) -> None:
            for chunk in self.chunks(doc, path):
                chunk["range"] = [chunk["range"][0] + shift, chunk["range"][1] + shift]

        self.edit(fix)
        self.refresh(path)

    def _data_start(self, path: str) -> int:
        (length,) = struct.unpack("<Q", self.read(path)[:8])
        return 8 + int(length)

    def data_end(self, path: str) -> int:
        """The end of the data section relative to its start: where an appended entry begins."""
        return len(self.read(path)) - self._data_start(path)
