"""Block digests as a format (spec/blocks.md, BLK-1..4, BLK-6; VER-1): what the parser refuses, what the writer
writes, what verification reports, and that a reader which ignores ``blocks`` (1.0, 1.1) still verifies.

Partial reads over blocks (BLK-5) are tested in tests/test_partial_reads.py and tests/test_read_plan.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from crash.golden import GOLDEN

import ckptfmt
from ckptfmt.blocks import DEFAULT_BLOCK_BYTES
from ckptfmt.canonical import manifest_bytes
from ckptfmt.errors import ManifestError, UsageError
from ckptfmt.manifest_parse import parse_manifest

Json = dict[str, Any]
B = 4096
HASHES: dict[str, Callable[[bytes], str]] = {
    "xxh3-128": lambda b: xxhash.xxh3_128_hexdigest(b),
    "sha256": lambda b: hashlib.sha256(b).hexdigest(),
}


def write(url: Path, *, codec: str | None = None, digest: str = "xxh3-128", block_bytes: int | None = B) -> Json:
    """w: 5120 bytes (a full and a short block); s: two chunks of 6144 bytes; ids: integers (raw under zstd too);
    tiny: smaller than a block. Returns the manifest."""
    rng = np.random.default_rng(0)
    with ckptfmt.open_writer(url, profile="weights", codec=codec, digest=digest, block_bytes=block_bytes) as w:
        w.write_tensor("weights", "w", rng.standard_normal((20, 64)).astype(np.float32))
        s = rng.standard_normal((48, 64)).astype(np.float32)
        for start in (0, 24):
            w.write_tensor("weights", "s", s[start : start + 24], global_shape=(48, 64), offsets=(start, 0))
        w.write_tensor("weights", "ids", np.arange(1200, dtype=np.int64))
        w.write_tensor("weights", "tiny", np.arange(3, dtype=np.float32))
        w.write_context("provenance", {"created_at": "2025-01-01T00:00:00Z"})
    return dict(json.loads((url / "manifest.json").read_bytes()))


def chunks(doc: Json) -> Iterator[tuple[str, Json]]:
    for name, tensor in doc["fields"]["weights"]["tensors"].items():
        for chunk in tensor["chunks"]:
            yield name, chunk


def chunk_w(doc: Json) -> Json:
    return doc["fields"]["weights"]["tensors"]["w"]["chunks"][0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    url = tmp_path_factory.mktemp("blocks") / "ck"
    write(url)
    return url


@pytest.fixture(scope="module")
def doc(blocked: Path) -> Json:
    return dict(json.loads((blocked / "manifest.json").read_bytes()))


@pytest.fixture(scope="module")
def zstd_doc(tmp_path_factory: pytest.TempPathFactory) -> Json:
    return write(tmp_path_factory.mktemp("zstd") / "ck", codec="zstd")


def refusal(doc: Json) -> ManifestError:
    """The parser's refusal of ``doc``, the same from canonical and from other JSON text (fast and slow paths)."""
    with pytest.raises(ManifestError) as canonical:
        parse_manifest(manifest_bytes(doc))
    with pytest.raises(ManifestError) as other:
        parse_manifest(json.dumps(doc, indent=1).encode())
    assert (other.value.requirement, other.value.message) == (canonical.value.requirement, canonical.value.message)
    return canonical.value


# ---------------------------------------------------------------- the parser (BLK-1, BLK-2, BLK-3)

