"""The read executor and the store's range merging: one ``read_ranges`` call per file and task, adjacent ranges
merged by the store into one ``preadv``, the page cache dropped for one-shot readers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.storage import Store
from ckptfmt.storage.local import merge_adjacent


def test_reading_a_field_asks_the_store_once_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {f"t{i}": np.full((16,), i, np.float32) for i in range(50)}
    with ckptfmt.open_writer(tmp_path, profile="weights") as w:
        w.write_tensors("weights", tensors)
    calls: list[tuple[str, int]] = []
    ckpt = ckptfmt.open(tmp_path)
    ckpt.read_tensor("weights", "t0")  # the file's header is checked once, on its first read
    original = type(ckpt.store).read_ranges

    def counting(self: Store, path: str, requests: Any, **kw: Any) -> None:
        calls.append((path, len(requests)))
        original(self, path, requests, **kw)

    monkeypatch.setattr(type(ckpt.store), "read_ranges", counting)
    out = ckpt.read_tensors("weights", workers=1)
    assert all(np.array_equal(out[n], t) for n, t in tensors.items())
    assert calls == [("weights/r00000-00000.safetensors", 50)]  # 50 tensors, one call, each straight into its array
    assert ckpt.bytes_read == 51 * 64


def test_the_store_merges_back_to_back_ranges_into_one_vectored_read() -> None:
    views = [memoryview(bytearray(n)) for n in (8, 16, 4, 4)]
    runs = merge_adjacent([(24, views[1]), (0, views[0]), (48, views[2]), (52, views[3]), (40, memoryview(b""))])
    assert [(b, [len(v) for v in vs]) for b, vs in runs] == [(0, [8]), (24, [16]), (48, [4, 4])]


def test_preadv_fills_every_view_of_a_run(tmp_path: Path) -> None:
    data = os.urandom(1 << 16)
    (tmp_path / "f").write_bytes(data)
    store = ckptfmt.open_store(tmp_path)
    views = [memoryview(bytearray(n)) for n in (100, 30000, 3, 35433)]
    at = 0
    requests = []
    for v in views:
        requests.append((at, v))
        at += len(v)
    store.read_ranges("f", requests, keep_cached=False)
    assert b"".join(bytes(v) for v in views) == data[:at]
