"""Running read plans against a Store: the only layer of the read side that moves tensor bytes.

The executor owns the pool, the file checks (once per file, before its bytes are used), the checks of every
piece (chunk digest, block digests or the codec's frames), decoding and the strided copies. It calls the
store and is never called back from it; ranges are merged by the store's ``read_ranges``, which knows what a
request costs (one ``preadv`` per run of adjacent ranges locally, one GET per run on object stores).

Work is cut into tasks of about ``part`` bytes: many small pieces of a file share one task (one
``read_ranges`` call), a large piece is split over several (read in parallel, then checked in order by the
task that completes it, while its bytes are still warm). Bytes land directly in the target arrays where the
plan says so; only block edges, strided regions and encoded frames are staged. Memory beyond the targets: the
staging of the pieces in flight.

Page cache: ``keep_cached=False`` asks the store to drop the pages a read brought in once the bytes are in
the target (local disks: ``POSIX_FADV_DONTNEED``), so a checkpoint read once does not evict what the training
job keeps cached (its dataset); checkpoints read that way by default (``Checkpoint.keep_cached``).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

from . import dtypes, host_memory
from .arrays import byte_view
from .codecs import get_codec
from .codecs.xor_zstd import XorConfiguration
from .delta import xor_base
from .digest_checks import Span, SpanHasher
from .errors import CheckpointError, UsageError
from .file_checks import FileChecks
from .manifest import ChunkRecord
from .read_plan import Piece, ReadPlan, Target
from .storage import RangeReader, Store
from .thread_pools import submit_or_run, try_submit

MIN_PART = 1 << 20
MAX_PART = 64 << 20
SCAN_BYTES = 4 << 20  # the unit of a streaming scan (verification, a load's check)
SCAN_BUFFERS = 4  # a scan's buffers: its reader runs up to this many ahead of the consumer
# A check streams across gaps up to this between the ranges it needs (the small tensors between the large ones: an
# optimizer's step counts between its moments) instead of starting a new stream: the disk's readahead is there.
CHECK_GAP = 1 << 20
SCANS_AHEAD = 8  # read-ahead threads: one per scan running at once (verify streams 4 files at a time)
_BITS: dict[int, str] = {n: f"u{n}" for n in (1, 2, 4, 8)}


@dataclass(slots=True)
class _Live:
    """A piece being read: where its bytes go, and how many of its parts are still to come."""

    piece: Piece
    array: np.ndarray[Any, Any]
    parts_left: int
    field_name: str
    tensor_name: str
    segments: list[tuple[int, memoryview]] = field(default_factory=list)  # (file begin, view), tiling the read

    def allocate(self) -> None:
        p = self.piece
        if p.direct is None:
            self.segments = [(p.begin, memoryview(bytearray(p.nbytes)))]
            return
        lo, hi, at = p.direct
        self.segments = []
        if lo > p.begin:
            self.segments.append((p.begin, memoryview(bytearray(lo - p.begin))))
        if hi > lo:
            self.segments.append((lo, byte_view(self.array)[at : at + hi - lo]))
        if p.end > hi:
            self.segments.append((hi, memoryview(bytearray(p.end - hi))))

    def requests(self, begin: int, end: int) -> list[tuple[int, memoryview]]:
        """The (file offset, view) requests that read ``[begin, end)`` of this piece."""
        out = []
        for start, view in self.segments:
            lo, hi = max(begin, start), min(end, start + len(view))
            if hi > lo:
                out.append((lo, view[lo - start : hi - start]))
        return out


def default_workers(store: Store) -> int:
    """Reads in flight: on a local disk one per core this process has, shared with the other processes of the job
    on this node (torchrun's ``LOCAL_WORLD_SIZE``), from 1 to 4 (the copy out of the page cache and the hashing
    are CPU work, so more readers than cores only compete: docs/benchmarks.md); on object stores 8,
    since each request mostly waits on the network."""
    if store.capabilities.local:
        return max(1, min(4, usable_cores() // local_processes()))
    return 8


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def local_processes() -> int:
    """How many processes of this job share the node (``LOCAL_WORLD_SIZE``, set by torchrun); 1 if unknown."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class ReadExecutor:
    def __init__(
        self, store: Store, checks: FileChecks, *, workers: int | None = None, keep_cached: bool = False
    ) -> None:
        self.store = store
        self.checks = checks
        self.workers = default_workers(store) if workers is None else max(1, workers)
        self.keep_cached = keep_cached
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started on first use, kept until close()
        self._pool_size = 0
        self._ahead: ThreadPoolExecutor | None = None  # the scans' read-ahead, started on first use
        self._scan_buffers: list[tuple[memoryview, ...]] = []  # idle sets, one per concurrent scan

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._ahead is not None:
            self._ahead.shutdown()
            self._ahead = None
        self._scan_buffers.clear()

    # ------------------------------------------------------------------ filling targets

    def fill(
        self, plan: ReadPlan, *, verify: bool = True, into: Sequence[np.ndarray[Any, Any]] | None = None
    ) -> list[np.ndarray[Any, Any]]:
        """The plan's targets, every piece read and checked; nothing is returned if any check fails.

        ``into``: the caller's arrays, one per target (C-contiguous, writable, the target's shape and dtype), filled
        in place and returned; if a check fails they hold part of what was read."""
        if into is None:
            allocated = [host_memory.empty(t.shape, dtypes.to_numpy(t.dtype)) for t in plan.targets]
        else:
            allocated = [(_destination(t, array), None) for t, array in zip(plan.targets, into, strict=True)]
        arrays = [array for array, _ in allocated]
        if not plan.pieces:
            return arrays
        by_file = plan.by_file()
        first = {path: plan.targets[pieces[0].target] for path, pieces in by_file.items()}
        self._check_files({path: (t.field, t.tensor) for path, t in sorted(first.items())})
        part = min(MAX_PART, max(MIN_PART, plan.nbytes // (self.workers * 2) + 1))
        tasks: list[tuple[str, list[tuple[_Live, int, int]]]] = []
        for path, pieces in by_file.items():
            task: list[tuple[_Live, int, int]] = []
            filled = 0
            for piece in pieces:
                cuts = list(range(piece.begin, piece.end, part)) or [piece.begin]
                target = plan.targets[piece.target]
                live = _Live(piece, arrays[piece.target], len(cuts), target.field, target.tensor)
                for lo in cuts:
                    hi = min(piece.end, lo + part)
                    if task and filled + (hi - lo) > part:
                        tasks.append((path, task))
                        task, filled = [], 0
                    task.append((live, lo, hi))
                    filled += hi - lo
            if task:
                tasks.append((path, task))
        # The targets' pages are mapped on a thread of their own, in the order the tasks fill them (host_memory.py).
        order = dict.fromkeys(live.piece.target for _, parts in tasks for live, _, _ in parts)
        mappings = [m for m in (allocated[i][1] for i in order) if m is not None]
        with host_memory.Populator(mappings):
            self._run([functools.partial(self._task, path, parts, verify) for path, parts in tasks])
        return arrays

    def check(self, plan: ReadPlan) -> None:
        """Every byte a :meth:`fill` of ``plan`` would read, read and checked the same way, and nothing kept: the
        first half of a load into memory that must not change unless all of it is good. Bytes stream through the
        executor's scan buffers, so memory stays bounded, and stay in the page cache for the fill that follows."""
        if any(piece.check == "frames" for piece in plan.pieces):
            raise UsageError("a check without a fill reads raw chunks only (an encoded chunk is checked as decoded)")
        if not plan.pieces:
            return
        by_file = plan.by_file()
        first = {path: plan.targets[pieces[0].target] for path, pieces in by_file.items()}
        self._check_files({path: (t.field, t.tensor) for path, t in sorted(first.items())})
        # One stream per file (splitting the largest file in two to keep both readers busy measured slower: the
        # kernel's readahead restarts with each stream; docs/benchmarks.md).
        self._run([functools.partial(self._check_file, path, pieces, plan) for path, pieces in by_file.items()])

    def _check_file(self, path: str, pieces: Sequence[Piece], plan: ReadPlan) -> None:
        """The file's pieces as few streams as their ranges allow (runs of ranges at most ``CHECK_GAP`` apart, read
        ahead), each byte handed to the hasher of every piece that holds it; a piece is compared as it ends."""
        todo = sorted((p for p in pieces if p.check != "none"), key=lambda p: (p.begin, p.end))
        spans = SpanHasher((_piece_span(p, plan.targets[p.target]) for p in todo), _raise_mismatch)
        for begin, end in _check_runs(todo):
            self._stream(path, begin, end, spans.update, keep_cached=True)
        spans.close()

    def forget(self, plan: ReadPlan) -> None:
        """Drop from the page cache what :meth:`check` of ``plan`` read and kept there for a fill that will not come
        (the load was refused or not applied); nothing where the store keeps no cache."""
        for path, pieces in plan.by_file().items():
            for begin, end in _check_runs([p for p in pieces if p.check != "none"]):
                self.store.drop_cached(path, begin, end)

    def _check_files(self, readers: Mapping[str, tuple[str, str]]) -> None:
        """Size and header of every file not checked yet, concurrently; the first error in path order, located
        at the (field, tensor) ``readers`` names for its file."""
        todo = [p for p in readers if not self.checks.checked(p)]
        errors: list[CheckpointError | None] = [None] * len(todo)

        def check(i: int) -> None:
            try:
                self.checks.check(todo[i])
            except CheckpointError as exc:
                field_name, tensor_name = readers[todo[i]]
                errors[i] = exc.locate(field=field_name, tensor=tensor_name)

        self._run([functools.partial(check, i) for i in range(len(todo))])
        for error in errors:
            if error is not None:
                raise error

    def _task(self, path: str, parts: Sequence[tuple[_Live, int, int]], verify: bool) -> None:
        requests: list[tuple[int, memoryview]] = []
        for live, lo, hi in parts:
            with self._lock:
                if not live.segments:
                    live.allocate()
            requests.extend(live.requests(lo, hi))
        first = parts[0][0]
        try:
            self.store.read_ranges(path, requests, keep_cached=self.keep_cached)
        except CheckpointError as exc:
            exc.locate(path=path, field=first.field_name, tensor=first.tensor_name)
            raise
        done = []
        with self._lock:
            self.bytes_read += sum(hi - lo for _, lo, hi in parts)
            for live, _, _ in parts:
                live.parts_left -= 1
                if live.parts_left == 0:
                    done.append(live)
        for live in done:
            try:
                self._finish(live, verify)
            except CheckpointError as exc:
                exc.locate(path=path, field=live.field_name, tensor=live.tensor_name)
                raise
            finally:
                live.segments = []  # staging is freed as soon as its piece is done

    def _run(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Run ``jobs`` on the pool; every job finishes, then the first failure (in job order) is raised."""
        if len(jobs) <= 1 or self.workers == 1:
            for job in jobs:
                job()
            return
        if self._pool is None or self._pool_size != self.workers:
            self.close()
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="ckptfmt-read")
            self._pool_size = self.workers
        futures: list[Future[None]] = [submit_or_run(self._pool, job) for job in jobs]
        wait(futures)
        for future in futures:
            future.result()

    # ------------------------------------------------------------------ streaming scans

    def scan(self, path: str, size: int, consume: Callable[[int, memoryview], None]) -> None:
        """Every byte of a file, in order, ``SCAN_BYTES`` at a time, handed to ``consume(offset, view)``; the
        reads run ahead of ``consume`` by up to ``SCAN_BUFFERS`` buffers.

        The read-ahead thread, and for files of ``SCAN_BYTES`` or more the buffers, are the executor's,
        reused file after file: a verify of many files allocated and zeroed 16 MiB and started a thread per file."""
        self._stream(path, 0, size, consume, keep_cached=self.keep_cached)

    def _stream(
        self, path: str, begin: int, end: int, consume: Callable[[int, memoryview], None], *, keep_cached: bool
    ) -> None:
        """The bytes ``[begin, end)`` of a file, in order, as :meth:`scan` hands them out, through one reader of the
        file (which keeps what its backend learns from the stream: :class:`RangeReader`)."""
        size = end - begin
        if size <= 0:
            return
        with self.store.reader(path) as reader:
            self._stream_from(reader, begin, end, consume, keep_cached=keep_cached)

    def _stream_from(
        self,
        reader: RangeReader,
        begin: int,
        end: int,
        consume: Callable[[int, memoryview], None],
        *,
        keep_cached: bool,
    ) -> None:
        """One thread reads the range in order into the scan's free buffers, ``consume`` takes them in order
        behind it: the disk sees one sequential stream (its readahead at work; reads of one file in parallel
        were slower here) and a slow consume (hashing) delays the reads only once every buffer is full."""
        buffers = self._take_scan_buffers(end - begin)
        free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        filled: queue.SimpleQueue[tuple[int, memoryview, int] | BaseException] = queue.SimpleQueue()
        for buffer in buffers:
            free.put(buffer)
        stop = threading.Event()

        def read_in_order() -> None:
            pos = begin
            try:
                while pos < end and not stop.is_set():
                    buffer = free.get()
                    if buffer is None:  # the consumer stopped
                        return
                    count = min(len(buffer), end - pos)
                    reader.read_ranges([(pos, buffer[:count])], keep_cached=keep_cached)
                    filled.put((pos, buffer, count))
                    pos += count
            except BaseException as exc:  # handed to the consumer, which raises it
                filled.put(exc)

        task = try_submit(self._read_ahead(), read_in_order)
        try:
            pos = begin
            while pos < end:
                if task is None:  # the interpreter is exiting (thread_pools.py): one read at a time, on this thread
                    count = min(len(buffers[0]), end - pos)
                    reader.read_ranges([(pos, buffers[0][:count])], keep_cached=keep_cached)
                    item: tuple[int, memoryview, int] | BaseException = (pos, buffers[0], count)
                else:
                    item = filled.get()
                if isinstance(item, BaseException):
                    raise item
                at, buffer, count = item
                consume(at, buffer[:count])
                with self._lock:
                    self.bytes_read += count
                pos = at + count
                if task is not None:
                    free.put(buffer)
        finally:
            stop.set()
            free.put(None)  # wakes a reader waiting for a buffer
            if task is not None:
                wait([task])  # a read still in flight (consume raised) must not land in a reused buffer
            if len(buffers[0]) == SCAN_BYTES and len(buffers) == SCAN_BUFFERS:
                with self._lock:
                    self._scan_buffers.append(buffers)

    def _take_scan_buffers(self, size: int) -> tuple[memoryview, ...]:
        """The executor's ``SCAN_BUFFERS`` full-size buffers (reused: fresh pages cost here what reading does) for a
        file of ``SCAN_BYTES`` or more; one of its own size (not kept) for a smaller one, so that memory follows the
        files being scanned."""
        if size >= SCAN_BYTES:
            with self._lock:
                if self._scan_buffers:
                    return self._scan_buffers.pop()
            return tuple(host_memory.aligned(SCAN_BYTES) for _ in range(SCAN_BUFFERS))  # a full set: kept afterwards
        return (host_memory.aligned(size),)  # the whole file in one read

    def _read_ahead(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._ahead is None:
                self._ahead = ThreadPoolExecutor(max_workers=SCANS_AHEAD, thread_name_prefix="ckptfmt-scan")
            return self._ahead

    def _finish(self, live: _Live, verify: bool) -> None:
        """A piece whose bytes have all arrived: check them, then decode or copy them into the target."""
        piece, chunk = live.piece, live.piece.chunk
        views = [view for _, view in live.segments]
        if verify and piece.check in ("chunk", "blocks"):
            _piece_span(piece).check(*views)
        if piece.span is not None:
            itemsize = live.array.dtype.itemsize
            span = piece.span
            raw = memoryview(bytearray(span.raw_end - span.raw_begin))
            get_codec(chunk.codec.name).decode_into(chunk.codec, views[0], span, raw, itemsize=itemsize)
            if isinstance(span.configuration, XorConfiguration):  # a delta: XOR the base's bytes back in
                read = xor_base(
                    self.store,
                    self.checks,
                    span.configuration,
                    span.raw_begin,
                    span.raw_end,
                    raw,
                    raw_size=chunk_raw_size(chunk, itemsize),
                    itemsize=itemsize,
                    verify=verify,
                )
                with self._lock:
                    self.bytes_read += read
            _copy(piece, raw, live.array)
        elif piece.direct is None:
            _copy(piece, views[0], live.array)


def chunk_raw_size(chunk: ChunkRecord, itemsize: int) -> int:
    count = itemsize
    for d in chunk.shape:
        count *= d
    return count


def _check_runs(pieces: Sequence[Piece]) -> list[tuple[int, int]]:
    """The byte ranges a check streams: the pieces' ranges in file order, joined across gaps up to ``CHECK_GAP``."""
    runs: list[list[int]] = []
    for piece in sorted(pieces, key=lambda p: (p.begin, p.end)):
        if runs and piece.begin <= runs[-1][1] + CHECK_GAP:
            runs[-1][1] = max(runs[-1][1], piece.end)
        else:
            runs.append([piece.begin, piece.end])
    return [(begin, end) for begin, end in runs]


def _piece_span(piece: Piece, target: Target | None = None) -> Span:
    """The check of a piece: its chunk digest, or the block digests of the blocks it reads (BLK-5)."""
    return Span(
        piece.chunk,
        piece.begin,
        piece.end,
        first_block=piece.first_block if piece.check == "blocks" else None,
        field=None if target is None else target.field,
        tensor=None if target is None else target.tensor,
    )


def _raise_mismatch(span: Span) -> None:
    error = span.mismatch()
    if error is not None:
        raise error


def _destination(target: Target, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` if a fill can write ``target`` into it in place, else a UsageError naming the tensor."""
    dtype = dtypes.to_numpy(target.dtype)
    # the target's dtype, or unsigned integers of its width: its bit patterns, for dtypes numpy lacks (bfloat16...)
    bits = array.dtype.kind == "u" and array.dtype.itemsize == dtype.itemsize
    if array.shape != target.shape or not (array.dtype == dtype or bits):
        raise UsageError(
            f"cannot read a {target.dtype} region of shape {target.shape} into an array of {array.dtype} {array.shape}",
            field=target.field,
            tensor=target.tensor,
        )
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise UsageError("a destination must be C-contiguous and writable", field=target.field, tensor=target.tensor)
    return array


def _copy(piece: Piece, raw: memoryview, array: np.ndarray[Any, Any]) -> None:
    """Copy the piece's box out of raw chunk bytes that start at the chunk's raw byte ``piece.raw_at``."""
    itemsize = array.dtype.itemsize
    shape = piece.chunk.shape
    strides = [itemsize] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    start = sum(s.start * st for s, st in zip(piece.source, strides, strict=True)) - piece.raw_at
    size = tuple(s.stop - s.start for s in piece.source)
    if 0 in size:
        return
    # By bit pattern: as_strided does not take every dtype (ml_dtypes' floats among them), and a copy is a copy.
    bits = np.dtype(_BITS.get(itemsize) or f"V{itemsize}")
    flat = np.frombuffer(raw, dtype=bits, offset=start, count=(len(raw) - start) // itemsize)
    box = np.lib.stride_tricks.as_strided(flat, shape=size, strides=strides, writeable=False)
    array.view(bits)[piece.dest] = box
