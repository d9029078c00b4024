"""The read executor: one ``read_ranges`` call per file and task, the page cache dropped for one-shot readers
(how a store merges the ranges of one call is the store's: tests/test_storage.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.blocks import BlockHasher
from ckptfmt.digest_checks import Span, SpanHasher
from ckptfmt.digests import digest_of
from ckptfmt.errors import DigestMismatchError, UsageError
from ckptfmt.manifest import ChunkRecord
from ckptfmt.storage import Store


def count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths a LocalStore opens for reading from now on, in order."""
    from ckptfmt.storage import LocalStore

    opened: list[str] = []
    original = LocalStore._open_read

    def counting(self: LocalStore, path: str) -> int:
        opened.append(path)
        return original(self, path)

    monkeypatch.setattr(LocalStore, "_open_read", counting)
    return opened


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


@pytest.mark.parametrize(
    ("cores", "local_world", "expected"),
    [(2, None, 2), (16, None, 4), (2, "4", 1), (16, "4", 4), (16, "8", 2), (8, "not a number", 4), (2, "0", 2)],
)
def test_local_readers_share_the_cores_with_the_other_ranks_of_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, local_world: str | None, expected: int
) -> None:
    """torchrun's LOCAL_WORLD_SIZE ranks on one node split its cores: 4 ranks on 2 cores read with one thread each,
    not two (8 readers and their copies fighting over 2 cores)."""
    from ckptfmt import read_executor
    from ckptfmt.storage import LocalStore, open_store

    monkeypatch.setattr(read_executor, "usable_cores", lambda: cores)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    assert read_executor.default_workers(LocalStore(tmp_path)) == expected
    assert read_executor.default_workers(open_store("memory://workers")) == 8  # requests wait on the network


def test_scans_reuse_their_buffers_and_read_ahead_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify of many large files streams each through the same two buffers and thread (no fresh 16 MiB and no
    new thread per file); a consumer that fails mid-file gives them back only once no read is in flight; a file
    smaller than a buffer gets buffers of its own size, not kept."""
    import threading

    from ckptfmt import read_executor
    from ckptfmt.file_checks import FileChecks
    from ckptfmt.read_executor import ReadExecutor
    from ckptfmt.storage import LocalStore

    monkeypatch.setattr(read_executor, "SCAN_BYTES", 1 << 18)  # each 1.2 MB file is read in five pieces

    rng = np.random.default_rng(5)
    with ckptfmt.open_writer(tmp_path / "c", profile="weights", target_file_size=1 << 20) as w:
        for i in range(6):
            w.write_tensor("weights", f"t{i}", rng.standard_normal(300_000).astype(np.float32))  # 1.2 MB: a file each
    store = LocalStore(tmp_path / "c")
    ckpt = ckptfmt.open(tmp_path / "c")
    files = [f for f in ckpt.manifest.files if f.path.endswith(".safetensors")]
    assert len(files) == 6
    executor = ReadExecutor(store, FileChecks(store, ckpt.manifest))

    def scanned(path: str, size: int) -> bytes:
        parts: list[bytes] = []
        executor.scan(path, size, lambda pos, view: parts.append(bytes(view)))
        return b"".join(parts)

    for file in files:
        assert scanned(file.path, file.size) == (tmp_path / "c" / file.path).read_bytes()
    assert len(executor._scan_buffers) == 1  # one set, reused by every file

    def failing(pos: int, view: memoryview) -> None:
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        executor.scan(files[0].path, files[0].size, failing)
    assert len(executor._scan_buffers) == 1
    assert scanned(files[1].path, files[1].size) == (tmp_path / "c" / files[1].path).read_bytes()
    small = next(f for f in ckpt.manifest.files if f.size < (1 << 18))  # a context blob
    assert scanned(small.path, small.size) == (tmp_path / "c" / small.path).read_bytes()
    assert len(executor._scan_buffers) == 1 and len(executor._scan_buffers[0][0]) == 1 << 18
    executor.close()
    ckpt.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptfmt-scan")]


def test_a_scan_reads_its_file_through_one_open_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream keeps one descriptor for all its reads (the kernel's readahead lives in it), into page-aligned
    buffers, and closes it at its end, also when its consumer fails."""
    import mmap
    import os

    from ckptfmt import read_executor
    from ckptfmt.file_checks import FileChecks
    from ckptfmt.read_executor import ReadExecutor
    from ckptfmt.storage import LocalStore

    monkeypatch.setattr(read_executor, "SCAN_BYTES", 1 << 18)
    data = np.random.default_rng(6).standard_normal(300_000).astype(np.float32)
    with ckptfmt.open_writer(tmp_path / "c", profile="weights") as w:
        w.write_tensor("weights", "t", data)
    store = LocalStore(tmp_path / "c")
    ckpt = ckptfmt.open(tmp_path / "c")
    file = next(f for f in ckpt.manifest.files if f.path.endswith(".safetensors"))
    opened = count_opens(monkeypatch)
    executor = ReadExecutor(store, FileChecks(store, ckpt.manifest))
    fds = len(os.listdir("/proc/self/fd"))
    parts: list[tuple[int, bytes]] = []
    addresses: set[int] = set()

    def consume(pos: int, view: memoryview) -> None:
        parts.append((pos, bytes(view)))
        addresses.add(np.frombuffer(view, np.uint8).ctypes.data % mmap.PAGESIZE)

    executor.scan(file.path, file.size, consume)
    assert b"".join(p for _, p in parts) == (tmp_path / "c" / file.path).read_bytes()
    assert len(parts) == 5 and opened == [file.path]  # five reads, one open
    assert addresses == {0}
    assert len(os.listdir("/proc/self/fd")) == fds  # closed at the end

    def failing(pos: int, view: memoryview) -> None:
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        executor.scan(file.path, file.size, failing)
    assert len(os.listdir("/proc/self/fd")) == fds
    executor.close()
    ckpt.close()


