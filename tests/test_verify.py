"""verify(): every file re-read, every problem reported (not just the first), quick mode checks sizes only."""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.canonical import config_hash
from ckptfmt.context import encode
from ckptfmt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    DigestMismatchError,
    IncompleteCheckpointError,
    MissingFileError,
    SizeMismatchError,
)
from ckptfmt.read_plan import Target
from ckptfmt.reader import open_for_verify

Raw = Any  # the conftest ``raw`` helper bundle
WEIGHTS_FILE = "weights/r00000-00000.safetensors"
OPTIMIZER_FILE = "optimizer/r00000-00000.safetensors"


@pytest.fixture
def training(store_url: str, write_training: Callable[..., str]) -> str:
    write_training(store_url)
    return store_url


def codes(report: ckptfmt.VerifyReport) -> Counter[str]:
    return Counter(p.code for p in report.problems)


def flip(url: str, raw: Raw, path: str, offset: int) -> None:
    data = bytearray(ckptfmt.open_store(url).read(path))
    data[offset] ^= 0x01
    raw.put(url, path, bytes(data))


def chunk_of(url: str, field: str, tensor: str) -> ckptfmt.ChunkRecord:
    return ckptfmt.open(url).tensor(field, tensor).chunks[0]


def test_a_good_checkpoint_is_ok(training: str) -> None:
    report = ckptfmt.verify(training)
    ckpt = ckptfmt.open(training)
    assert report.ok and report.problems == []
    assert report.checkpoint_id == ckpt.id
    assert report.files_checked == len(ckpt.manifest.files)
    assert report.bytes_checked == ckpt.manifest.total_bytes
    assert report.chunks_checked == sum(len(t.chunks) for f in ckpt.fields.values() for t in f.tensors.values())
    assert report.to_dict()["ok"] is True
    seen: list[int] = []
    assert ckpt.verify(progress=seen.append).ok
    assert sum(seen) == ckpt.manifest.total_bytes


def test_sharded_empty_and_zero_d_tensors_verify(store_url: str) -> None:
    full = np.arange(30, dtype=np.float64).reshape(5, 6)
    with ckptfmt.open_writer(store_url, profile="weights", target_file_size=40) as w:
        w.write_tensors("weights", {"empty": np.zeros((0, 3)), "scalar": np.float32(2), "e2": np.zeros(0, np.int8)})
        for r0, r1 in [(0, 1), (1, 4), (4, 5)]:
            w.write_tensor("weights", "t", full[r0:r1], global_shape=(5, 6), offsets=(r0, 0))
    for quick in (False, True):
        assert ckptfmt.verify(store_url, quick=quick).ok


def test_a_flipped_byte_is_caught_by_file_and_chunk_digest(training: str, raw: Raw) -> None:
    chunk = chunk_of(training, "weights", "layer0.w")
    flip(training, raw, chunk.path, chunk.begin + 3)
    report = ckptfmt.verify(training)
    assert codes(report) == {"digest_mismatch": 2}
    by_tensor = {p.tensor: p for p in report.problems}
    assert by_tensor["layer0.w"].path == chunk.path and by_tensor["layer0.w"].field == "weights"
    assert by_tensor[None].path == chunk.path  # the whole-file digest
    assert "layer0.w" in str(by_tensor["layer0.w"])


def test_a_flipped_byte_in_a_context_blob(training: str, raw: Raw) -> None:
    data = bytearray(ckptfmt.open_store(training).read("topology/context.msgpack"))
    data[-1] ^= 0x02
    raw.put(training, "topology/context.msgpack", bytes(data))
    report = ckptfmt.verify(training)
    assert codes(report)["digest_mismatch"] == 1
    assert all(p.path == "topology/context.msgpack" for p in report.problems)


def test_a_truncated_file(training: str, raw: Raw) -> None:
    data = ckptfmt.open_store(training).read(WEIGHTS_FILE)
    raw.put(training, WEIGHTS_FILE, data[:-4])
    report = ckptfmt.verify(training)
    assert codes(report) == {"size_mismatch": 1}
    assert report.problems[0].path == WEIGHTS_FILE


def test_an_extended_file(training: str, raw: Raw) -> None:
    data = ckptfmt.open_store(training).read(WEIGHTS_FILE)
    raw.put(training, WEIGHTS_FILE, data + b"polyglot")
    assert codes(ckptfmt.verify(training)) == {"size_mismatch": 1}


