"""Invalid vectors about tensors, chunks and data files (spec/tensors.md, safetensors.md).

Helpers and the record type are in conformance/invalid.py.
"""

from __future__ import annotations

from .edits import (
    DATA,
    Mutation,
    delete,
    extra_entry,
    header,
    manifest,
    pad_byte,
    rename_tensor,
    replace_in_manifest,
    set_,
)
from .invalid import (
    S1,
    C,
    Invalid,
    W,
    _entry,
    header_length,
    header_past_end,
    past_end,
    second_empty_chunk,
    swap_ranges,
    weights_entry,
)
from .mutations import Tree


def nested(levels: int) -> object:
    value: object = []
    for _ in range(levels - 1):
        value = [value]
    return value


def truncated_to(path: str, size: int) -> Mutation:
    return lambda t: t.write(path, t.read(path)[:size])


def huge_empty(shape: list[int]) -> Mutation:
    """Give the empty tensor ``e`` (and its one chunk and header entry) ``shape``, still with no elements."""

    def run(t: Tree) -> None:
        doc = t.manifest()
        record = doc["fields"]["weights"]["tensors"]["e"]
        [only] = record["chunks"]
        record["shape"] = only["shape"] = shape
        only["offsets"] = [0] * len(shape)
        t.set_manifest(doc)
        t.rewrite_data_file(only["path"], header=lambda h: h[only["key"]].__setitem__("shape", shape))

    return run