def test_a_local_reader_reads_ranges_and_names_its_file_when_it_ends_early(tmp_path: Path) -> None:
    from ckptfmt.errors import SizeMismatchError
    from ckptfmt.storage import LocalStore

    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 4)
    store = LocalStore(tmp_path)
    with store.reader("f.bin") as reader:
        a, b = memoryview(bytearray(3)), memoryview(bytearray(2))
        reader.read_ranges([(10, a), (13, b)])
        assert bytes(a) + bytes(b) == bytes(range(10, 15))
        reader.read_ranges([(1020, memoryview(bytearray(4)))], keep_cached=False)
        with pytest.raises(SizeMismatchError, match="file ends before byte 1034") as caught:
            reader.read_ranges([(1020, memoryview(bytearray(14)))])
        assert caught.value.path == "f.bin"
    reader.close()  # idempotent
    with pytest.raises(UsageError, match=r"f\.bin: read through a closed reader"):
        reader.read_ranges([(0, memoryview(bytearray(1)))])


def test_a_local_reader_streams_dropping_reads_on_its_descriptor_and_opens_one_per_keeping_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # measured (storage/local.py): readahead on one descriptor wins when the pages are dropped, loses when kept
    from ckptfmt.storage import LocalStore

    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 64)
    store = LocalStore(tmp_path)
    opened = count_opens(monkeypatch)
    with store.reader("f.bin") as reader:
        for pos in range(0, 16384, 4096):
            view = memoryview(bytearray(4096))
            reader.read_ranges([(pos, view)], keep_cached=False)
            assert bytes(view) == bytes(range(256)) * 16
        assert opened == ["f.bin"]
        kept = memoryview(bytearray(8))
        reader.read_ranges([(256, kept)])
        reader.read_ranges([(512, memoryview(bytearray(8)))])
        assert bytes(kept) == bytes(range(8)) and opened == ["f.bin"] * 3


def _chunk(data: bytes, key: str, begin: int, end: int, *, block: int | None = None) -> ChunkRecord:
    """A chunk record of ``data[begin:end]`` whose digests are right (block digests of ``block`` bytes if given)."""
    blocks = None
    if block is not None:
        hasher = BlockHasher("xxh3-128", block)
        hasher.update(memoryview(data)[begin:end])
        blocks = hasher.finish()
    digest = digest_of("xxh3-128", data[begin:end])
    return ChunkRecord(
        path="f", key=key, offsets=(0,), shape=(end - begin,), begin=begin, end=end, digest=digest, blocks=blocks
    )


def test_the_span_hasher_hands_on_each_span_as_its_last_byte_passes_across_gaps_and_views() -> None:
    data = bytes(range(256)) * 64  # 16 KiB
    a, b = _chunk(data, "a", 0, 5000), _chunk(data, "b", 5000, 13192, block=4096)
    empty = _chunk(data, "e", len(data), len(data))
    spans = [Span(b, 5000 + 4096, 13192, first_block=1), Span(a), Span(empty)]  # not in file order
    done: list[tuple[str, int, DigestMismatchError | None]] = []
    hasher = SpanHasher(spans, lambda s: done.append((s.chunk.key, s.end, s.mismatch())))
    view = memoryview(data)
    for at, end in [(0, 3000), (3000, 5000), (9096, 10000), (10000, 13192)]:  # [5000, 9096) is never read
        hasher.update(at, view[at:end])
        if end == 5000:
            assert [key for key, _, _ in done] == ["a"]  # compared as its last byte passed, before b began
    assert [key for key, _, _ in done] == ["a", "b"]
    hasher.close()  # the empty chunk at the end of the file, which no view reached
    assert done == [("a", 5000, None), ("b", 13192, None), ("e", len(data), None)]


