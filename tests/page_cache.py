"""How many of a file's pages the page cache holds: ``mincore(2)`` on a mapping of the file, which faults nothing
in (Linux). For the tests of what a read leaves cached (a checkpoint read once must not evict the dataset)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_FAILED = ctypes.c_void_p(-1).value


def cached_pages(path: str | os.PathLike[str]) -> int:
    return sum(resident(path))


def resident(path: str | os.PathLike[str]) -> list[bool]:
    """Whether each page of the file is in the page cache."""
    size = os.path.getsize(path)
    if size == 0:
        return []
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return [bool(b & 1) for b in vec]
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def pages(path: str | os.PathLike[str]) -> int:
    return (os.path.getsize(path) + mmap.PAGESIZE - 1) // mmap.PAGESIZE


def data_files(root: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(root).rglob("*.safetensors"))


def evict(root: str | os.PathLike[str]) -> None:
    """Every file under ``root`` out of the page cache (synced first: dirty pages are not dropped)."""
    for path in Path(root).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
