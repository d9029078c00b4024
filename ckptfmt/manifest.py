"""The manifest's records: the checkpoint's table of contents as frozen dataclasses (spec/manifest.md).

Each record writes its on-disk form with ``to_dict``; :meth:`Manifest.to_bytes` is the manifest file's
canonical bytes and :func:`checkpoint_id` their id. Reading and validating those bytes is
:mod:`ckptfmt.manifest_parse`: records are built by every writer, the parser only by readers, and keeping
the two apart keeps each small enough to read in one sitting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from . import dtypes
from .blocks import Blocks, BlocksDict
from .canonical import manifest_bytes
from .digests import DEFAULT_ALGORITHM, is_tree
from .references import BaseRecord, extension_dict, virtual_path

FORMAT_NAME = "ckptfmt"
FORMAT_MAJOR = 1
FORMAT_MINOR = 3  # each release adds conformance/golden/<version> (tests/test_golden.py)
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
RAW_VERSION = f"{FORMAT_MAJOR}.0"  # VER-1: what a checkpoint whose chunks are all raw says (a valid 1.0 one)
ENCODED_VERSION = f"{FORMAT_MAJOR}.1"  # VER-1: what a checkpoint with an encoded chunk says (spec/codecs.md)
BLOCKS_VERSION = f"{FORMAT_MAJOR}.2"  # VER-1: what a checkpoint with block digests says (spec/blocks.md)
DELTA_VERSION = f"{FORMAT_MAJOR}.3"  # DLT-7: what a checkpoint with an xor-zstd chunk says (spec/delta.md)
TREE_VERSION = f"{FORMAT_MAJOR}.3"  # VER-1: what a checkpoint with a tree digest says (spec/tree-digests.md)
MAX_MANIFEST_BYTES = 256 << 20
RAW = "raw"

FieldKind = Literal["tensors", "context"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FileRecord:
    path: str
    size: int
    digest: str

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "digest": self.digest}


class _CodecRequired(TypedDict):
    name: str


class CodecDict(_CodecRequired, total=False):  # (not NotRequired: Python 3.10 has no typing.NotRequired)
    """A chunk's ``codec`` member on disk."""

    configuration: Mapping[str, object]


@dataclass(frozen=True, slots=True, kw_only=True)
class Codec:
    name: str = RAW
    configuration: Mapping[str, object] | None = None

    def to_dict(self) -> CodecDict:
        out: CodecDict = {"name": self.name}
        if self.configuration is not None:
            out["configuration"] = dict(self.configuration)
        return out

    @classmethod
    def from_dict(cls, doc: CodecDict) -> Codec:
        if doc["name"] == RAW and "configuration" not in doc:
            return RAW_CODEC
        return cls(name=doc["name"], configuration=doc.get("configuration"))


RAW_CODEC = Codec()


class _ChunkRequired(TypedDict):
    path: str  # in the base, for a referenced chunk
    key: str
    offsets: list[int]
    shape: list[int]
    range: list[int]  # [begin, end]
    digest: str
    codec: CodecDict


class ChunkDict(_ChunkRequired, total=False):
    """A chunk record on disk (spec/tensors.md): the one definition of its members. :class:`ChunkRecord`
    writes and reads it, the parser derives the members it knows from it, and a rank's result carries it."""

    blocks: BlocksDict  # format 1.2 (spec/blocks.md)
    base: str  # a referenced chunk (spec/references.md)