GOOD = "0123456789abcdef" * 4  # 64 digits: w's two blocks under xxh3-128
BAD_BLOCKS: list[tuple[str, object, str]] = [
    ("not an object", GOOD, "BLK-1"),
    ("null", None, "BLK-1"),
    ("an array", [B, GOOD], "BLK-1"),
    ("size not a power of two", {"size": 6144, "digests": GOOD[:32]}, "BLK-1"),
    ("size below 4096", {"size": 2048, "digests": GOOD + GOOD[:32]}, "BLK-1"),
    ("size above 2^30", {"size": 1 << 31, "digests": GOOD[:32]}, "BLK-1"),
    ("size a bool", {"size": True, "digests": GOOD}, "BLK-1"),
    ("size a string", {"size": "4096", "digests": GOOD}, "BLK-1"),
    ("size missing", {"digests": GOOD}, "BLK-1"),
    ("digests one block short", {"size": B, "digests": GOOD[:32]}, "BLK-2"),
    ("digests one block long", {"size": B, "digests": GOOD + GOOD[:32]}, "BLK-2"),
    ("digests uppercase", {"size": B, "digests": GOOD.upper()}, "BLK-2"),
    ("digests not hex", {"size": B, "digests": "g" + GOOD[1:]}, "BLK-2"),
    ("digests an array", {"size": B, "digests": [GOOD[:32], GOOD[32:]]}, "BLK-2"),
    ("digests missing", {"size": B}, "BLK-2"),
]


@pytest.mark.parametrize(("blocks", "rule"), [b[1:] for b in BAD_BLOCKS], ids=[b[0] for b in BAD_BLOCKS])
def test_a_malformed_blocks_member_is_refused_naming_its_rule(doc: Json, blocks: object, rule: str) -> None:
    bad = copy.deepcopy(doc)
    chunk_w(bad)["blocks"] = blocks
    error = refusal(bad)
    assert error.requirement == rule and error.tensor == "w"
    assert "blocks" in error.message


