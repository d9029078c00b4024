"""Safetensors data files: building headers for the streaming writer, and strict header validation.

The reader checks what safetensors 0.8 lets through: duplicate keys, overlapping or gapped
offsets, data after the last tensor (polyglot files), dtype x shape != byte length.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import dtypes
from .errors import SafetensorsHeaderError

MAX_HEADER_BYTES = 100_000_000
ALIGNMENT = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets within the file
    end: int


def build_header(entries: Sequence[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors stored back to back in the given order.

    ``entries`` are (key, dtype, shape, nbytes). Returns the header and each tensor's absolute start.
    """
    table: dict[str, dict[str, Any]] = {}
    offset = 0
    relative = []
    for key, dtype, shape, nbytes in entries:
        table[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative.append(offset)
        offset += nbytes
    text = json.dumps(table, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % ALIGNMENT)  # spaces: the padding safetensors allows
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [start + r for r in relative]


def header_length(prefix: bytes, file_size: int, path: str) -> int:
    if len(prefix) < 8:
        raise SafetensorsHeaderError(f"file of {file_size} bytes is too short for a header", path=path)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"header length {length} exceeds {MAX_HEADER_BYTES}", path=path)
    if 8 + length > file_size:
        raise SafetensorsHeaderError(
            f"header length {length} runs past the end of the {file_size}-byte file", path=path
        )
    return int(length)


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsHeaderError(f"duplicate key {key!r} in header")
        out[key] = value
    return out


def parse_header(header: bytes, file_size: int, path: str) -> dict[str, HeaderEntry]:
    """Validate a header (the N bytes after the length prefix) against the file size."""
    start = 8 + len(header)
    try:
        table = json.loads(header.decode("utf-8"), object_pairs_hook=_pairs)
    except SafetensorsHeaderError as exc:
        raise SafetensorsHeaderError(exc.message, path=path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsHeaderError(f"header is not valid UTF-8 JSON: {exc}", path=path) from exc
    if not isinstance(table, dict):
        raise SafetensorsHeaderError("header is not a JSON object", path=path)
    meta = table.pop("__metadata__", {})  # present as null is not absent (SAF-12)
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SafetensorsHeaderError("__metadata__ must map strings to strings", path=path)
    entries: dict[str, HeaderEntry] = {}
    for key, info in table.items():
        if not isinstance(info, dict):
            raise SafetensorsHeaderError(f"entry {key!r} is not an object", path=path)
        dtype = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if dtype not in dtypes.ITEMSIZE:
            raise SafetensorsHeaderError(f"entry {key!r} has unknown dtype {dtype!r}", path=path)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise SafetensorsHeaderError(f"entry {key!r} has an invalid shape {shape!r}", path=path)
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise SafetensorsHeaderError(f"entry {key!r} has invalid data_offsets {offs!r}", path=path)
        begin, end = offs
        count = 1
        for d in shape:
            count *= d
        if begin > end or end - begin != count * dtypes.ITEMSIZE[dtype]:
            raise SafetensorsHeaderError(
                f"entry {key!r}: {dtype}{shape} needs {count * dtypes.ITEMSIZE[dtype]} bytes, "
                f"data_offsets give {end - begin}",
                path=path,
            )
        entries[key] = HeaderEntry(key=key, dtype=dtype, shape=tuple(shape), begin=start + begin, end=start + end)
    cursor = start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < cursor:
            raise SafetensorsHeaderError(f"entry {entry.key!r} overlaps the previous tensor", path=path)
        if entry.begin > cursor:
            raise SafetensorsHeaderError(f"gap of {entry.begin - cursor} bytes before {entry.key!r}", path=path)
        cursor = entry.end
    if cursor != file_size:
        raise SafetensorsHeaderError(
            f"{file_size - cursor} bytes after the last tensor (data section must end the file)", path=path
        )
    return entries
