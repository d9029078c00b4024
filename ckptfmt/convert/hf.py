"""Hugging Face safetensors checkpoints, both directions, without torch.

Layouts (as ``huggingface_hub.save_torch_state_dict`` writes them): a single ``model.safetensors``,
or shards ``model-00001-of-0000N.safetensors`` beside ``model.safetensors.index.json`` =
``{"metadata": {"total_size": N, ...}, "weight_map": {tensor: shard file}}``. Reading fetches each
tensor's byte range (headers checked as strictly as ckptfmt's own data files); writing streams one
tensor at a time, so memory stays at the largest tensor whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from functools import partial
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import CheckpointError, CheckpointExistsError, SourceFormatError
from ..jsonio import load_json
from ..safetensors_io import HeaderEntry, header_length, parse_header
from .base import (
    ConvertResult,
    Location,
    NoProgress,
    Progress,
    file_size,
    fs_call,
    list_names,
    locate,
    read_file,
    read_range,
)
from .destination import open_output, prepare_directory, write_output
from .weights import Chunk, SourceField, SourceTensor, WeightsSource, importer

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # huggingface_hub's "5GB"
MAX_INDEX_BYTES = 10 << 20  # huggingface_hub refuses larger indexes too


# ---------------------------------------------------------------- reading


def read_header(loc: Location) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """A shard's tensor entries (absolute byte ranges) and its ``__metadata__`` (strings to strings)."""
    size = file_size(loc)
    try:
        length = header_length(read_range(loc, 0, min(8, size)), size, loc.url)
        raw = read_range(loc, 8, length)
        entries = parse_header(raw, size, loc.url)
        doc = load_json(raw, error=SourceFormatError, what="safetensors header", path=loc.url, allow_float=True)
    except CheckpointError as exc:
        raise SourceFormatError(exc.message, path=loc.url) from exc
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    if meta is None:
        return entries, {}
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SourceFormatError("__metadata__ must map strings to strings", path=loc.url)
    return entries, meta


def _check_shard_name(name: object, index_url: str) -> str:
    if not isinstance(name, str) or not name.endswith(".safetensors"):
        raise SourceFormatError(f"weight_map names {name!r}, not a .safetensors file", path=index_url)
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or name.startswith(("/", "\\")) or ".." in parts or ":" in name:
        raise SourceFormatError(f"shard {name!r} is not a plain relative path", path=index_url)
    return name


def read_index(loc: Location) -> tuple[dict[str, str], dict[str, object]]:
    """(tensor -> shard file, the index's metadata), validated as huggingface_hub validates it."""
    data = read_file(loc, MAX_INDEX_BYTES)
    doc = load_json(data, error=SourceFormatError, what="index", path=loc.url, allow_float=True)
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise SourceFormatError("index must be a JSON object with a 'weight_map' object", path=loc.url)
    weight_map = {str(k): _check_shard_name(v, loc.url) for k, v in doc["weight_map"].items()}
    metadata = doc.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise SourceFormatError("index 'metadata' must be a JSON object", path=loc.url)
    return weight_map, dict(metadata or {})


def find_layout(loc: Location) -> tuple[Location, Location | None]:
    """(directory, index) or (single shard, None): from the directory, its index file, or a .safetensors file."""
    names = list_names(loc)
    if not names:
        if loc.path.endswith(".index.json"):
            # the index the user named; its shards are its siblings, the parent directory the source root
            parent = loc.parent()
            return parent, parent.join(loc.path.rstrip("/").rpartition("/")[2])
        if loc.path.endswith(".safetensors"):
            return loc, None
        raise SourceFormatError("not a .safetensors file, an index, or a directory holding them", path=loc.url)
    indexes = sorted(n for n in names if n.endswith(".safetensors.index.json"))
    if INDEX in indexes or len(indexes) == 1:
        return loc, loc.join(INDEX if INDEX in indexes else indexes[0])
    if indexes:
        raise SourceFormatError(f"several indexes, pass one of them: {', '.join(indexes)}", path=loc.url)
    # symlinks and special files included: opening one is refused with a message naming it
    files = sorted(n for n, kind in names.items() if kind != "directory" and n.endswith(".safetensors"))
    if len(files) != 1:
        raise SourceFormatError(f"expected one .safetensors file or an index, found {len(files)}", path=loc.url)
    return loc.join(files[0]), None


def _in_order(shard: Location, entries: Mapping[str, HeaderEntry]) -> list[tuple[Location, HeaderEntry, str]]:
    return [(shard, e, name) for name, e in sorted(entries.items(), key=lambda kv: kv[1].begin)]


