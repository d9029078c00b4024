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
from .jsonio import MAX_DEPTH, json_nesting_problem, load_json

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
    if len(prefix) < 8 or file_size < 8:
        raise SafetensorsHeaderError(
            f"file of {file_size} bytes is too short for a header length", path=path, requirement="SAF-3"
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(
            f"header length {length} exceeds {MAX_HEADER_BYTES}", path=path, requirement="SAF-2"
        )
    if 8 + length > file_size:
        raise SafetensorsHeaderError(
            f"header length {length} runs past the end of the {file_size}-byte file", path=path, requirement="SAF-3"
        )
    return int(length)


def _load(header: bytes, path: str) -> dict[str, Any]:
    """The header's JSON object: strict JSON (SAF-4, SAF-5), bounded (SAF-15), as upstream reads it (SAF-16)."""
    if not header.startswith(b"{"):
        # upstream safetensors refuses a header that does not begin with "{" (leading spaces, a BOM...)
        raise SafetensorsHeaderError("header does not begin with '{'", path=path, requirement="SAF-16")
    problem = json_nesting_problem(header, MAX_DEPTH)
    if problem is not None:
        raise SafetensorsHeaderError(f"header: {problem}", path=path, requirement="SAF-15")
    try:
        table = load_json(
            header,
            error=SafetensorsHeaderError,
            what="header",
            path=path,
            allow_float=True,
            duplicate_requirement="SAF-5",
        )
    except SafetensorsHeaderError as exc:
        raise SafetensorsHeaderError(exc.message, path=path, requirement=exc.requirement or "SAF-4") from exc
    if not isinstance(table, dict):
        raise SafetensorsHeaderError("header is not a JSON object", path=path, requirement="SAF-4")
    try:
        json.dumps(table, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise SafetensorsHeaderError(
            "header holds a \\u escape of a lone surrogate (not a Unicode character)", path=path, requirement="SAF-15"
        ) from None
    return table


def _show(value: object) -> str:
    """A header value for an error message: short, and never a deep repr()."""
    items = value.values() if type(value) is dict else value if type(value) is list else ()
    if any(type(v) in (dict, list) for v in items):
        return f"a nested JSON {'object' if type(value) is dict else 'array'}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_header(header: bytes, file_size: int, path: str) -> dict[str, HeaderEntry]:
    """Validate a header (the N bytes after the length prefix) against the file size."""
    entries, cursor = header_entries(header, path)
    if cursor != file_size:
        raise SafetensorsHeaderError(
            f"{file_size - cursor} bytes after the last tensor (data section must end the file)",
            path=path,
            requirement="SAF-11",
        )
    return entries


def header_entries(header: bytes, path: str) -> tuple[dict[str, HeaderEntry], int]:
    """Every check of :func:`parse_header` but the file's size: the entries, and where the data section ends
    (the file's size, if the file is whole). A hasher that has seen only the head of a file needs this."""
    start = 8 + len(header)
    table = _load(header, path)
    meta = table.pop("__metadata__", {})  # present as null is not absent (SAF-12)
    if not (type(meta) is dict and all(type(v) is str for v in meta.values())):
        raise SafetensorsHeaderError("__metadata__ must map strings to strings", path=path, requirement="SAF-12")
    entries: dict[str, HeaderEntry] = {}
    for key, info in table.items():
        if type(info) is not dict:
            raise SafetensorsHeaderError(f"entry {key!r} is not an object", path=path, requirement="SAF-4")
        dtype = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if type(dtype) is not str or dtype not in dtypes.ITEMSIZE:
            raise SafetensorsHeaderError(
                f"entry {key!r} has unknown dtype {_show(dtype)}", path=path, requirement="SAF-6"
            )
        if not (type(shape) is list and all(type(d) is int and d >= 0 for d in shape)):
            raise SafetensorsHeaderError(
                f"entry {key!r} has an invalid shape {_show(shape)}", path=path, requirement="SAF-7"
            )
        if not (type(offs) is list and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise SafetensorsHeaderError(
                f"entry {key!r} has invalid data_offsets {_show(offs)}", path=path, requirement="SAF-8"
            )
        problem = dtypes.shape_size_problem(shape, dtypes.ITEMSIZE[dtype])
        if problem:
            raise SafetensorsHeaderError(f"entry {key!r}: {problem}", path=path, requirement="SAF-14")
        begin, end = offs
        count = 1
        for d in shape:
            count *= d
        if begin > end:
            raise SafetensorsHeaderError(
                f"entry {key!r}: data_offsets [{begin}, {end}] are reversed", path=path, requirement="SAF-8"
            )
        if end - begin != count * dtypes.ITEMSIZE[dtype]:
            raise SafetensorsHeaderError(
                f"entry {key!r}: {dtype}{shape} needs {count * dtypes.ITEMSIZE[dtype]} bytes, "
                f"data_offsets give {end - begin}",
                path=path,
                requirement="SAF-9",
            )
        entries[key] = HeaderEntry(key=key, dtype=dtype, shape=tuple(shape), begin=start + begin, end=start + end)
    cursor = start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < cursor:
            raise SafetensorsHeaderError(
                f"entry {entry.key!r} overlaps the previous tensor", path=path, requirement="SAF-10"
            )
        if entry.begin > cursor:
            raise SafetensorsHeaderError(
                f"gap of {entry.begin - cursor} bytes before {entry.key!r}", path=path, requirement="SAF-11"
            )
        cursor = entry.end
    return entries, cursor