def test_a_missing_file(training: str, raw: Raw) -> None:
    raw.delete(training, OPTIMIZER_FILE)
    report = ckptfmt.verify(training)
    assert codes(report) == {"missing_file": 1}
    assert report.problems[0].path == OPTIMIZER_FILE
    assert report.problems[0].field == "optimizer"


@pytest.mark.parametrize("length", [2**63, 100_000_001, None], ids=["huge", "over-limit", "past-eof"])
def test_a_forged_header_length(training: str, raw: Raw, length: int | None) -> None:
    data = ckptfmt.open_store(training).read(WEIGHTS_FILE)
    forged = len(data) if length is None else length
    raw.put(training, WEIGHTS_FILE, struct.pack("<Q", forged) + data[8:])
    report = ckptfmt.verify(training)
    assert codes(report) == {"safetensors_header": 1, "digest_mismatch": 1}
    assert {p.path for p in report.problems} == {WEIGHTS_FILE}
    assert codes(ckptfmt.verify(training, quick=True)) == {"safetensors_header": 1}


def test_a_shorter_header_length_that_still_parses_is_caught(training: str, raw: Raw) -> None:
    # Moving the data start makes the header JSON end early: invalid JSON or a mismatch, never silence.
    data = ckptfmt.open_store(training).read(WEIGHTS_FILE)
    (n,) = struct.unpack("<Q", data[:8])
    raw.put(training, WEIGHTS_FILE, struct.pack("<Q", n - 8) + data[8:])
    assert codes(ckptfmt.verify(training))["safetensors_header"] == 1


