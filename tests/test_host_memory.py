"""Read targets in mappings of their own, populated ahead of the readers (ckptfmt/host_memory.py)."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt import host_memory

needs_populate = pytest.mark.skipif(not host_memory.POPULATE, reason="MADV_POPULATE_WRITE: Linux 5.14 and later")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@needs_populate
def test_large_arrays_get_a_mapping_and_small_ones_do_not() -> None:
    big, mapping = host_memory.empty((512, 1024), np.dtype(np.float32))
    assert mapping is not None and len(mapping) == big.nbytes
    assert big.flags.writeable and big.flags.c_contiguous and big.shape == (512, 1024)
    small, none = host_memory.empty((3, 5), np.dtype(np.float64))
    assert none is None and small.shape == (3, 5)
    empty, none = host_memory.empty((0, 7), np.dtype(np.int8))
    assert none is None and empty.shape == (0, 7)


@needs_populate
def test_populating_maps_every_page() -> None:
    _, mapping = host_memory.empty((64 << 20,), np.dtype(np.uint8))
    assert mapping is not None
    before = _resident_bytes()
    with host_memory.Populator([mapping]) as populator:
        assert populator._thread is not None
        populator._thread.join()
    assert _resident_bytes() - before >= (64 << 20) * 0.95


@needs_populate
def test_populating_beside_a_writer_never_changes_a_byte() -> None:
    """The readers fill pages while the populator maps the ones after: what they wrote stays."""
    array, mapping = host_memory.empty((96 << 20,), np.dtype(np.uint8))
    assert mapping is not None
    pattern = np.arange(1 << 20, dtype=np.uint8) ^ 0x5A
    written = threading.Event()

    def fill() -> None:
        for at in range(0, array.size, 1 << 20):
            array[at : at + (1 << 20)] = pattern
        written.set()

    writer = threading.Thread(target=fill)
    with host_memory.Populator([mapping]):
        writer.start()
        writer.join()
    assert written.is_set()
    assert all(np.array_equal(array[at : at + (1 << 20)], pattern) for at in range(0, array.size, 1 << 20))


def test_without_populate_reads_land_in_plain_arrays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without MADV_POPULATE_WRITE: plain arrays, nothing populated, the same bytes."""
    values = np.random.default_rng(3).standard_normal((700, 1000)).astype(np.float32)  # 2.8 MB: above MIN_MAPPED
    with ckptfmt.open_writer(tmp_path / "c", profile="weights") as w:
        w.write_tensor("weights", "w", values)
    for populate in (True, False):
        monkeypatch.setattr(host_memory, "POPULATE", populate)
        with ckptfmt.open(tmp_path / "c") as ckpt:
            got = ckpt.read_tensor("weights", "w")
        assert got.tobytes() == values.tobytes()
        assert isinstance(got.base, np.ndarray) == (populate and host_memory.MADV_POPULATE_WRITE is not None)


@needs_populate
def test_mappings_alive_at_once_are_bounded_and_freed_ones_are_counted_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of very many large tensors must not use up the process's mappings (vm.max_map_count): past the
    bound, arrays come from the allocator; a freed array's mapping counts no more."""
    monkeypatch.setattr(host_memory, "MAX_MAPPINGS", host_memory._live + 2)
    arrays = [host_memory.empty((1 << 20,), np.dtype(np.uint8)) for _ in range(3)]
    assert [m is not None for _, m in arrays] == [True, True, False]
    del arrays[0]
    _array, mapping = host_memory.empty((1 << 20,), np.dtype(np.uint8))
    assert mapping is not None
