"""Hostile input to the parsers: huge shapes, hostile JSON in manifests and safetensors headers, broken
MessagePack. One oracle throughout: a library error (naming the file or field) and nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.canonical import manifest_bytes
from ckptfmt.context import decode
from ckptfmt.errors import CheckpointError, ContextError, ManifestError, SafetensorsHeaderError
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.safetensors_io import parse_header

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli

VECTORS = Path(__file__).parent.parent / "conformance" / "vectors"
PATH = "weights/r00000-00000.safetensors"


def header_file(table: object, *, raw: bytes | None = None, data_len: int = 0) -> tuple[bytes, int]:
    header = raw if raw is not None else json.dumps(table).encode()
    return header, 8 + len(header) + data_len


# ---------------------------------------------------------------- TEN-23 / SAF-14: shapes numpy cannot hold


@pytest.mark.parametrize("shape", [[0, 1 << 62, 1 << 62], [0, 1 << 63], [1 << 63], [0, 1 << 61, 1]])
def test_a_header_entry_of_impossible_size_is_refused(shape: list[int]) -> None:
    header, size = header_file({"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(SafetensorsHeaderError) as info:
        parse_header(header, size, PATH)
    assert info.value.requirement == "SAF-14" and info.value.path == PATH


def test_the_largest_possible_empty_header_entry_is_accepted() -> None:
    header, size = header_file({"e": {"dtype": "F32", "shape": [0, 1 << 60, 1], "data_offsets": [0, 0]}})
    assert parse_header(header, size, PATH)["e"].shape == (0, 1 << 60, 1)
    assert np.empty((0, 1 << 60, 1), dtype=np.float32).size == 0  # numpy agrees: the limit is exact


@pytest.mark.parametrize("vector", ["tensor-shape-too-large", "tensor-dimension-too-large"])
def test_an_empty_tensor_of_impossible_size_is_refused_at_open(tmp_path: Path, vector: str) -> None:
    src = VECTORS / "invalid" / vector / "checkpoint"
    with pytest.raises(ManifestError) as info:
        ckptfmt.open(src)
    assert info.value.requirement == "TEN-23" and info.value.tensor == "e"
    for command in (("verify", str(src)), ("dump", "--canonical", str(src)), ("diff", str(src), str(src))):
        result = run_cli(*command)
        out = result.stdout + result.stderr
        assert result.exit_code == 1 and "invalid_manifest" in out and "2**63" in out


def test_legitimately_empty_tensors_still_read_dump_and_diff(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensors("weights", {"e": np.zeros((0, 4), np.float32), "z": np.zeros((3, 0, 2), np.int8)})
        w.write_context("provenance", {"created_at": "2026-01-01T00:00:00Z"})
    with ckptfmt.open(url) as c:
        assert c.read_tensor("weights", "e").shape == (0, 4)
        assert c.read_tensor("weights", "z").shape == (3, 0, 2)
    assert run_cli("dump", "--canonical", str(url)).exit_code == 0
    assert run_cli("diff", str(url), str(url)).exit_code == 0
    assert run_cli("verify", str(url)).exit_code == 0


# ---------------------------------------------------------------- manifests: every field, every wrong type


@pytest.fixture(scope="module")
def manifest_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    url = tmp_path_factory.mktemp("m") / "ck"
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensor("weights", "t", np.zeros((2, 2), np.float32), global_shape=(4, 2), offsets=(0, 0))
        w.write_tensor("weights", "t", np.ones((2, 2), np.float32), global_shape=(4, 2), offsets=(2, 0))
        w.write_tensors("weights", {"e": np.zeros((0, 3), np.float32)})
        w.write_context("provenance", {"created_at": "2025-01-01T00:00:00Z"})
    doc = dict(json.loads((url / "manifest.json").read_bytes()))
    doc["metadata"] = {"k": "v"}
    doc["extensions"] = [{"name": "org.example.x", "must_understand": False, "configuration": {"a": 1}}]
    return doc


DEEP = json.loads("[" * 70 + "]" * 70)
DEEPER = json.loads("[" * 900 + "]" * 900)  # parses, but a repr() of it in an error message would not
WRONG: list[object] = [None, True, 1.5, "s", [], {}, 10**30, -1, 0, DEEP, DEEPER, [1, "a"], {"k": None}]


def paths_of(value: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += paths_of(item, (*prefix, i))
    return out


def replaced(doc: Any, path: tuple[Any, ...], value: object) -> Any:
    out = json.loads(json.dumps(doc))
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def encodings(doc: Any) -> list[bytes]:
    """The canonical bytes (the parser's fast path) and a non-canonical spelling (its checked path)."""
    return [manifest_bytes(doc), json.dumps(doc, indent=1).encode()]


def _parse_or_library_error(data: bytes) -> None:
    try:
        parse_manifest(data)
    except CheckpointError:
        pass  # any other exception fails the test with its traceback


def test_every_manifest_member_with_every_wrong_type_raises_a_library_error(manifest_doc: dict[str, Any]) -> None:
    paths = paths_of(manifest_doc)
    assert len(paths) > 60
    for path in paths:
        for value in WRONG:
            bad = replaced(manifest_doc, path, value)
            for data in encodings(bad) if type(value) is not float else [json.dumps(bad).encode()]:
                _parse_or_library_error(data)
    # and every member removed
    for path in paths:
        bad = json.loads(json.dumps(manifest_doc))
        target = bad
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        _parse_or_library_error(manifest_bytes(bad))


def _unknown(doc: dict[str, Any], value: object, at: tuple[Any, ...] = ()) -> bytes:
    out = json.loads(json.dumps(doc))
    target = out
    for key in at:
        target = target[key]
    target["x_unknown"] = value
    return manifest_bytes(out)


CHUNK_AT = ("fields", "weights", "tensors", "t", "chunks", 0)  # a chunk object is at level 7


@pytest.mark.parametrize(
    ("at", "level"),
    [((), 1), (("files", 0), 3), (("fields", "weights"), 3), (("fields", "weights", "tensors", "t"), 5), (CHUNK_AT, 7)],
)
def test_json_nesting_limit_is_exactly_64_levels(manifest_doc: dict[str, Any], at: tuple[Any, ...], level: int) -> None:
    def nested(levels: int) -> object:
        return json.loads("[" * levels + "]" * levels)

    allowed = 64 - level  # levels left for an unknown member's value
    parse_manifest(_unknown(manifest_doc, nested(allowed), at))
    with pytest.raises(ManifestError) as info:
        parse_manifest(_unknown(manifest_doc, nested(allowed + 1), at))
    assert info.value.requirement == "MAN-26"


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_json_anywhere_is_refused(manifest_doc: dict[str, Any], depth: int) -> None:
    data = manifest_bytes(manifest_doc)
    hostile = data[:-1] + b',"x_unknown":' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(ManifestError, match="nests deeper than 64 levels") as info:
        parse_manifest(hostile)
    assert info.value.requirement == "MAN-26"


@pytest.mark.parametrize("digits", [21, 100, 4300, 5000, 100_000])
def test_long_integer_literals_are_refused(manifest_doc: dict[str, Any], digits: int) -> None:
    literal = b"9" * digits
    data = manifest_bytes(manifest_doc)
    for hostile in (
        data[:-1] + b',"x_unknown":' + literal + b"}",
        data[:-1] + b',"x_unknown":[-' + literal + b"]}",
        data.replace(b'"size":', b'"size":' + literal + b',"y":', 1),
    ):
        with pytest.raises(ManifestError):
            parse_manifest(hostile)
    # 20 digits is the limit, in an unknown member and in a known one
    parse_manifest(data[:-1] + b',"x_unknown":[99999999999999999999,-99999999999999999999]}')


@pytest.mark.parametrize("text", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_numbers_are_refused(manifest_doc: dict[str, Any], text: bytes) -> None:
    data = manifest_bytes(manifest_doc)
    with pytest.raises(ManifestError):
        parse_manifest(data[:-1] + b',"x_unknown":' + text + b"}")


@pytest.mark.parametrize("text", [b"1.5", b"1e5", b"4096.0"])
def test_a_fraction_is_ignored_in_an_unknown_member_and_refused_as_an_integer_property(
    manifest_doc: dict[str, Any], text: bytes
) -> None:
    data = manifest_bytes(manifest_doc)  # spec/notes/gaps-1.2.md N17
    assert b'"size":224' in data
    parse_manifest(data[:-1] + b',"x_unknown":' + text + b"}")
    with pytest.raises(ManifestError):
        parse_manifest(data.replace(b'"size":224', b'"size":' + text, 1))


def test_a_byte_order_mark_is_refused(manifest_doc: dict[str, Any]) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(b"\xef\xbb\xbf" + manifest_bytes(manifest_doc))
    assert info.value.requirement == "MAN-27"


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\ud800x", "x\\udc00\\ud800"])
def test_lone_surrogate_escapes_are_refused_anywhere(manifest_doc: dict[str, Any], escape: str) -> None:
    data = manifest_bytes(manifest_doc)
    for hostile in (
        data[:-1] + b',"x_unknown":"' + escape.encode() + b'"}',
        data[:-1] + b',"x_' + escape.encode() + b'":1}',
        data.replace(b'"k":"v"', b'"k":"' + escape.encode() + b'"'),
    ):
        with pytest.raises(ManifestError) as info:
            parse_manifest(hostile)
        assert info.value.requirement == "MAN-27"
    # a proper pair is one character, and fine
    parse_manifest(data[:-1] + b',"x_unknown":"\\ud83d\\ude00"}')


def test_member_names_are_compared_after_unescaping(manifest_doc: dict[str, Any]) -> None:
    data = manifest_bytes(manifest_doc)
    with pytest.raises(ManifestError, match="duplicate"):
        parse_manifest(data[:-1] + b',"form\\u0061t":"ckptfmt"}')


# ---------------------------------------------------------------- safetensors headers


GOOD_HEADER: dict[str, Any] = {
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "b": {"dtype": "U8", "shape": [4], "data_offsets": [16, 20]},
}


def test_every_header_member_with_every_wrong_type_raises_a_library_error() -> None:
    paths = paths_of(GOOD_HEADER)
    for path in paths:
        for value in [*WRONG, float("nan")]:
            bad = replaced(GOOD_HEADER, path, value) if value == value else None
            raw = (
                json.dumps(bad).encode()
                if bad is not None
                else json.dumps(GOOD_HEADER).encode().replace(b"[2, 2]", b"[NaN, 2]")
            )
            try:
                parse_header(raw, 8 + len(raw) + 20, PATH)
            except CheckpointError:
                pass


@pytest.mark.parametrize(
    ("raw", "requirement"),
    [
        (b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,0]}}', "SAF-4"),
        (b'{"x":Infinity}', "SAF-4"),
        (b'{"__metadata__":{"k":"v"},"__metadata__":{"k":"v"}}', "SAF-5"),
        (b'{"x":' + b"[" * 65 + b"]" * 65 + b"}", "SAF-15"),
        (b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "SAF-15"),
        (b'{"x":' + b"1" * 5000 + b"}", "SAF-15"),
        (b'{"x":"\\ud800"}', "SAF-15"),
        (b' {"__metadata__":{}}', "SAF-16"),
        (b'\xef\xbb\xbf{"__metadata__":{}}', "SAF-16"),
        (b'\n{"__metadata__":{}}', "SAF-16"),
    ],
)
def test_hostile_header_json_is_refused_with_its_requirement(raw: bytes, requirement: str) -> None:
    with pytest.raises(SafetensorsHeaderError) as info:
        parse_header(raw, 8 + len(raw), PATH)
    assert info.value.requirement == requirement and info.value.path == PATH