def rewrite_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """Re-encode a file's header after ``edit``, keeping its length (pad with spaces)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    return data[:8] + text + b" " * (n - len(text)) + data[8 + n :]


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["layer0.w"].update(dtype="I32"),  # same size, other dtype
        lambda h: h["layer0.w"].update(shape=[3, 4]),  # same size, other shape
        lambda h: h.update({"layer0.x": h.pop("layer0.w")}),  # key renamed
    ],
    ids=["dtype", "shape", "key"],
)
def test_a_header_disagreeing_with_the_manifest(
    training: str, raw: Raw, edit: Callable[[dict[str, Any]], None]
) -> None:
    data = ckptfmt.open_store(training).read(WEIGHTS_FILE)
    raw.forge(training, WEIGHTS_FILE, rewrite_header(data, edit))  # file digest updated: only the header is wrong
    for quick in (False, True):
        report = ckptfmt.verify(training, quick=quick)
        assert codes(report) == {"safetensors_header": 1}
        assert report.problems[0].tensor == "layer0.w"


def test_swapped_data_offsets_are_caught(training: str, raw: Raw) -> None:
    def swap(header: dict[str, Any]) -> None:
        w, b = header["layer0.w"], header["layer0.b"]
        # b (12 bytes) first, then w (48 bytes): a valid file, but not the one the manifest describes
        b["data_offsets"], w["data_offsets"] = [0, 12], [12, 60]

    data = ckptfmt.open_store(training).read(WEIGHTS_FILE)
    raw.forge(training, WEIGHTS_FILE, rewrite_header(data, swap))
    report = ckptfmt.verify(training)
    assert codes(report)["safetensors_header"] == 2
    assert {p.tensor for p in report.problems if p.code == "safetensors_header"} == {"layer0.w", "layer0.b"}


def test_an_undecodable_blob_with_a_matching_digest(training: str, raw: Raw) -> None:
    raw.forge(training, "data/context.msgpack", b"\xc1 not msgpack")
    report = ckptfmt.verify(training)
    assert codes(report) == {"invalid_context": 1}
    assert report.problems[0].field == "data"


def test_all_problems_are_reported_at_once(training: str, raw: Raw) -> None:
    chunk = chunk_of(training, "weights", "layer0.b")
    flip(training, raw, chunk.path, chunk.begin)  # 2: chunk and file digest
    data = ckptfmt.open_store(training).read(OPTIMIZER_FILE)
    raw.put(training, OPTIMIZER_FILE, data[:10])  # 1: size
    raw.delete(training, "rng/context.msgpack")  # 1: missing
    bad_config = encode({"config": {"lr": 1}, "hash": config_hash({"lr": 2})})
    raw.forge(training, "config/context.msgpack", bad_config)  # 1: config hash
    data = ckptfmt.open_store(training).read("topology/context.msgpack")
    raw.put(training, "topology/context.msgpack", data + b"\x00")  # 1: size
    report = ckptfmt.verify(training)
    assert len(report.problems) == 6, [str(p) for p in report.problems]
    assert codes(report) == {"digest_mismatch": 2, "size_mismatch": 2, "missing_file": 1, "config_hash_mismatch": 1}
    # the codes are the error classes' (a problem is an error reported instead of raised)
    assert {DigestMismatchError.code, SizeMismatchError.code, MissingFileError.code} <= set(codes(report))
    assert not report.ok
    as_dict = report.to_dict()
    assert as_dict["ok"] is False and len(as_dict["problems"]) == 6
    # quick mode: sizes, presence and content rules, no digests
    quick = ckptfmt.verify(training, quick=True)
    assert codes(quick) == {"size_mismatch": 2, "missing_file": 1, "config_hash_mismatch": 1}


def test_quick_skips_digests_but_not_sizes(training: str, raw: Raw) -> None:
    chunk = chunk_of(training, "weights", "layer0.w")
    flip(training, raw, chunk.path, chunk.begin)
    quick = ckptfmt.verify(training, quick=True)
    assert quick.ok and quick.quick and quick.bytes_checked == 0
    assert not ckptfmt.verify(training).ok
    data = ckptfmt.open_store(training).read(OPTIMIZER_FILE)
    raw.put(training, OPTIMIZER_FILE, data[:-1])
    assert codes(ckptfmt.verify(training, quick=True)) == {"size_mismatch": 1}


def test_verify_of_something_that_cannot_be_opened(training: str, raw: Raw) -> None:
    raw.delete(training, "manifest.json")
    report = ckptfmt.verify(training)
    assert codes(report) == {"incomplete": 1}
    assert report.checkpoint_id is None and not report.ok


def test_verify_of_an_empty_location(store_url: str) -> None:
    assert codes(ckptfmt.verify(store_url)) == {"not_found": 1}


def test_verify_of_an_unknown_major(training: str, raw: Raw) -> None:
    raw.edit_manifest(training, lambda d: d.update(format_version="2.0"))
    assert codes(ckptfmt.verify(training)) == {"unsupported_version": 1}


def test_a_flipped_block_is_the_same_error_to_a_read_and_to_verify(store_url: str, raw: Raw) -> None:
    """One span hasher: the read executor's check raises (BLK-5) what verification reports (BLK-6)."""
    with ckptfmt.open_writer(store_url, profile="weights", block_bytes=4096) as w:
        w.write_tensor("weights", "w", np.arange(4 * 4096, dtype=np.float32).reshape(16, 1024))
    chunk = chunk_of(store_url, "weights", "w")
    flip(store_url, raw, chunk.path, chunk.begin + 2 * 4096 + 5)
    with ckptfmt.open(store_url) as ckpt, pytest.raises(DigestMismatchError) as raised:
        ckpt.check_regions([Target("weights", "w", "F32", (2, 0), (1, 1024))])  # row 2: block 2 alone
    report = ckptfmt.verify(store_url)
    blocks = [p for p in report.problems if p.requirement == "BLK-6"]
    assert [p.message for p in blocks] == [raised.value.message] and raised.value.requirement == "BLK-5"
    assert blocks[0].tensor == raised.value.tensor == "w" and "block 2 " in blocks[0].message
    assert codes(report) == {"digest_mismatch": 3}  # the block, the chunk, the file


def test_one_rule_for_what_cannot_be_opened(training: str, raw: Raw, tmp_path: Path) -> None:
    """An unopenable checkpoint is a report; a caller names the errors it treats as its own (``ckpt verify``:
    nothing there), which then propagate."""

    def about_the_request(exc: CheckpointError) -> bool:
        return isinstance(exc, CheckpointNotFoundError)

    nothing = str(tmp_path / "nothing")
    report = open_for_verify(nothing)
    assert isinstance(report, ckptfmt.VerifyReport) and codes(report) == {"not_found": 1}
    with pytest.raises(CheckpointNotFoundError):
        open_for_verify(nothing, raise_if=about_the_request)
    raw.delete(training, "manifest.json")
    report = open_for_verify(training, quick=True, raise_if=about_the_request)
    assert isinstance(report, ckptfmt.VerifyReport) and report.quick
    assert codes(report) == {IncompleteCheckpointError.code: 1} and report.checkpoint_id is None
