"""xxh3-128 of whole blocks with the GIL released: what lets a memory snapshot hash on a spare core while the
trainer's Python runs.

The ``xxhash`` binding releases the GIL only for inputs *longer* than 64 KiB, and a tree digest's pieces
(spec/tree-digests.md) are exactly 64 KiB: hashed through it, every piece holds the GIL. A background snapshot then
stalls a Python-bound trainer for about as long as its hashing takes (13 ms a step for 256 MiB on the CI machine,
+7 % step time), where its copy, which ``os.write`` does without the GIL, costs +3 %.

So the binding's own ``XXH3_128bits_dispatch`` (the library it bundles, exported by its extension module: the entry
that picks the CPU's widest vector unit, twice as fast here as plain ``XXH3_128bits``, which stands in where it is
missing) is called through :mod:`ctypes`, which releases the GIL for the call. The function is checked against the
binding once, on first use, over lengths around the block sizes; any difference, a missing symbol or a buffer whose
address cannot be taken (read-only: ``bytes``) falls back to the binding, so the digests are the same either way.
sha256 needs none of this: :mod:`hashlib` releases the GIL itself.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import xxhash


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


_lock = threading.Lock()
_loaded = False
_function: Callable[[int, int], _Hash128] | None = None


def _load() -> Callable[[int, int], _Hash128] | None:
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]

        library = ctypes.CDLL(_xxhash.__file__)
    except (ImportError, OSError):
        return None
    function: Any = getattr(library, "XXH3_128bits_dispatch", None) or getattr(library, "XXH3_128bits", None)
    if function is None:
        return None
    function.restype = _Hash128
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    probe = bytearray(i * 7 % 251 for i in range(3 << 16))
    at = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    for length in (0, 1, 4095, 4096, 65535, 65536, 65537, len(probe)):
        got = function(at, length)
        if f"{got.high64:016x}{got.low64:016x}" != xxhash.xxh3_128_hexdigest(memoryview(probe)[:length]):
            return None
    return function  # type: ignore[no-any-return]


def _xxh3() -> Callable[[int, int], _Hash128] | None:
    global _loaded, _function
    if not _loaded:
        with _lock:
            if not _loaded:
                _function = _load()
                _loaded = True
    return _function


def xxh3_blocks(data: memoryview, at: int, count: int, size: int) -> str | None:
    """The xxh3-128 hex digests, back to back, of ``count`` whole blocks of ``size`` bytes of ``data`` from byte
    ``at``, each hashed without the GIL; None where that cannot be done (the caller hashes them through ``xxhash``)."""
    if count == 0:
        return ""
    function = _xxh3()
    if function is None or data.readonly or not data.c_contiguous:
        return None
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(data)) + at
    except (TypeError, ValueError):  # an empty or otherwise unexportable buffer
        return None
    # A digest's bytes in memory are its low then its high 64 bits, little-endian: the canonical (big-endian) form
    # reversed. So the blocks are hashed last to first and the joined bytes reversed once, not formatted one by one.
    raw = b"".join([bytes(function(base + index * size, size)) for index in range(count - 1, -1, -1)])
    return raw[::-1].hex()


__all__ = ["xxh3_blocks"]
