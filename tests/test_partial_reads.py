"""Partial reads read only what they need and still verify it (spec/blocks.md, BLK-5; issue 24).

Bytes are counted where they leave the store: a flipped byte in a block a read touches is caught by that read;
one outside it is never read at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.digests import DEFAULT_ALGORITHM
from ckptfmt.errors import DigestMismatchError
from ckptfmt.storage import Store
from ckptfmt.storage.local import LocalStore
from ckptfmt.storage.remote import FsspecStore

PROVENANCE = {"writer": {"name": "t", "version": "1"}, "created_at": "2026-12-01T00:00:00Z", "host": "h", "step": 0}
ROWS, COLS = 512, 1024  # 2 MiB of F32: 512 blocks of 4 KiB, one row per block


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int, int]]]:
    """Every range a store reads (local disk or fsspec: memory, S3 over ranged GETs): (path, begin, end)."""
    seen: list[tuple[str, int, int]] = []
    for store_class in (LocalStore, FsspecStore):
        original = store_class.read_ranges

        def counting(self: Store, path: str, requests: Any, _original: Any = original, **kw: Any) -> None:
            seen.extend((path, begin, begin + len(view)) for begin, view in requests)
            _original(self, path, requests, **kw)

        monkeypatch.setattr(store_class, "read_ranges", counting)
    yield seen


def _write(
    root: Path | str, *, block_bytes: int | None = 4096, parts: int = 1, digest: str = DEFAULT_ALGORITHM
) -> np.ndarray[Any, Any]:
    full = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    step = ROWS // parts
    with ckptfmt.open_writer(root, profile="weights", block_bytes=block_bytes, digest=digest) as w:
        for p in range(parts):
            w.write_tensor(
                "weights", "emb", full[p * step : (p + 1) * step], global_shape=full.shape, offsets=(p * step, 0)
            )
        w.write_context("provenance", PROVENANCE)
    return full


def _data_bytes(seen: list[tuple[str, int, int]], first_chunk: int) -> int:
    return sum(end - max(begin, first_chunk) for _, begin, end in seen if end > first_chunk)


def _flip(root: Path, path: str, at: int) -> None:
    file = root / path
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def test_read_slice_of_a_few_rows_reads_kilobytes_verified(store_url: str, counted: list[tuple[str, int, int]]) -> None:
    full = _write(store_url)
    with ckptfmt.open(store_url) as ckpt:
        chunk = ckpt.tensor("weights", "emb").chunks[0]
        rows = ckpt.read_slice("weights", "emb", (200, 0), (3, COLS))
        assert np.array_equal(rows, full[200:203])
        assert _data_bytes(counted, chunk.begin) == 3 * 4096  # the three blocks of the three rows, no more
        assert ckpt.bytes_read == 3 * 4096


def test_a_flipped_byte_in_a_touched_block_is_caught_and_one_outside_is_never_read(
    tmp_path: Path, counted: list[tuple[str, int, int]]
) -> None:
    full = _write(tmp_path)
    with ckptfmt.open(tmp_path) as ckpt:
        chunk = ckpt.tensor("weights", "emb").chunks[0]
    row = chunk.begin + 200 * COLS * 4
    # Outside the rows read (the next block): the read succeeds and never fetches that byte.
    _flip(tmp_path, chunk.path, row + 3 * 4096 + 17)
    with ckptfmt.open(tmp_path) as ckpt:
        assert np.array_equal(ckpt.read_slice("weights", "emb", (200, 10), (3, 5)), full[200:203, 10:15])
    assert all(not (b <= row + 3 * 4096 + 17 < e) for _, b, e in counted)
    # Inside a block the read touches, even outside the elements it returns: refused, naming the block.
    _flip(tmp_path, chunk.path, row + 4096 + 4000)
    with ckptfmt.open(tmp_path) as ckpt, pytest.raises(DigestMismatchError) as info:
        ckpt.read_slice("weights", "emb", (200, 10), (3, 5))
    assert info.value.requirement == "BLK-5" and info.value.tensor == "emb" and "block 201" in info.value.message
    # A whole read and a verification see both.
    with ckptfmt.open(tmp_path) as ckpt, pytest.raises(DigestMismatchError):
        ckpt.read_tensor("weights", "emb")
    report = ckptfmt.verify(tmp_path)
    assert {p.requirement for p in report.problems} >= {"DIG-4", "BLK-6"}


def test_without_block_digests_a_verified_partial_read_reads_the_whole_chunk(
    tmp_path: Path, counted: list[tuple[str, int, int]]
) -> None:
    full = _write(tmp_path, block_bytes=None, digest="xxh3-128")  # flat: 1.0 (a tree digest would say 1.3)
    with ckptfmt.open(tmp_path) as ckpt:
        assert ckpt.format_version == "1.0"
        chunk = ckpt.tensor("weights", "emb").chunks[0]
        assert np.array_equal(ckpt.read_slice("weights", "emb", (200, 0), (3, COLS)), full[200:203])
        assert _data_bytes(counted, chunk.begin) == chunk.nbytes
        counted.clear()
        assert np.array_equal(ckpt.read_slice("weights", "emb", (200, 0), (3, COLS), verify=False), full[200:203])
        assert _data_bytes(counted, chunk.begin) == 3 * COLS * 4


@pytest.mark.parametrize("readers", [3, 2])
def test_a_four_way_tensor_read_by_fewer_ranks_reads_about_one_share_each(
    store_url: str, counted: list[tuple[str, int, int]], readers: int
) -> None:
    full = _write(store_url, parts=4)
    total = full.nbytes
    with ckptfmt.open(store_url) as ckpt:
        first = min(c.begin for c in ckpt.tensor("weights", "emb").chunks)
        for r in range(readers):
            lo, hi = r * ROWS // readers, (r + 1) * ROWS // readers
            counted.clear()
            got = ckpt.read_slice("weights", "emb", (lo, 0), (hi - lo, COLS))
            assert np.array_equal(got, full[lo:hi])
            share = _data_bytes(counted, first) / total
            assert share <= 1 / readers + 2 * 4096 / total + 1e-9, share