CHUNK_MEMBERS: frozenset[str] = ChunkDict.__required_keys__
CHUNK_OPTIONAL_MEMBERS: frozenset[str] = ChunkDict.__optional_keys__


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRecord:
    path: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    begin: int
    end: int
    digest: str
    codec: Codec = RAW_CODEC
    blocks: Blocks | None = None  # a digest per block of the stored bytes (spec/blocks.md)
    # A chunk stored in another checkpoint (spec/references.md): its location, "../<name>"; ``path`` is then
    # the virtual "<location>/<path in the base>", the key every reader of this checkpoint addresses it by.
    base: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def stored_path(self) -> str:
        """The path as the manifest writes it: in the base, for a referenced chunk."""
        return self.path if self.base is None else self.path[len(self.base) + 1 :]

    def to_dict(self) -> ChunkDict:
        out: ChunkDict = {
            "path": self.stored_path,
            "key": self.key,
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "range": [self.begin, self.end],
            "digest": self.digest,
            "codec": self.codec.to_dict(),
        }
        if self.blocks is not None:
            out["blocks"] = self.blocks.to_dict()
        if self.base is not None:
            out["base"] = self.base
        return out

    @classmethod
    def from_dict(cls, doc: ChunkDict) -> ChunkRecord:
        """The record of a chunk whose members are known to be well-formed: checked by the parser (which
        refuses the rest), or written by this library (a rank's result). The inverse of :meth:`to_dict`."""
        base = doc.get("base")
        begin, end = doc["range"]
        blocks = doc.get("blocks")
        return cls(
            path=doc["path"] if base is None else virtual_path(base, doc["path"]),
            key=doc["key"],
            offsets=tuple(doc["offsets"]),
            shape=tuple(doc["shape"]),
            begin=begin,
            end=end,
            digest=doc["digest"],
            codec=Codec.from_dict(doc["codec"]),
            blocks=None if blocks is None else Blocks.from_dict(blocks),
            base=base,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRecord:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * dtypes.itemsize(self.dtype)

    def to_dict(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_dict() for c in self.chunks]}


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldRecord:
    kind: FieldKind
    tensors: Mapping[str, TensorRecord] = field(default_factory=dict)
    context: str | None = None  # path of the context blob

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind}
        if self.kind == "tensors":
            out["tensors"] = {name: t.to_dict() for name, t in self.tensors.items()}
        if self.context is not None:
            out["context"] = {"path": self.context}
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Extension:
    name: str
    must_understand: bool
    configuration: Mapping[str, object] | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "must_understand": self.must_understand}
        if self.configuration is not None:
            out["configuration"] = dict(self.configuration)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    profile: str
    files: tuple[FileRecord, ...]
    fields: Mapping[str, FieldRecord]
    format_version: str = RAW_VERSION
    extensions: tuple[Extension, ...] = ()  # every extension but the references, which ``bases`` holds
    metadata: Mapping[str, str] = field(default_factory=dict)
    bases: tuple[BaseRecord, ...] = ()  # checkpoints this one references chunks of (spec/references.md)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "profile": self.profile,
            "files": [f.to_dict() for f in self.files],
            "fields": {name: f.to_dict() for name, f in self.fields.items()},
        }
        extensions = ([extension_dict(self.bases)] if self.bases else []) + [e.to_dict() for e in self.extensions]
        if extensions:
            out["extensions"] = extensions
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    def to_bytes(self) -> bytes:
        return manifest_bytes(self.to_dict())

    def file(self, path: str) -> FileRecord:
        for record in self.files:
            if record.path == path:
                return record
        raise KeyError(path)

    @property
    def digest_algorithm(self) -> str:
        """The algorithm its writer was asked for: its data files' tree one if any (its context blobs are then flat,
        spec/tree-digests.md), else its first file's; the default for a manifest without files."""
        found = [f.digest.partition(":")[0] for f in self.files]
        return next((a for a in found if is_tree(a)), found[0] if found else DEFAULT_ALGORITHM)

    @property
    def total_bytes(self) -> int:
        """The bytes of the checkpoint's own files (not those of the bases it references)."""
        return sum(f.size for f in self.files)

    @property
    def referenced_files(self) -> tuple[FileRecord, ...]:
        """The base files referenced chunks live in, under their virtual paths (``../<name>/<path>``)."""
        return tuple(
            FileRecord(path=b.virtual(f.path), size=f.size, digest=f.digest) for b in self.bases for f in b.files
        )

    @property
    def referenced_bytes(self) -> int:
        """The stored bytes of the chunks this checkpoint references instead of storing."""
        return sum(c.nbytes for f in self.fields.values() for t in f.tensors.values() for c in t.chunks if c.base)


def checkpoint_id(data: bytes) -> str:
    """The checkpoint id: sha256 of the manifest's bytes, as written."""
    return "sha256:" + hashlib.sha256(data).hexdigest()