def test_a_header_padded_with_spaces_and_floats_in_unknown_members_is_fine() -> None:
    raw = b'{"__metadata__":{"k":"v"}}      '
    assert parse_header(raw, 8 + len(raw), PATH) == {}


@pytest.mark.parametrize("size", range(8))
def test_a_data_file_shorter_than_8_bytes_is_refused(size: int) -> None:
    from ckptfmt.safetensors_io import header_length

    with pytest.raises(SafetensorsHeaderError) as info:
        header_length(b"\x00" * size, size, PATH)
    assert info.value.requirement == "SAF-3"


# ---------------------------------------------------------------- MessagePack context blobs


def _blob(member: bytes) -> bytes:
    return b"\x81\xa1a" + member  # {"a": <member>}


HOSTILE_BLOBS = {
    "empty": (b"", "CTX-13"),
    "truncated map": (b"\x82\xa1a\xc0", "CTX-13"),
    "truncated str": (_blob(b"\xa5ab"), "CTX-13"),
    "reserved c1": (_blob(b"\xc1"), "CTX-13"),
    "reserved c1 at top": (b"\xc1", "CTX-13"),
    "array32 of 2**32-1": (_blob(b"\xdd\xff\xff\xff\xff"), "CTX-13"),
    "map32 of 2**32-1": (_blob(b"\xdf\xff\xff\xff\xff"), "CTX-13"),
    "str32 of 4 GiB": (_blob(b"\xdb\xff\xff\xff\xff"), "CTX-13"),
    "bin32 of 4 GiB": (_blob(b"\xc6\xff\xff\xff\xff"), "CTX-13"),
    "ext32 of 4 GiB": (_blob(b"\xc9\xff\xff\xff\xff\x02"), "CTX-13"),
    "65 deep": (_blob(b"\x91" * 64 + b"\xc0"), "CTX-7"),
    "100k deep arrays": (_blob(b"\x91" * 100_000 + b"\xc0"), "CTX-7"),
    "100k deep maps": (_blob(b"\x81\xa1k" * 100_000 + b"\xc0"), "CTX-7"),
    "trailing byte": (_blob(b"\xc0") + b"\xc0", "CTX-2"),
    "int key": (b"\x81\x01\xc0", "CTX-5"),
    "timestamp": (_blob(b"\xd6\xff\x00\x00\x00\x00"), "CTX-3"),
    "non-utf8 str": (_blob(b"\xa1\xff"), "CTX-4"),
}