VECTORS: tuple[Invalid, ...] = (
    # ---- tensors
    Invalid(
        "dtype-unknown",
        ("TEN-1",),
        "Tensor w has dtype 'F4'.",
        set_((*W, "dtype"), "F4"),
        also=("SAF-13",),
        scope="tensor",
    ),
    Invalid("tensor-name-control", ("TEN-2",), "A tensor named 'w\\u0001'.", rename_tensor("weights", "w", "w\x01")),
    Invalid("tensor-name-del", ("TEN-2",), "A tensor named 'w\\u007f'.", rename_tensor("weights", "w", "w\x7f")),
    Invalid(
        "tensor-name-reserved",
        ("TEN-2",),
        "A tensor named '__metadata__'.",
        rename_tensor("weights", "w", "__metadata__"),
    ),
    Invalid("tensor-name-empty", ("TEN-2",), "A tensor named ''.", rename_tensor("weights", "w", "")),
    Invalid(
        "tensor-name-too-long", ("TEN-2",), "A tensor name of 1025 bytes.", rename_tensor("weights", "w", "w" * 1025)
    ),
    Invalid(
        "tensor-name-lone-surrogate",
        ("TEN-2",),
        "A tensor named '\\ud800' (a lone surrogate: not UTF-8).",
        replace_in_manifest('"w":{"chunks"', '"\\ud800":{"chunks"'),
        also=("MAN-27",),
    ),
    Invalid("tensor-dtype-missing", ("TEN-3",), "Tensor w has no dtype.", delete((*W, "dtype"))),
    Invalid("tensor-shape-missing", ("TEN-4",), "Tensor w has no shape.", delete((*W, "shape"))),
    Invalid(
        "tensor-shape-negative",
        ("TEN-4",),
        "Tensor e has shape [0, -3].",
        set_(("fields", "weights", "tensors", "e", "shape"), [0, -3]),
        also=("TEN-16", "TEN-19"),  # no chunk shape of non-negative integers fits [0, -3] or equals it
    ),
    Invalid(
        "tensor-shape-too-large",
        ("TEN-23",),
        "Empty F32 tensor e has shape [0, 2**62, 2**62]: no elements, but no numpy array (header agrees).",
        huge_empty([0, 1 << 62, 1 << 62]),
        also=("SAF-14",),
    ),
    Invalid(
        "tensor-dimension-too-large",
        ("TEN-23",),
        "Empty tensor e has shape [0, 2**63] (its header entry says the same).",
        huge_empty([0, 1 << 63]),
        also=("SAF-14",),
    ),
    Invalid(
        "tensor-too-many-dimensions",
        ("TEN-23",),
        "Empty tensor e has 65 dimensions, [0, 1, 1, ...] (its header entry says the same): more than any array holds.",
        huge_empty([0] + [1] * 64),
        also=("SAF-14",),
    ),
    Invalid("tensor-chunks-missing", ("TEN-5",), "Tensor w has no chunks.", delete((*W, "chunks"))),
    Invalid("chunk-path-missing", ("TEN-6",), "A chunk without path.", delete((*C, "path"))),
    Invalid("chunk-key-missing", ("TEN-7",), "A chunk without key.", delete((*C, "key"))),
    Invalid("chunk-offsets-missing", ("TEN-8",), "A chunk without offsets.", delete((*C, "offsets"))),
    Invalid("chunk-shape-missing", ("TEN-9",), "A chunk without shape.", delete((*C, "shape"))),
    Invalid("chunk-range-missing", ("TEN-10",), "A chunk without range.", delete((*C, "range"))),
    Invalid("chunk-digest-missing", ("TEN-11",), "A chunk without digest.", delete((*C, "digest"))),
    Invalid("chunk-codec-missing", ("TEN-12",), "A chunk without codec.", delete((*C, "codec"))),
    Invalid("chunk-codec-without-name", ("TEN-12",), "A chunk whose codec is {}.", set_((*C, "codec"), {})),
    Invalid(
        "codec-unknown",
        ("TEN-14",),
        "A chunk with codec 'org.example.unknown' (the bytes are raw).",
        set_((*C, "codec"), {"name": "org.example.unknown"}),
        scope="tensor",
    ),
    Invalid(
        "chunk-rank-mismatch",
        ("TEN-15",),
        "A chunk of the 1-d tensor s has offsets [2, 0].",
        set_((*S1, "offsets"), [2, 0]),
    ),
    Invalid(
        "chunk-outside",
        ("TEN-16",),
        "Chunks of s [4] at [0:2] and [3:5]: the second lies outside (no overlap, volumes add up).",
        set_((*S1, "offsets"), [3]),
    ),
    Invalid(
        "chunks-overlap",
        ("TEN-17",),
        "Chunks of s [4] at [0:2] and [1:3] share element 1 (volumes add up).",
        set_((*S1, "offsets"), [1]),
    ),
    Invalid(
        "chunks-gap",
        ("TEN-18",),
        "The second chunk of s is dropped: elements 2 and 3 are in no chunk.",
        manifest(lambda d: d["fields"]["weights"]["tensors"]["s"]["chunks"].pop()),
    ),
    Invalid(
        "empty-tensor-two-chunks", ("TEN-19",), "The empty tensor e [0, 3] has two empty chunks.", second_empty_chunk
    ),
    Invalid(
        "chunk-range-past-file",
        ("TEN-20",),
        "A chunk's range runs 8 bytes past the end of its file.",
        manifest(past_end),
        also=("SAF-13",),
    ),
    Invalid(
        "chunk-range-reversed",
        ("TEN-20",),
        "A chunk's range is [end, begin].",
        manifest(lambda d: d["fields"]["weights"]["tensors"]["w"]["chunks"][0]["range"].reverse()),
        also=("TEN-21", "SAF-13"),
    ),
    Invalid(
        "chunk-range-length",
        ("TEN-21",),
        "A raw F32 [2, 3] chunk whose range holds 20 bytes.",
        manifest(
            lambda d: d["fields"]["weights"]["tensors"]["w"]["chunks"][0]["range"].__setitem__(
                1, d["fields"]["weights"]["tensors"]["w"]["chunks"][0]["range"][1] - 4
            )
        ),
        also=("SAF-13",),
    ),
    Invalid(
        "chunk-key-reused",
        ("TEN-22",),
        "Tensor w2 has the same chunk (path and key) as w.",
        manifest(lambda d: d["fields"]["weights"]["tensors"].__setitem__("w2", d["fields"]["weights"]["tensors"]["w"])),
    ),
    # ---- safetensors
    Invalid(
        "st-header-too-large",
        ("SAF-2",),
        "The header length field says 100,000,001.",
        header_length(100_000_001),
        also=("SAF-3",),
        scope="file",
    ),
    Invalid(
        "st-header-past-end",
        ("SAF-3",),
        "The header length field says one byte more than the file holds after it.",
        header_past_end,
        scope="file",
    ),
    Invalid(
        "st-file-too-short",
        ("SAF-3",),
        "The data file is cut to its first 5 bytes (its file record follows): too short for the header length.",
        truncated_to(DATA, 5),
        also=("TEN-20", "SAF-13"),
        scope="file",
    ),
    Invalid(
        "st-header-nan",
        ("SAF-4",),
        "An unknown member of entry w is NaN, which is not JSON.",
        lambda t: t.rewrite_data_file(DATA, raw_header=lambda h: h.replace(b'"dtype"', b'"x":NaN,"dtype"', 1)),
        scope="file",
    ),
    Invalid(
        "st-header-nesting-65",
        ("SAF-15",),
        "An unknown member of entry w holds arrays nested 63 deep: level 65 counting the header object.",
        header(lambda h: h["w"].__setitem__("x", nested(63))),
        scope="file",
    ),
    Invalid(
        "st-header-integer-21-digits",
        ("SAF-15",),
        "An unknown member of entry w is the integer 100000000000000000000 (21 digits).",
        header(lambda h: h["w"].__setitem__("x", 10**20)),
        scope="file",
    ),
    Invalid(
        "st-header-lone-surrogate",
        ("SAF-15",),
        'An unknown member of entry w is the string "\\ud800".',
        lambda t: t.rewrite_data_file(DATA, raw_header=lambda h: h.replace(b'"dtype"', b'"x":"\\ud800","dtype"', 1)),
        scope="file",
    ),
    Invalid(
        "st-header-leading-space",
        ("SAF-16",),
        "The header begins with a space before its '{' (upstream safetensors refuses it).",
        lambda t: t.rewrite_data_file(DATA, raw_header=lambda h: b" " + h),
        scope="file",
    ),
    Invalid("st-header-not-utf8", ("SAF-4",), "The header's last padding byte is ff.", pad_byte(b"\xff"), scope="file"),
    Invalid(
        "st-header-not-json",
        ("SAF-4",),
        "The header's last padding byte is 'x': trailing garbage after the JSON object.",
        pad_byte(b"x"),
        scope="file",
    ),
    Invalid(
        "st-duplicate-key",
        ("SAF-5",),
        "The header has the entry w twice, identically.",
        lambda t: t.rewrite_data_file(DATA, raw_header=lambda h: b'{"w":' + _entry(h, "w") + b"," + h[1:]),
        scope="file",
    ),
    Invalid(
        "st-dtype-unknown",
        ("SAF-6",),
        "An unreferenced entry of dtype 'F4'.",
        extra_entry({"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}, 1),
        scope="file",
    ),
    Invalid(
        "st-shape-invalid",
        ("SAF-7",),
        "An unreferenced entry with shape ['1'].",
        extra_entry({"dtype": "U8", "shape": ["1"], "data_offsets": [0, 1]}, 1),
        scope="file",
    ),
    Invalid(
        "st-shape-negative",
        ("SAF-7",),
        "An unreferenced entry with shape [-1].",
        extra_entry({"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}, 0),
        also=("SAF-9",),
        scope="file",
    ),
    Invalid(
        "st-shape-too-large",
        ("SAF-14",),
        "An unreferenced empty U8 entry of shape [0, 2**62, 2**62].",
        extra_entry({"dtype": "U8", "shape": [0, 1 << 62, 1 << 62], "data_offsets": [0, 0]}, 0),
        scope="file",
    ),
    Invalid(
        "st-shape-65-dims",
        ("SAF-14",),
        "An unreferenced empty U8 entry of 65 dimensions [0, 1, ..., 1]: SAF-14's dimension bound apart from TEN-23.",
        extra_entry({"dtype": "U8", "shape": [0] + [1] * 64, "data_offsets": [0, 0]}, 0),
        scope="file",
    ),
    Invalid(
        "st-offsets-invalid",
        ("SAF-8",),
        "An unreferenced entry with three data_offsets.",
        extra_entry({"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}, 1),
        scope="file",
    ),
    Invalid(
        "st-offsets-reversed",
        ("SAF-8",),
        "An unreferenced entry with data_offsets [b+1, b].",
        extra_entry({"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}, 1),
        also=("SAF-9", "SAF-11"),
        scope="file",
    ),
    Invalid(
        "st-length-mismatch",
        ("SAF-9",),
        "An unreferenced U8 [3] entry holding 4 bytes (a dtype/byte-size mismatch).",
        extra_entry({"dtype": "U8", "shape": [3], "data_offsets": [0, 4]}, 4),
        scope="file",
    ),
    Invalid(
        "st-overlap",
        ("SAF-10",),
        "An unreferenced U8 [4] entry over the first 4 bytes of another.",
        lambda t: t.rewrite_data_file(
            DATA, header=lambda h: h.__setitem__("extra", {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]})
        ),
        also=("SAF-11",),
        scope="file",
    ),
    Invalid(
        "st-trailing-bytes",
        ("SAF-11",),
        "8 bytes after the last entry (a polyglot file).",
        lambda t: t.rewrite_data_file(DATA, append=b"PK\x05\x06\x00\x00\x00\x00"),
        scope="file",
    ),
    Invalid(
        "st-gap",
        ("SAF-11",),
        "2 bytes between the last entry and an unreferenced one.",
        extra_entry({"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}, 4),
        scope="file",
    ),
    Invalid(
        "st-metadata-not-strings",
        ("SAF-12",),
        "__metadata__ maps a key to 1.",
        header(lambda h: h.__setitem__("__metadata__", {"k": 1})),
        scope="file",
    ),
    Invalid(
        "st-metadata-null",
        ("SAF-12",),
        "__metadata__ is null.",
        header(lambda h: h.__setitem__("__metadata__", None)),
        scope="file",
    ),
    Invalid(
        "st-key-missing",
        ("SAF-13",),
        "Chunk w's key 'nope' has no entry in the header.",
        set_((*C, "key"), "nope"),
        scope="file",
    ),
    Invalid(
        "st-dtype-differs",
        ("SAF-13",),
        "The manifest says I32, the header F32 (same itemsize).",
        set_((*W, "dtype"), "I32"),
        scope="file",
    ),
    Invalid(
        "st-shape-differs",
        ("SAF-13",),
        "The header says w is [3, 2], the chunk [2, 3].",
        weights_entry(lambda e: e.__setitem__("shape", [3, 2])),
        scope="file",
    ),
    Invalid(
        "st-range-differs",
        ("SAF-13",),
        "The two chunks of s have each other's range and digest: every digest matches, the header does not.",
        manifest(swap_ranges),
        scope="file",
    ),
)
