"""Reading a PyTorch Distributed Checkpoint's ``.metadata`` without trusting it.

torch's own reader calls ``pickle.load`` on it: a downloaded checkpoint could run any code.
:class:`MetadataUnpickler` resolves only the globals DCP metadata is made of (its dataclasses, a
memory-format enum, ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths) and refuses every
other one before it is imported or called, so a payload never runs. The result is then checked
for the shape the converter relies on: dtype, size and chunks of each tensor, and for each stored
item a plain file name, an offset and a length.
"""

from __future__ import annotations

import importlib
import io
import pickle
from dataclasses import dataclass
from typing import Any

from ..errors import SourceFormatError

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 256 << 20

_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[str, frozenset[str]] = {
    _DCP: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties"}),  # torch < 2.1
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """Admits the DCP metadata classes and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and "." not in name:
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise SourceFormatError(
            f"refused to unpickle {module}.{name}: only DCP metadata classes may appear in .metadata "
            "(this file may be malicious)",
            path=METADATA_NAME,
        )

    def persistent_load(self, pid: object) -> Any:
        raise SourceFormatError("refused: persistent ids do not belong in DCP metadata", path=METADATA_NAME)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredItem:
    """Where one tensor chunk or one byte blob lives: ``relative_path[offset:offset+length]``."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkInfo:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: StoredItem


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    dtype: Any  # torch.dtype
    size: tuple[int, ...]
    chunks: tuple[ChunkInfo, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpMetadata:
    tensors: dict[str, TensorInfo]
    blobs: dict[str, StoredItem]  # non-tensor values (torch.save'd bytes)
    version: str | None


def _fail(message: str) -> SourceFormatError:
    return SourceFormatError(message, path=METADATA_NAME)


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _fail(f"{what} must be non-negative integers, got {value!r}")
    return tuple(value)


def _stored(info: object, fqn: str) -> StoredItem:
    path = getattr(info, "relative_path", None)
    offset = getattr(info, "offset", None)
    length = getattr(info, "length", None)
    if not isinstance(path, str) or not path or "/" in path or "\\" in path or path in (".", "..") or ":" in path:
        raise _fail(f"{fqn!r} is stored in {path!r}, which is not a plain file name in the checkpoint directory")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise _fail(f"{fqn!r} has an invalid offset/length {offset!r}/{length!r}")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise _fail(f"{fqn!r} is stored with transforms {transforms!r}, which are not supported")
    return StoredItem(relative_path=path, offset=offset, length=length)


def parse_metadata(data: bytes) -> DcpMetadata:
    """Unpickle (restricted) and validate ``.metadata`` bytes."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    if len(data) > MAX_METADATA_BYTES:
        raise _fail(f"{len(data)} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        md = MetadataUnpickler(io.BytesIO(data)).load()
    except SourceFormatError:
        raise
    except Exception as exc:  # a malformed pickle can raise almost anything; none of it may escape raw
        raise _fail(f"not a readable DCP metadata pickle: {type(exc).__name__}: {exc}") from exc
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise _fail(f"holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.storage_data, dict):
        raise _fail("has no storage_data: written by a storage writer other than the file system one")
    where: dict[tuple[str, tuple[int, ...] | None], StoredItem] = {}
    for index, info in md.storage_data.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(fqn, str):
            raise _fail(f"storage_data key {index!r} has no fqn")
        offset = getattr(index, "offset", None)
        where[(fqn, None if offset is None else _ints(offset, f"{fqn!r} offset"))] = _stored(info, fqn)
    tensors: dict[str, TensorInfo] = {}
    blobs: dict[str, StoredItem] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            if (fqn, None) not in where:
                raise _fail(f"{fqn!r} has no stored bytes")
            blobs[fqn] = where[(fqn, None)]
        elif isinstance(meta, TensorStorageMetadata):
            size = _ints(meta.size, f"{fqn!r} size")
            chunks = []
            for chunk in meta.chunks:
                offsets = _ints(chunk.offsets, f"{fqn!r} chunk offsets")
                sizes = _ints(chunk.sizes, f"{fqn!r} chunk sizes")
                if (fqn, offsets) not in where:
                    raise _fail(f"{fqn!r} chunk at {list(offsets)} has no stored bytes")
                chunks.append(ChunkInfo(offsets=offsets, sizes=sizes, item=where[(fqn, offsets)]))
            tensors[fqn] = TensorInfo(dtype=meta.properties.dtype, size=size, chunks=tuple(chunks))
        else:
            raise _fail(f"{fqn!r} has metadata of type {type(meta).__name__}")
    version = getattr(md, "version", None)
    return DcpMetadata(tensors=tensors, blobs=blobs, version=version if isinstance(version, str) else None)