def plan_read(src: Location) -> tuple[list[tuple[Location, HeaderEntry, str]], dict[str, object]]:
    """Every tensor as (shard, header entry, name) in file order, and what to record about the source."""
    where, index = find_layout(src)
    if index is None:
        entries, meta = read_header(where)
        return _in_order(where, entries), {"layout": "single", "metadata": dict(meta)}
    weight_map, metadata = read_index(index)
    items = []
    for shard_name in sorted(set(weight_map.values())):
        shard = where.join(shard_name)
        entries, _ = read_header(shard)
        listed = {t for t, s in weight_map.items() if s == shard_name}
        if listed - set(entries):
            missing = sorted(listed - set(entries))[:5]
            raise SourceFormatError(f"weight_map puts {missing} in this shard, which lacks them", path=shard.url)
        if set(entries) - listed:
            extra = sorted(set(entries) - listed)[:5]
            raise SourceFormatError(f"shard holds {extra}, which weight_map does not list here", path=shard.url)
        items += _in_order(shard, entries)
    return items, {"layout": "sharded", "metadata": {k: v for k, v in metadata.items() if k != "total_size"}}


def _array(shard: Location, entry: HeaderEntry) -> np.ndarray[Any, Any]:
    data = bytearray(read_range(shard, entry.begin, entry.end - entry.begin))
    return np.frombuffer(data, dtype=dtypes.to_numpy(entry.dtype)).reshape(entry.shape)


def read_hf(loc: Location) -> WeightsSource:
    """The ``weights`` field of a safetensors source, each tensor read (its byte range only) when written."""
    items, source_info = plan_read(loc)
    tensors = [
        SourceTensor(name=name, chunks=(Chunk(read=partial(_array, shard, entry), size=entry.end - entry.begin),))
        for shard, entry, name in items
    ]
    return WeightsSource(url=loc.url, fields={"weights": SourceField(tensors=tensors)}, provenance=source_info)


import_hf = importer("hf", read_hf)


# ---------------------------------------------------------------- writing


def plan_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """huggingface_hub's split: fill shards in order; a tensor over the limit gets a shard of its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def shard_header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[str]]:
    """Header bytes for (name, dtype, shape, nbytes), tensors ordered like the safetensors library orders
    them (largest item size first, then by name, so each one is aligned), and that order."""
    order = sorted(tensors, key=lambda t: (-dtypes.itemsize(t[1]), t[0]))
    table: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in order:
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, [t[0] for t in order]


_OUR_NAMES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _clear(out: Location, overwrite: bool) -> None:
    """Refuse to write over an earlier export, or (overwrite) delete its shards and index first."""
    old = sorted(n for n, kind in list_names(out).items() if kind == "file" and _OUR_NAMES.fullmatch(n))
    if old and not overwrite:
        raise CheckpointExistsError(f"{', '.join(old)} already here; pass --overwrite to replace", path=out.url)
    for name in old:
        fs_call(out.url, out.fs.rm_file, out.join(name).path)


def export_hf(
    src: str,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    field: str = "weights",
    progress: Progress | None = None,
) -> ConvertResult:
    import ckptfmt

    progress = progress or NoProgress()
    out = locate(dst, storage_options)
    result = ConvertResult(source=src, source_format="ckptfmt", destination=out.url, destination_format="hf")
    with ckptfmt.open(src, storage_options) as ckpt:
        records = ckpt.field(field).tensors
        sizes = {name: rec.nbytes for name, rec in records.items()}
        shards = plan_shards(sizes, max_shard_size)
        names = (
            [SINGLE]
            if len(shards) <= 1
            else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        )
        prepare_directory(out, names, overwrite=overwrite)
        _clear(out, overwrite)
        progress.start(sum(sizes.values()))
        weight_map: dict[str, str] = {}
        for filename, members in zip(names, shards or [[]], strict=True):
            header, order = shard_header([(n, records[n].dtype, records[n].shape, sizes[n]) for n in members])
            with open_output(out, filename) as f:
                f.write(header)
                for name in order:
                    f.write(np.ascontiguousarray(ckpt.read_tensor(field, name)).reshape(-1).view(np.uint8).data)
                    weight_map[name] = filename
                    result.tensors += 1
                    result.bytes += sizes[name]
                    progress.advance(sizes[name])
            result.files.append(filename)
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            write_output(out, INDEX, json.dumps(index, indent=2).encode())
            result.files.append(INDEX)
        other = [n for n, rec in ckpt.fields.items() if rec.kind == "tensors" and n != field]
        if other:
            result.notes.append(f"not exported (Hugging Face holds one state dict): fields {', '.join(other)}")
    return result
