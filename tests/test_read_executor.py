"""The read executor: one ``read_ranges`` call per file and task, the page cache dropped for one-shot readers
(how a store merges the ranges of one call is the store's: tests/test_storage.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.storage import Store


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
