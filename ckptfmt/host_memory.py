"""Host memory for what a read returns: large arrays in mappings of their own, populated ahead of the readers.

Reading into freshly allocated memory pays a page fault on the first touch of every page: the kernel zeroes it,
and on a virtual machine whose host takes back the memory a guest freed (free page reporting: Firecracker, most
clouds' balloon drivers) the host faults too, which can cost more than the disk read that fills the pages
(docs/benchmarks.md has the figures). Large arrays therefore get anonymous mappings of their own (page-aligned,
and unmapped when freed instead of left in the allocator's heap), and :class:`Populator` maps their pages
(``MADV_POPULATE_WRITE``) on a thread of its own, in the order the readers fill them, while they wait on the disk.
When the file is cached the read is CPU-bound, and the fresh pages' zeroing is paid on every read (heap memory
is faster only when the heap already holds it).

Populating never writes a byte (it maps zeroed pages, and leaves a page already mapped alone), so it is safe
beside a reader already filling the same pages. Where the kernel lacks it (Linux before 5.14, other systems),
arrays are plain ``np.empty`` and nothing is populated: touching pages by writing to them could overwrite what a
reader put there.
"""

from __future__ import annotations

import mmap
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .arrays import byte_view

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

MADV_POPULATE_WRITE: int | None = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
MIN_MAPPED = 1 << 20  # smaller arrays come from the allocator: a mapping each would cost more than it saves
STEP = 8 << 20  # bytes populated per call: the readers' next pages are mapped early, a stop is seen soon


def _supported() -> bool:
    if MADV_POPULATE_WRITE is None:
        return False
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        return False
    finally:
        probe.close()
    return True


POPULATE = _supported()


def _max_mappings() -> int:
    """Mappings of ours alive at once: a quarter of the kernel's limit on a process's mappings (65530 by default),
    which a restore of a model of 100,000 large tensors would otherwise exhaust, failing the allocator's own."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return max(0, int(f.read()) // 4)
    except (OSError, ValueError):
        return 4096


MAX_MAPPINGS = _max_mappings()
_live = 0
_live_lock = threading.Lock()


def _unmapped() -> None:
    global _live
    with _live_lock:
        _live -= 1


def empty(shape: Sequence[int], dtype: np.dtype[Any]) -> tuple[np.ndarray[Any, Any], mmap.mmap | None]:
    """An uninitialized array, and the anonymous mapping that holds it when it is large enough to populate
    (None otherwise, or once ``MAX_MAPPINGS`` of ours are alive). The mapping lives as long as the array (its
    base) and is unmapped with it."""
    global _live
    count = 1
    for dim in shape:
        count *= int(dim)
    nbytes = count * dtype.itemsize
    if not POPULATE or nbytes < MIN_MAPPED:
        return np.empty(tuple(shape), dtype=dtype), None
    with _live_lock:
        if _live >= MAX_MAPPINGS:
            return np.empty(tuple(shape), dtype=dtype), None
        _live += 1
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except BaseException:
        _unmapped()
        raise
    weakref.finalize(mapping, _unmapped)
    return np.frombuffer(mapping, dtype=dtype, count=count).reshape(tuple(shape)), mapping


def aligned(nbytes: int) -> memoryview:
    """``nbytes`` of page-aligned, uninitialized memory, for the kernel to read into.

    Where a read lands matters: reading a file out of the page cache into a buffer 16 bytes past a page boundary
    (where the allocator puts a large ``np.empty`` or ``bytearray``) is slower than into a page-aligned one, with
    the same ``preadv`` calls and whatever the file offset. The memory comes from the allocator (a page more,
    sliced at the boundary), not a mapping of its own: the allocator hands back blocks whose pages are already
    backed, where a new mapping's first touches fault."""
    if nbytes < mmap.PAGESIZE:
        return memoryview(bytearray(nbytes))  # one page or less: the copy is too short for its alignment to matter
    if "numpy" not in sys.modules:
        # A process that holds no array (``ckpt verify``) does not import numpy for a buffer: a mapping of its own
        # is aligned, and its first touches are paid once, as the executor keeps its scan buffers.
        return memoryview(mmap.mmap(-1, nbytes))
    raw = np.empty(nbytes + mmap.PAGESIZE, dtype=np.uint8)
    skip = -raw.ctypes.data % mmap.PAGESIZE
    return byte_view(raw[skip : skip + nbytes])  # the view keeps ``raw`` alive


class Populator:
    """Populates ``mappings`` in order on a thread of its own until done or :meth:`close`d (a context manager)."""

    def __init__(self, mappings: Sequence[mmap.mmap]) -> None:
        self._mappings = list(mappings)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._mappings and MADV_POPULATE_WRITE is not None:
            self._thread = threading.Thread(target=self._run, name="ckptfmt-populate", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert MADV_POPULATE_WRITE is not None
        for mapping in self._mappings:
            size = len(mapping)
            for start in range(0, size, STEP):
                if self._stop.is_set():
                    return
                try:
                    mapping.madvise(MADV_POPULATE_WRITE, start, min(STEP, size - start))
                except (OSError, ValueError):
                    return  # out of memory or unmapped: the readers fault pages in themselves, as without us

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Populator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MAX_MAPPINGS", "MIN_MAPPED", "POPULATE", "Populator", "aligned", "empty"]