def test_a_span_names_the_first_block_or_the_chunk_its_bytes_do_not_hash_to() -> None:
    data = bytearray(bytes(range(256)) * 64)
    chunk = _chunk(bytes(data), "w", 0, len(data), block=4096)
    data[2 * 4096 + 7] ^= 1
    whole, blocks = Span(chunk, field="weights", tensor="w"), Span(chunk, first_block=0, rule="BLK-6")
    for span in (whole, blocks):
        span.hasher.update(memoryview(bytes(data)))
    chunk_error, block_error = whole.mismatch(), blocks.mismatch()
    assert chunk_error is not None and block_error is not None
    assert (chunk_error.requirement, chunk_error.field, chunk_error.tensor) == ("DIG-4", "weights", "w")
    assert block_error.requirement == "BLK-6" and "chunk 'w' block 2 (bytes [8192, 12288))" in block_error.message
    tail = Span(chunk, 8192, len(data), first_block=2)  # the blocks from block 2 on, as a partial read checks them
    with pytest.raises(DigestMismatchError, match="block 2 ") as info:
        tail.check(memoryview(bytes(data))[8192:])
    assert info.value.requirement == "BLK-5"


def _one_file(tmp_path: Path, nbytes: int) -> tuple[Any, Any, Any]:
    from ckptfmt.file_checks import FileChecks
    from ckptfmt.read_executor import ReadExecutor
    from ckptfmt.storage import LocalStore

    data = np.random.default_rng(7).integers(0, 255, nbytes, dtype=np.uint8)
    with ckptfmt.open_writer(tmp_path / "c", profile="weights") as w:
        w.write_tensor("weights", "t", data)
    store = LocalStore(tmp_path / "c")
    ckpt = ckptfmt.open(tmp_path / "c")
    file = next(f for f in ckpt.manifest.files if f.path.endswith(".safetensors"))
    ckpt.close()
    return ReadExecutor(store, FileChecks(store, ckpt.manifest)), file, (tmp_path / "c" / file.path).read_bytes()


def test_a_scan_reads_ahead_of_a_slow_consumer_by_its_buffers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader runs ahead of the consumer, in order, and never by more than SCAN_BUFFERS buffers (the memory
    bound); the consumer gets every byte in order."""
    import time

    from ckptfmt import read_executor
    from ckptfmt.storage.local import LocalStore

    monkeypatch.setattr(read_executor, "SCAN_BYTES", 1 << 16)
    executor, file, expected = _one_file(tmp_path, 40 << 16)
    reads: list[int] = []
    original = LocalStore.reader

    def counting_reader(self: LocalStore, path: str) -> Any:
        reader = original(self, path)
        inner = reader.read_ranges

        def read_ranges(ranges: Any, **kw: Any) -> Any:
            reads.append(ranges[0][0])
            return inner(ranges, **kw)

        reader.read_ranges = read_ranges
        return reader

    monkeypatch.setattr(LocalStore, "reader", counting_reader)
    parts: list[tuple[int, bytes]] = []
    ahead: list[int] = []

    def consume(pos: int, view: memoryview) -> None:
        if not parts:  # hold the first buffer: the reader fills every other one, then must wait for it
            deadline = time.monotonic() + 30
            while len(reads) < read_executor.SCAN_BUFFERS and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.05)  # room for a read it must not make (not needed for the test to pass)
            ahead.append(len(reads))
        parts.append((pos, bytes(view)))

    executor.scan(file.path, file.size, consume)
    executor.close()
    assert b"".join(p for _, p in parts) == expected
    assert [p for p, _ in parts] == sorted(p for p, _ in parts)
    assert ahead == [read_executor.SCAN_BUFFERS]  # all buffers filled, none overwritten before it was consumed
    assert reads == sorted(reads)


def test_a_failed_read_in_a_scan_is_raised_to_its_consumer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfmt import read_executor
    from ckptfmt.errors import StorageError
    from ckptfmt.storage.local import LocalStore

    monkeypatch.setattr(read_executor, "SCAN_BYTES", 1 << 16)
    executor, file, _ = _one_file(tmp_path, 20 << 16)
    original = LocalStore.reader

    def failing_reader(self: LocalStore, path: str) -> Any:
        reader = original(self, path)
        inner = reader.read_ranges

        def read_ranges(ranges: Any, **kw: Any) -> Any:
            if ranges[0][0] >= 5 << 16:
                raise StorageError("the disk went away", path=path)
            return inner(ranges, **kw)

        reader.read_ranges = read_ranges
        return reader

    monkeypatch.setattr(LocalStore, "reader", failing_reader)
    seen: list[int] = []
    with pytest.raises(StorageError, match="the disk went away"):
        executor.scan(file.path, file.size, lambda pos, view: seen.append(pos))
    assert seen == sorted(seen) and all(pos < 5 << 16 for pos in seen)
    executor.close()


def test_a_scan_at_interpreter_exit_reads_on_its_own_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ckptfmt import read_executor

    class Exiting(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(read_executor, "SCAN_BYTES", 1 << 16)
    executor, file, expected = _one_file(tmp_path, 9 << 16)
    monkeypatch.setattr(executor, "_read_ahead", lambda: Exiting(max_workers=1))
    parts: list[bytes] = []
    executor.scan(file.path, file.size, lambda pos, view: parts.append(bytes(view)))
    assert b"".join(parts) == expected
    executor.close()