def test_blocks_on_an_encoded_chunk_are_refused_blk3(zstd_doc: Json) -> None:
    bad = copy.deepcopy(zstd_doc)
    chunk = chunk_w(bad)
    assert chunk["codec"]["name"] == "zstd" and "blocks" not in chunk  # the writer writes none on encoded chunks
    n = chunk["range"][1] - chunk["range"][0]
    chunk["blocks"] = {"size": B, "digests": "0" * 32 * -(-n // B)}  # well-formed for the stored bytes
    error = refusal(bad)
    assert (error.requirement, error.tensor) == ("BLK-3", "w")


def test_blocks_a_reader_must_accept(doc: Json) -> None:
    """Blocks as large as 2^30 (one block), none on an empty chunk, unknown members inside (VER-5)."""
    ok = copy.deepcopy(doc)
    tiny = ok["fields"]["weights"]["tensors"]["tiny"]["chunks"][0]
    tiny["blocks"] = {"size": 1 << 30, "digests": tiny["digest"].partition(":")[2]}
    chunk_w(ok)["blocks"]["x-future"] = {"a": 1}
    manifest = parse_manifest(manifest_bytes(ok))
    record = manifest.fields["weights"].tensors["tiny"].chunks[0]
    assert record.blocks is not None and record.blocks.count(record.nbytes) == 1


# ---------------------------------------------------------------- the writer (BLK-4, VER-1)


def test_without_block_bytes_the_checkpoint_is_1_0_and_has_no_blocks(tmp_path: Path) -> None:
    doc = write(tmp_path / "ck", block_bytes=None)
    assert doc["format_version"] == "1.0"
    assert not any("blocks" in c for _, c in chunks(doc))


def test_the_default_block_size_writes_none_on_small_chunks(tmp_path: Path) -> None:
    """VER-1: 1.2 only when a chunk has blocks; at the default (64 KiB) none of these chunks is large enough."""
    doc = write(tmp_path / "ck", block_bytes=DEFAULT_BLOCK_BYTES)
    assert doc["format_version"] == "1.0"
    assert not any("blocks" in c for _, c in chunks(doc))


def test_with_blocks_the_checkpoint_is_1_2_and_only_chunks_larger_than_a_block_have_them(doc: Json) -> None:
    assert doc["format_version"] == "1.2"
    have = {(name, tuple(c["offsets"])) for name, c in chunks(doc) if "blocks" in c}
    assert have == {("w", (0, 0)), ("s", (0, 0)), ("s", (24, 0)), ("ids", (0,))}
    assert {c["blocks"]["size"] for _, c in chunks(doc) if "blocks" in c} == {B}


def test_zstd_with_blocks_is_1_2_and_encoded_chunks_have_none(zstd_doc: Json) -> None:
    assert zstd_doc["format_version"] == "1.2"
    for name, chunk in chunks(zstd_doc):
        encoded = chunk["codec"]["name"] != "raw"
        assert encoded == (name in ("w", "s")), name
        assert ("blocks" in chunk) == (name == "ids"), name


def block_problems(root: Path, doc: Json) -> list[str]:
    """Every chunk's block digests recomputed here, with xxhash or hashlib directly (not ckptfmt.blocks)."""
    wrong = []
    for name, chunk in chunks(doc):
        if "blocks" not in chunk:
            continue
        algorithm, _, _ = chunk["digest"].partition(":")
        size, digests = chunk["blocks"]["size"], chunk["blocks"]["digests"]
        begin, end = chunk["range"]
        data = (root / chunk["path"]).read_bytes()[begin:end]
        expected = "".join(HASHES[algorithm](data[i : i + size]) for i in range(0, len(data), size))
        assert HASHES[algorithm](data) == chunk["digest"].partition(":")[2]  # the chunk digest covers every byte
        if digests != expected:
            wrong.append(f"{name} {chunk['offsets']}")
    return wrong


@pytest.mark.parametrize("digest", ["xxh3-128", "sha256"])
def test_each_block_digest_is_the_digest_of_that_blocks_bytes(tmp_path: Path, digest: str) -> None:
    doc = write(tmp_path / "ck", digest=digest)
    assert len(chunk_w(doc)["blocks"]["digests"]) == 2 * len(HASHES[digest](b""))  # a full and a short block
    assert block_problems(tmp_path / "ck", doc) == []


def test_the_golden_1_2_block_digests_are_those_of_their_blocks() -> None:
    root = GOLDEN / "1.2" / "blocks"
    doc = json.loads((root / "manifest.json").read_bytes())
    assert sum(len(c["blocks"]["digests"]) // 32 for _, c in chunks(doc) if "blocks" in c) == 49 + 5 + 5 + 2
    assert block_problems(root, doc) == []


def test_a_block_size_the_format_refuses_is_a_usage_error(tmp_path: Path) -> None:
    for bad in (1000, 2048, 6144, 1 << 31):
        with pytest.raises(UsageError):
            ckptfmt.open_writer(tmp_path / f"ck{bad}", profile="weights", block_bytes=bad)


# ---------------------------------------------------------------- readers and verification (VER-5, BLK-6)


def test_a_reader_that_ignores_blocks_still_verifies_and_reads(blocked: Path, tmp_path: Path) -> None:
    """What a 1.0 or 1.1 reader sees: the manifest without ``blocks``; every chunk digest still holds."""
    copy_ = tmp_path / "old-reader-view"
    shutil.copytree(blocked, copy_)
    doc = json.loads((copy_ / "manifest.json").read_bytes())
    for _, chunk in chunks(doc):
        chunk.pop("blocks", None)
    (copy_ / "manifest.json").write_bytes(manifest_bytes(doc))
    report = ckptfmt.verify(copy_)
    assert report.ok, [str(p) for p in report.problems]
    with ckptfmt.open(copy_) as old, ckptfmt.open(blocked) as new:
        for name in ("w", "s", "ids"):
            assert np.array_equal(old.read_tensor("weights", name), new.read_tensor("weights", name))


def test_verify_reports_a_block_digest_that_contradicts_its_bytes_blk6(blocked: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tampered"
    shutil.copytree(blocked, tampered)
    doc = json.loads((tampered / "manifest.json").read_bytes())
    blocks = chunk_w(doc)["blocks"]
    blocks["digests"] = blocks["digests"][:32] + "0" * 32  # the short last block's digest; the chunk digest stays
    (tampered / "manifest.json").write_bytes(manifest_bytes(doc))
    report = ckptfmt.verify(tampered)
    assert [(p.requirement, p.tensor) for p in report.problems] == [("BLK-6", "w")]
    assert "block 1" in report.problems[0].message
    assert ckptfmt.verify(blocked).ok
