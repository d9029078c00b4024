"""Safetensors headers: what the writer builds, and the reader's checks beyond safetensors' own."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

import ckptfmt
from ckptfmt import dtypes
from ckptfmt.errors import SafetensorsHeaderError
from ckptfmt.safetensors_io import MAX_HEADER_BYTES, build_header, header_length, parse_header

PATH = "weights/r00000-00000.safetensors"


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def header_bytes(table: object, *, raw: bytes | None = None) -> bytes:
    return raw if raw is not None else json.dumps(table).encode()


def check(table: object, data_len: int, *, raw: bytes | None = None) -> dict[str, Any]:
    """parse_header on a header whose file holds ``data_len`` bytes of data after it."""
    header = header_bytes(table, raw=raw)
    return parse_header(header, 8 + len(header) + data_len, PATH)


# ---------------------------------------------------------------- what the writer builds


def test_build_header_layout() -> None:
    entries = [("b", "F32", (2, 3), 24), ("a", "I8", (5,), 5), ("z", "BF16", (), 2), ("e", "F64", (0, 4), 0)]
    prefix, starts = build_header(entries)
    (n,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + n
    assert (8 + n) % 8 == 0  # the data section starts aligned
    text = prefix[8:]
    assert text.rstrip(b" ") == text.rstrip(b" ").strip()  # padded with trailing spaces only
    table = json.loads(text)
    assert list(table) == sorted(table)  # keys sorted
    assert "__metadata__" not in table
    assert starts == [8 + n, 8 + n + 24, 8 + n + 29, 8 + n + 31]  # back to back, in the order given
    parsed = parse_header(text, 8 + n + 31, PATH)
    assert parsed["b"].begin == starts[0] and parsed["b"].end == starts[0] + 24
    assert parsed["e"].begin == parsed["e"].end == starts[3]


def test_built_files_load_with_safetensors() -> None:
    arrays = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([1, -2], dtype=np.int64),
        "s": np.array(True),
        "u": np.arange(3, dtype=np.uint16),
    }
    prefix, _ = build_header([(k, dtypes.from_numpy(a.dtype), a.shape, a.nbytes) for k, a in arrays.items()])
    data = prefix + b"".join(a.tobytes() for a in arrays.values())
    loaded = safetensors.numpy.load(data)
    assert loaded.keys() == arrays.keys()
    for key, array in arrays.items():
        np.testing.assert_array_equal(loaded[key], array)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 50])
def test_headers_begin_with_a_brace_and_are_padded_with_spaces_only(tmp_path: Path, count: int) -> None:
    """SAF-17, on build_header and on every data file the writer produces, which upstream safetensors opens."""
    entries = [(f"t{i}" * (i + 1), "U8", (i,), i) for i in range(count)]
    prefix, _ = build_header(entries)
    text = prefix[8:]
    assert text.startswith(b"{")
    body = text.rstrip(b" ")
    assert body.endswith(b"}") and json.loads(body) is not None and set(text[len(body) :]) <= {0x20}
    url = tmp_path / "ck"
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensors("weights", {f"t{i}": np.arange(i, dtype=np.uint8) for i in range(count)})
        w.write_context("provenance", {"created_at": "2025-01-01T00:00:00Z"})
    for data_file in url.rglob("*.safetensors"):
        raw = data_file.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8 : 8 + n]
        assert header.startswith(b"{") and set(header[len(header.rstrip(b" ")) :]) <= {0x20}
        safetensors.numpy.load(raw)


def test_empty_file_header() -> None:
    prefix, starts = build_header([])
    assert starts == []
    assert parse_header(prefix[8:], len(prefix), PATH) == {}


# ---------------------------------------------------------------- strictness

VALID = {"a": entry("F32", [2], 0, 8), "b": entry("U8", [3], 8, 11)}


def test_a_valid_header_parses() -> None:
    parsed = check(VALID, 11)
    assert set(parsed) == {"a", "b"}
    assert parsed["a"].dtype == "F32" and parsed["a"].shape == (2,)


def test_metadata_of_strings_is_allowed() -> None:
    assert set(check({**VALID, "__metadata__": {"format": "pt"}}, 11)) == {"a", "b"}


def test_entries_in_any_order_are_allowed() -> None:
    table = {"b": entry("U8", [3], 8, 11), "a": entry("F32", [2], 0, 8)}
    assert set(check(table, 11)) == {"a", "b"}


def test_duplicate_keys() -> None:
    raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    with pytest.raises(SafetensorsHeaderError, match="duplicate") as info:
        check(None, 2, raw=raw)
    assert info.value.path == PATH


def test_trailing_data_after_the_last_tensor() -> None:
    with pytest.raises(SafetensorsHeaderError, match="after the last tensor"):
        check(VALID, 12)


def test_data_section_shorter_than_the_entries() -> None:
    with pytest.raises(SafetensorsHeaderError):
        check(VALID, 10)


def test_overlapping_offsets() -> None:
    table = {"a": entry("F32", [2], 0, 8), "b": entry("U8", [3], 6, 9)}
    with pytest.raises(SafetensorsHeaderError, match="overlaps"):
        check(table, 9)


def test_two_entries_sharing_bytes() -> None:
    table = {"a": entry("F32", [2], 0, 8), "b": entry("I32", [2], 0, 8)}
    with pytest.raises(SafetensorsHeaderError, match="overlaps"):
        check(table, 8)


def test_gap_between_tensors() -> None:
    table = {"a": entry("F32", [2], 0, 8), "b": entry("U8", [3], 9, 12)}
    with pytest.raises(SafetensorsHeaderError, match="gap"):
        check(table, 12)


def test_gap_before_the_first_tensor() -> None:
    with pytest.raises(SafetensorsHeaderError, match="gap"):
        check({"a": entry("U8", [2], 1, 3)}, 3)


@pytest.mark.parametrize(
    "bad",
    [
        entry("F32", [2], 0, 7),  # one byte short
        entry("F32", [2, 2], 0, 8),  # shape says 16
        entry("BF16", [3], 0, 3),
        entry("U8", [], 0, 0),  # 0-d holds one element
        entry("F32", [2], 8, 0),  # begin > end
    ],
    ids=["short", "shape", "bf16", "0-d", "reversed"],
)
def test_dtype_times_shape_must_equal_the_byte_length(bad: dict[str, Any]) -> None:
    with pytest.raises(SafetensorsHeaderError):
        check({"x": bad}, 8)


@pytest.mark.parametrize(
    "bad",
    [
        entry("F4", [2], 0, 1),
        entry("float32", [2], 0, 8),
        {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]},
        {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]},
        {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]},
        {"dtype": "U8", "shape": 1, "data_offsets": [0, 1]},
        {"dtype": "U8", "shape": [1], "data_offsets": [0]},
        {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]},
        {"dtype": "U8", "shape": [1]},
        {"shape": [1], "data_offsets": [0, 1]},
        "not an object",
    ],
    ids=repr,
)
def test_malformed_entries(bad: object) -> None:
    with pytest.raises(SafetensorsHeaderError):
        check({"x": bad}, 1)


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"not json", b'{"a":', b"\xff\xfe{}", b'"text"', b'{"__metadata__":{"k":1}}', b'{"__metadata__":[]}'],
    ids=repr,
)
def test_malformed_headers(raw: bytes) -> None:
    with pytest.raises(SafetensorsHeaderError):
        check(None, 0, raw=raw)


# ---------------------------------------------------------------- the length prefix


def test_header_length_past_eof() -> None:
    with pytest.raises(SafetensorsHeaderError, match="past the end"):
        header_length(struct.pack("<Q", 100), 100, PATH)
    assert header_length(struct.pack("<Q", 92), 100, PATH) == 92


def test_header_length_over_the_limit() -> None:
    with pytest.raises(SafetensorsHeaderError, match="exceeds"):
        header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1), 1 << 40, PATH)
    with pytest.raises(SafetensorsHeaderError):
        header_length(struct.pack("<Q", 2**64 - 1), 1 << 40, PATH)


def test_file_too_short_for_a_prefix() -> None:
    with pytest.raises(SafetensorsHeaderError, match="too short"):
        header_length(b"\x01\x00\x00", 3, PATH)