@pytest.mark.parametrize("name", list(HOSTILE_BLOBS))
def test_hostile_msgpack_raises_context_error_quickly_in_bounded_memory(name: str) -> None:
    import tracemalloc

    data, requirement = HOSTILE_BLOBS[name]
    tracemalloc.start()
    try:
        with pytest.raises(ContextError) as info:
            decode(data, path="p/context.msgpack")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.requirement == requirement and info.value.path == "p/context.msgpack"
    assert peak < 16 << 20


# ---------------------------------------------------------------- issue 23: more dimensions than numpy holds


def _many_dims_checkpoint(url: Path, ndim: int) -> None:
    """An empty F32 tensor ``e`` of ``ndim`` zero dimensions (numpy cannot even make one past 64): written with
    shape [0], then its manifest record and data file header rewritten, sizes and digests kept true."""
    from ckptfmt.digests import digest_of

    # flat digests: a header SAF-14 refuses is no data file, which has no tree digest to forge
    with ckptfmt.open_writer(url, profile="weights", digest="xxh3-128") as w:
        w.write_tensor("weights", "e", np.zeros((0,), np.float32))
        w.write_context("provenance", {"created_at": "2026-01-01T00:00:00Z"})
    doc = json.loads((url / "manifest.json").read_bytes())
    header = json.dumps({"e": {"dtype": "F32", "shape": [0] * ndim, "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    data = len(header).to_bytes(8, "little") + header
    (url / PATH).write_bytes(data)
    record = doc["fields"]["weights"]["tensors"]["e"]
    record["shape"] = [0] * ndim
    chunk = record["chunks"][0]
    chunk.update(offsets=[0] * ndim, shape=[0] * ndim, range=[len(data), len(data)])
    for entry in doc["files"]:
        if entry["path"] == PATH:
            entry.update(size=len(data), digest=digest_of(entry["digest"].partition(":")[0], data))
    (url / "manifest.json").write_bytes(manifest_bytes(doc))


def test_an_empty_tensor_of_more_dimensions_than_numpy_holds_is_refused_at_open(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _many_dims_checkpoint(url, 101)
    with pytest.raises(ManifestError) as info:
        ckptfmt.open(url)
    assert info.value.requirement == "TEN-23" and info.value.tensor == "e" and "101 dimensions" in info.value.message
    for command in (("dump", str(url)), ("dump", "--canonical", str(url)), ("verify", str(url))):
        result = run_cli(*command)
        out = result.stdout + result.stderr
        assert result.exit_code == 1 and "invalid_manifest" in out and "101 dimensions" in out, out


def test_an_empty_tensor_of_64_dimensions_still_reads(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _many_dims_checkpoint(url, 64)
    with ckptfmt.open(url) as c:
        assert c.read_tensor("weights", "e").shape == (0,) * 64


@pytest.mark.parametrize(("ndim", "refused"), [(64, False), (65, True), (101, True)])
def test_a_header_entry_of_more_dimensions_than_numpy_holds_is_refused(ndim: int, refused: bool) -> None:
    header, size = header_file({"e": {"dtype": "F32", "shape": [0] * ndim, "data_offsets": [0, 0]}})
    if not refused:
        assert parse_header(header, size, PATH)["e"].shape == (0,) * ndim
        return
    with pytest.raises(SafetensorsHeaderError) as info:
        parse_header(header, size, PATH)
    assert info.value.requirement == "SAF-14" and "'e'" in info.value.message


# ---------------------------------------------------------------- issue 23: context integers too long to print


@pytest.mark.parametrize("sign", [1, -1])
def test_a_context_integer_of_more_than_4300_digits_is_shown_by_its_size(tmp_path: Path, sign: int) -> None:
    url = tmp_path / "runs" / "ck"
    step = sign * 10**5000
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensor("weights", "w", np.zeros(2, np.float32))
        w.write_context("provenance", {"created_at": "2026-01-01T00:00:00Z", "step": step, "x": [step]})
    bits = f"integer of {step.bit_length()} bits"
    for command in (("inspect", str(url)), ("ls", str(url.parent))):
        result = run_cli(*command)
        assert result.exit_code == 0 and bits in result.stdout, result.stdout + result.stderr
        result = run_cli(*command, "--json")
        assert result.exit_code == 0 and bits in result.stdout, result.stdout + result.stderr
        json.loads(result.stdout)
    assert run_cli("inspect", "--json", str(url)).json()["step"] == f"<{'negative ' * (sign < 0)}{bits}>"
