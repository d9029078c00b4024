"""Storage backends, chosen by URL: local paths and file:// go to the os module (local.py), s3:// to s3fs's
client (s3.py), everything else to fsspec (remote.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import StorageError
from .base import Capabilities, FileInfo, OutputFile, RangeReader, Store
from .local import LocalStore

if TYPE_CHECKING:
    from .remote import FsspecStore
    from .s3 import S3Store


def open_store(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a checkpoint URL: a path, ``file://``, ``memory://``, ``s3://`` or any fsspec URL."""
    text = os.fspath(url)
    if "://" not in text:
        return LocalStore(text)
    for scheme in ("file://", "local://"):  # fsspec's names for this machine's disk: the durable local store
        if text.startswith(scheme):
            return LocalStore(text[len(scheme) :])
    options = dict(storage_options or {})
    s3 = text.startswith(("s3://", "s3a://"))
    if s3:
        from .s3 import with_retries

        options = with_retries(options)
    try:
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(text, **options)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"no storage backend for {text!r}: {exc}") from exc
    # asyncio and friends: only for a store that needs them (every process would pay their import)
    if s3 and hasattr(fs, "_call_s3"):  # s3fs, whose client S3Store drives itself
        from .s3 import S3Store

        return S3Store(fs, root, text)
    from .remote import FsspecStore

    return FsspecStore(fs, root, text)


def __getattr__(name: str) -> Any:
    if name == "FsspecStore":
        from .remote import FsspecStore

        return FsspecStore
    if name == "S3Store":
        from .s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Capabilities",
    "FileInfo",
    "FsspecStore",
    "LocalStore",
    "OutputFile",
    "RangeReader",
    "S3Store",
    "Store",
    "open_store",
]
