"""The executor's read side: coalesced runs, balanced groups, one store call per group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.executor import COALESCE_MAX_CHUNK, ChunkRead, coalesce, split_runs
from ckptfmt.manifest import ChunkRecord
from ckptfmt.storage import Store

DIGEST = "xxh3-128:" + "0" * 32


def _read(begin: int, end: int) -> ChunkRead:
    chunk = ChunkRecord(
        path="w/a", key=f"k{begin}", offsets=(0,), shape=(end - begin,), begin=begin, end=end, digest=DIGEST
    )
    return ChunkRead(chunk=chunk, out=memoryview(bytearray(end - begin)), field="w", tensor=f"t{begin}")


def test_coalesce_joins_back_to_back_small_chunks_only() -> None:
    big = COALESCE_MAX_CHUNK + 1
    reads = [_read(8, 16), _read(16, 40), _read(48, 56), _read(56, 56 + big), _read(56 + big, 64 + big)]
    runs = coalesce(list(reversed(reads)))
    assert [[r.chunk.begin for r in run] for run in runs] == [[8, 16], [48], [56], [56 + big]]


def test_split_runs_balances_bytes_in_contiguous_groups() -> None:
    runs = [[_read(i * 100, i * 100 + 100)] for i in range(8)]
    groups = split_runs(runs, 4)
    assert [len(g) for g in groups] == [2, 2, 2, 2]
    assert [r[0].chunk.begin for g in groups for r in g] == [i * 100 for i in range(8)]
    assert split_runs(runs, 1) == [runs]


def test_reading_a_field_asks_the_store_once_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {f"t{i}": np.full((16,), i, np.float32) for i in range(50)}
    with ckptfmt.open_writer(tmp_path, profile="weights") as w:
        w.write_tensors("weights", tensors)
    calls: list[tuple[str, int]] = []
    ckpt = ckptfmt.open(tmp_path)
    ckpt.read_tensor("weights", "t0")  # the file's header is checked once, on its first read
    original = type(ckpt.store).read_ranges

    def counting(self: Store, path: str, requests: Any) -> None:
        calls.append((path, len(requests)))
        original(self, path, requests)

    monkeypatch.setattr(type(ckpt.store), "read_ranges", counting)
    out = ckpt.read_tensors("weights", workers=1)
    assert all(np.array_equal(out[n], t) for n, t in tensors.items())
    assert calls == [("weights/r00000-00000.safetensors", 1)]  # 50 tensors, one ranged read
    assert ckpt.bytes_read == 51 * 64
