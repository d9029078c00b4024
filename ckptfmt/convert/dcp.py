"""PyTorch Distributed Checkpoint (DCP) directories, both directions, in a single process.

Reading never goes through torch's reader (which unpickles ``.metadata`` unrestricted): the
metadata is read by :mod:`.dcp_metadata`, and each stored item is the byte range
``file[offset:offset+length]`` of a ``*.distcp`` file holding one ``torch.save``'d tensor chunk or
value, loaded with ``torch.load(weights_only=True)``. Tensor chunks keep their DCP geometry (a
tensor saved by several ranks stays chunked the same way). Everything goes to the ``weights``
field under its DCP fully qualified name; non-tensor values become that field's context.
Writing calls ``torch.distributed.checkpoint.save`` with the field's tensors (and context values).
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np

from ..errors import SourceFormatError, UsageError
from .base import (
    ConvertResult,
    Location,
    NoProgress,
    Progress,
    exists,
    fs_call,
    locate,
    read_file,
    read_range,
    refuse_links,
)
from .dcp_metadata import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    ChunkInfo,
    DcpMetadata,
    StoredItem,
    TensorInfo,
    parse_metadata,
)
from .destination import staged_directory
from .torch_bridge import context_value, is_tensor, to_torch
from .weights import Chunk, SourceField, SourceTensor, WeightsSource, importer


def read_metadata(loc: Location) -> DcpMetadata:
    meta = loc.join(METADATA_NAME)
    if not exists(meta):
        raise SourceFormatError("no .metadata: not a DCP checkpoint (or an unfinished one)", path=loc.url)
    return parse_metadata(read_file(meta, MAX_METADATA_BYTES))


def load_item(loc: Location, item: StoredItem, fqn: str) -> Any:
    """One stored item, unpickled only as far as ``torch.load(weights_only=True)`` goes."""
    import torch

    data = read_range(loc.join(item.relative_path), item.offset, item.length)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise SourceFormatError(
            f"refused: {fqn!r} holds objects weights_only loading will not build", path=fqn
        ) from exc
    except Exception as exc:  # a damaged item fails inside torch's parser with whatever it raises (IndexError...)
        raise SourceFormatError(
            f"{fqn!r}: bytes [{item.offset}, {item.offset + item.length}) are not a torch.save'd value "
            f"(only DCP's default torch_save serialization is supported): {exc}",
            path=item.relative_path,
        ) from exc


def _chunk(loc: Location, fqn: str, info: TensorInfo, chunk: ChunkInfo) -> Any:
    """One stored chunk, refused unless it is the tensor the metadata says."""
    tensor = load_item(loc, chunk.item, fqn)
    if not is_tensor(tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != info.dtype:
        got = f"{getattr(tensor, 'dtype', type(tensor).__name__)}{list(getattr(tensor, 'shape', []))}"
        raise SourceFormatError(
            f"{fqn!r} chunk at {list(chunk.offsets)}: metadata says {info.dtype}{list(chunk.sizes)}, "
            f"stored value is {got}",
            path=chunk.item.relative_path,
        )
    return tensor


def read_dcp(loc: Location) -> WeightsSource:
    """The ``weights`` field of a DCP checkpoint: its tensors with their DCP geometry (each chunk read when
    written), its non-tensor values (read now) as the context."""
    md = read_metadata(loc)
    tensors = []
    for fqn, info in md.tensors.items():
        whole = len(info.chunks) == 1 and info.chunks[0].sizes == info.size
        chunks = [
            Chunk(
                read=partial(_chunk, loc, fqn, info, chunk),
                size=chunk.item.length,
                offsets=None if whole else chunk.offsets,
            )
            for chunk in info.chunks
        ]
        tensors.append(SourceTensor(name=fqn, chunks=chunks, shape=info.size))
    values = {fqn: context_value(load_item(loc, item, fqn), fqn) for fqn, item in md.blobs.items()}
    return WeightsSource(
        url=loc.url,
        fields={"weights": SourceField(tensors=tensors, context=values)},
        provenance={"dcp_version": md.version},
    )


import_dcp = importer("dcp", read_dcp)


def _plain(value: object, where: str) -> object:
    """A context value as torch.save can store it and weights_only loading can read it back."""
    if isinstance(value, np.ndarray):
        raise UsageError(f"context value {where!r} is an array; DCP export supports plain values only")
    if isinstance(value, Mapping):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{where}.{i}") for i, v in enumerate(value)]
    return value


def export_dcp(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    field: str = "weights",
    progress: Progress | None = None,
) -> ConvertResult:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    import ckptfmt

    progress = progress or NoProgress()
    out = locate(dst, storage_options)
    refuse_links(out)  # torch's writer would write through them
    if not overwrite and exists(out.join(METADATA_NAME)):
        raise ckptfmt.CheckpointExistsError("a DCP checkpoint is already here; pass --overwrite", path=out.url)
    result = ConvertResult(source=src, source_format="ckptfmt", destination=out.url, destination_format="dcp")
    with ckptfmt.open(src, storage_options) as ckpt:
        records = ckpt.field(field).tensors
        progress.start(sum(r.nbytes for r in records.values()))
        state: dict[str, object] = {}
        for name, record in records.items():
            state[name] = to_torch(ckpt.read_tensor(field, name), record.dtype)
            result.tensors += 1
            result.bytes += record.nbytes
            progress.advance(record.nbytes)
        if ckpt.has_context(field):
            for key, value in ckpt.read_context(field).items():
                if key in state:
                    raise UsageError(f"context key {key!r} has the name of a tensor", field=field)
                state[key] = _plain(value, key)
        other = [n for n, rec in ckpt.fields.items() if rec.kind == "tensors" and n != field]
        if other:
            result.notes.append(f"not exported (one state dict per DCP checkpoint): fields {', '.join(other)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        if out.is_local:
            # torch opens each ``.distcp`` with open(path, "wb"), through a hard link an old file of that name
            # may be to a file outside: it writes into a fresh directory, whose files replace the names here
            # (.metadata last, so it never lists data older than itself)
            with staged_directory(out, last=METADATA_NAME) as staging:
                save(state, checkpoint_id=staging)
        else:
            save(state, storage_writer=FsspecWriter(out.url, **dict(storage_options or {})))
    result.files = sorted(str(f).rstrip("/").rpartition("/")[2] for f in fs_call(out.url, out.fs.ls, out.path))
    return result
