"""Tree digests (spec/tree-digests.md, format 1.3): property tests against an independent implementation of the
definitions, the writer's and the verifier's one pass, flipped bytes, and 1.0-1.2 checkpoints under their own rules.

``ref_*`` below follow the spec text, with xxhash and hashlib only: the library's values must equal them.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt.errors import ManifestError
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.safetensors_io import build_header
from ckptfmt.storage import open_store
from ckptfmt.tree_digests import LEAF_BYTES, FileTreeHasher, chunk_digest_of, file_digest_of, file_hasher

ROOT = Path(__file__).resolve().parent.parent
L = 1 << 16
ALGORITHMS = ("xxh3-128-tree", "sha256-tree")


def ref_hash(base: str, data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data) if base == "xxh3-128" else hashlib.sha256(data).digest()


def ref_chunk_tree(base: str, data: bytes) -> bytes:
    pieces = [data[i : i + L] for i in range(0, len(data), L)]
    return ref_hash(
        base, b"ckptfmt/tree/chunk" + b"".join(struct.pack("<Q", len(p)) + ref_hash(base, p) for p in pieces)
    )


def ref_segment(base: str, data: bytes) -> bytes:
    return ref_hash(base, data) if len(data) <= L else ref_chunk_tree(base, data)


def ref_file_tree(base: str, data: bytes) -> bytes:
    """The file tree hash of a valid data file: its header segment, then its non-empty entries in offset order."""
    (n,) = struct.unpack_from("<Q", data)
    table = json.loads(data[8 : 8 + n])
    table.pop("__metadata__", None)
    spans = sorted((8 + n + b, 8 + n + e) for b, e in (v["data_offsets"] for v in table.values()) if e > b)
    segments = [data[: 8 + n]] + [data[b:e] for b, e in spans]
    return ref_hash(
        base, b"ckptfmt/tree/file" + b"".join(struct.pack("<Q", len(s)) + ref_segment(base, s) for s in segments)
    )


SIZES = st.one_of(st.sampled_from([0, 1, L - 1, L, L + 1, 2 * L, 2 * L + 7]), st.integers(0, 3 * L))


@st.composite
def data_files(draw: st.DrawFn) -> bytes:
    """A valid safetensors data file of U8 entries of random sizes (empty ones and piece boundaries included)."""
    sizes = draw(st.lists(SIZES, min_size=0, max_size=4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    header, _ = build_header([(f"t{i}", "U8", (n,), n) for i, n in enumerate(sizes)])
    return header + b"".join(rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes)


# ---------------------------------------------------------------- the definitions


@settings(max_examples=40, deadline=None)
@given(data=st.one_of(SIZES.map(bytes), st.binary(max_size=300)), algorithm=st.sampled_from(ALGORITHMS))
def test_a_chunk_tree_digest_is_the_spec_s_recomputation(data: bytes, algorithm: str) -> None:
    base = algorithm.removesuffix("-tree")
    assert chunk_digest_of(algorithm, data) == f"{algorithm}:{ref_chunk_tree(base, data).hex()}"


@settings(max_examples=40, deadline=None)
@given(data=data_files(), algorithm=st.sampled_from(ALGORITHMS), cuts=st.lists(st.integers(0, 4 * L), max_size=6))
def test_a_file_tree_digest_is_the_spec_s_recomputation_however_the_bytes_arrive(
    data: bytes, algorithm: str, cuts: list[int]
) -> None:
    want = f"{algorithm}:{ref_file_tree(algorithm.removesuffix('-tree'), data).hex()}"
    assert file_digest_of(algorithm, data) == want
    hasher = file_hasher(algorithm)  # the hasher of a persist, a peer copy, a heal: slices cut anywhere
    at = 0
    for cut in sorted(c for c in cuts if c < len(data)):
        hasher.update(memoryview(data)[at:cut])
        at = cut
    hasher.update(memoryview(data)[at:])
    assert f"{algorithm}:{hasher.hexdigest()}" == want


@settings(max_examples=40, deadline=None)
@given(data=data_files(), algorithm=st.sampled_from(ALGORITHMS), where=st.floats(0, 1, exclude_max=True))
def test_a_flipped_byte_anywhere_changes_the_file_tree_digest(data: bytes, algorithm: str, where: float) -> None:
    flipped = bytearray(data)
    flipped[int(where * len(data))] ^= 0x01
    assert file_digest_of(algorithm, bytes(flipped)) != file_digest_of(algorithm, data)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(min_size=1, max_size=3 * L + 5), where=st.floats(0, 1, exclude_max=True))
def test_a_flipped_byte_anywhere_changes_the_chunk_tree_digest(data: bytes, where: float) -> None:
    flipped = bytearray(data)
    flipped[int(where * len(data))] ^= 0x80
    assert chunk_digest_of("xxh3-128-tree", bytes(flipped)) != chunk_digest_of("xxh3-128-tree", data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 8) + b"{}      " + b"trailing",  # bytes after the data section
        struct.pack("<Q", 200) + b"{}",  # shorter than its header says
        struct.pack("<Q", 8) + b"[]      ",  # not an object
        struct.pack("<Q", 10**9),  # a header length SAF-2 refuses
        b"\x82\xa4text\xa5hello",  # a MessagePack blob
    ],
)
def test_bytes_that_are_no_data_file_have_no_file_tree_digest(data: bytes) -> None:
    hasher = FileTreeHasher("xxh3-128-tree")
    hasher.update(data)
    value = hasher.hexdigest()
    assert value.startswith("none (not a data file") and hasher.problem is not None
    assert re.fullmatch(r"[0-9a-f]{32}", value) is None


def test_the_spec_s_test_vectors() -> None:
    rows = re.findall(r"^\| (chunk|file): (.+?) \| `([a-z0-9-]+):([0-9a-f]+)` \|$", _spec(), re.M)
    assert len(rows) == 8
    inputs = {
        "empty": b"",
        "`abc` (`61 62 63`)": b"abc",
        "`abc`": b"abc",
        "65,537 bytes `00` (two pieces)": bytes(65537),
    }
    inputs["65,537 bytes `00`"] = bytes(65537)
    smallest = struct.pack("<Q", 8) + b"{}      "
    for kind, what, algorithm, hexpart in rows:
        if kind == "chunk":
            assert chunk_digest_of(algorithm, inputs[what]) == f"{algorithm}:{hexpart}", what
        else:
            assert file_digest_of(algorithm, smallest) == f"{algorithm}:{hexpart}"


def _spec() -> str:
    return (ROOT / "spec" / "tree-digests.md").read_text()


# ---------------------------------------------------------------- the writer and verification


def _write(url: str, arrays: dict[str, np.ndarray[Any, Any]], **options: Any) -> dict[str, Any]:
    with ckptfmt.open_writer(url, profile="weights", **options) as w:
        w.write_tensors("weights", arrays)
        w.write_context("provenance", {"step": 1})
    return dict(json.loads(open_store(url).read("manifest.json")))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(SIZES, min_size=1, max_size=4),
    block_bytes=st.sampled_from([None, 4096, L, 1 << 17]),
    algorithm=st.sampled_from(ALGORITHMS),
    codec=st.sampled_from([None, "zstd"]),
)
def test_what_the_writer_writes_is_the_spec_s_recomputation_and_verifies(
    sizes: list[int], block_bytes: int | None, algorithm: str, codec: str | None
) -> None:
    """Random chunk layouts and block sizes: every chunk and file digest equals the recomputation from the bytes,
    the checkpoint says 1.3, verification passes, and a flipped byte in any data file is reported."""
    rng = np.random.default_rng(len(sizes))
    arrays = {f"t{i}": (rng.standard_normal(n // 4) * 0.01).astype(np.float32) for i, n in enumerate(sizes)}
    with tempfile.TemporaryDirectory() as root:
        _check_written(root, arrays, algorithm, block_bytes, codec, rng)


def _check_written(
    url: str,
    arrays: dict[str, np.ndarray[Any, Any]],
    algorithm: str,
    block_bytes: int | None,
    codec: str | None,
    rng: np.random.Generator,
) -> None:
    doc = _write(url, arrays, digest=algorithm, block_bytes=block_bytes, codec=codec)
    store = open_store(url)
    base = algorithm.removesuffix("-tree")
    assert doc["format_version"] == "1.3"
    for record in doc["files"]:
        data = store.read(record["path"])
        if record["path"].endswith(".safetensors"):
            assert record["digest"] == f"{algorithm}:{ref_file_tree(base, data).hex()}"
        else:  # a context blob: flat (TRE-2)
            assert record["digest"] == f"{base}:{ref_hash(base, data).hex()}"
    for tensor in doc["fields"]["weights"]["tensors"].values():
        for chunk in tensor["chunks"]:
            begin, end = chunk["range"]
            data = store.read(chunk["path"])[begin:end]
            flat = end - begin <= L
            value = ref_hash(base, data) if flat else ref_chunk_tree(base, data)
            assert chunk["digest"] == f"{base if flat else algorithm}:{value.hex()}"
            if "blocks" in chunk:
                size = chunk["blocks"]["size"]
                want = "".join(ref_hash(base, data[i : i + size]).hex() for i in range(0, len(data), size))
                assert chunk["blocks"]["digests"] == want
    assert ckptfmt.verify(url).ok
    path = next(r["path"] for r in doc["files"] if r["path"].endswith(".safetensors"))
    data = bytearray(store.read(path))
    data[int(rng.integers(0, len(data)))] ^= 0x04  # anywhere: the header too
    (Path(url) / path).write_bytes(bytes(data))
    report = ckptfmt.verify(url)
    assert not report.ok and {p.path for p in report.problems} == {path}


def test_a_verification_names_the_chunk_and_block_a_flipped_byte_is_in(tmp_path: Path) -> None:
    arrays = {"big": np.arange(3 * L // 4 + 5, dtype=np.float32), "small": np.ones(8, np.float32)}
    doc = _write(str(tmp_path), arrays)
    chunk = doc["fields"]["weights"]["tensors"]["big"]["chunks"][0]
    assert chunk["digest"].startswith("xxh3-128-tree:") and chunk["blocks"]["size"] == LEAF_BYTES
    path = tmp_path / chunk["path"]
    data = bytearray(path.read_bytes())
    data[chunk["range"][0] + L + 3] ^= 0x01  # in block 1
    path.write_bytes(bytes(data))
    problems = ckptfmt.verify(str(tmp_path)).problems
    assert [(p.tensor, p.requirement) for p in problems] == [("big", "BLK-6"), ("big", "DIG-4"), (None, "DIG-4")]
    assert "block 1 " in problems[0].message
    with pytest.raises(ckptfmt.DigestMismatchError) as info:  # a whole read checks the chunk tree digest
        ckptfmt.open(str(tmp_path)).read_tensor("weights", "big")
    assert info.value.tensor == "big"


def test_flat_digests_write_what_1_2_wrote(tmp_path: Path) -> None:
    """digest="xxh3-128": a 1.2 checkpoint (blocks) whose digests are all flat, which a 1.2 reader checks."""
    arrays = {"big": np.arange(L, dtype=np.float32)}
    doc = _write(str(tmp_path), arrays, digest="xxh3-128")
    assert doc["format_version"] == "1.2"
    digests = [r["digest"] for r in doc["files"]] + [doc["fields"]["weights"]["tensors"]["big"]["chunks"][0]["digest"]]
    assert all(d.startswith("xxh3-128:") for d in digests)
    for record in doc["files"]:
        assert record["digest"] == "xxh3-128:" + xxhash.xxh3_128_hexdigest((tmp_path / record["path"]).read_bytes())


@pytest.mark.parametrize(
    "name", ["weights", "blocks", "blocks-sha256", "zstd", "mixed-digests", "ref-blocks", "training-full"]
)
def test_checkpoints_of_1_0_to_1_2_verify_under_their_own_rules(name: str) -> None:
    """Vectors written before 1.3 (flat digests): still valid, verified by the 1.2 rules (golden checkpoints:
    tests/test_golden.py)."""
    about = json.loads((ROOT / "conformance" / "vectors" / "valid" / name / "about.json").read_text())
    url = ROOT / "conformance" / "vectors" / "valid" / name / "checkpoint"
    if not url.exists():
        pytest.skip(f"no vector {name}")
    doc = json.loads((url / "manifest.json").read_text())
    assert doc["format_version"] in ("1.0", "1.1", "1.2"), about
    assert not any("-tree:" in r["digest"] for r in doc["files"])
    with ckptfmt.open(str(url)) as ckpt:
        assert ckpt.verify().ok


def test_a_tree_digest_on_a_file_without_chunks_is_refused() -> None:
    """TRE-2, from the manifest alone."""
    raw = ROOT / "conformance" / "vectors" / "invalid" / "tree-digest-on-blob" / "checkpoint" / "manifest.json"
    with pytest.raises(ManifestError) as info:
        parse_manifest(raw.read_bytes())
    assert info.value.requirement == "TRE-2" and info.value.path == "provenance/context.msgpack"


def test_a_broken_header_is_reported_and_every_chunk_still_checked_from_its_bytes(tmp_path: Path) -> None:
    """The file tree's pieces follow the header: with the header refused (SAF-16), verification reports it and the
    file digest, and checks each chunk from its own bytes (which are intact)."""
    doc = _write(str(tmp_path), {"big": np.arange(L, dtype=np.float32), "small": np.ones(3, np.float32)})
    path = next(r["path"] for r in doc["files"] if r["path"].endswith(".safetensors"))
    data = bytearray((tmp_path / path).read_bytes())
    data[8] = ord(" ")  # the header no longer begins with "{"
    (tmp_path / path).write_bytes(bytes(data))
    report = ckptfmt.verify(str(tmp_path))
    assert {p.requirement for p in report.problems} == {"SAF-16", "DIG-4"}
    assert [p.tensor for p in report.problems if p.requirement == "DIG-4"] == [None]  # the file's, no chunk's
    assert report.chunks_checked == 2
