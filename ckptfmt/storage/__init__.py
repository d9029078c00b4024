"""Storage backends, chosen by URL: local paths and file:// go to the os module, everything else to fsspec."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError
from .base import Capabilities, OutputFile, Store
from .local import LocalStore
from .remote import FsspecStore


def open_store(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a checkpoint URL: a path, ``file://``, ``memory://``, ``s3://`` or any fsspec URL."""
    text = os.fspath(url)
    if "://" not in text:
        return LocalStore(text)
    if text.startswith("file://"):
        return LocalStore(text[len("file://") :])
    try:
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"no storage backend for {text!r}: {exc}") from exc
    return FsspecStore(fs, root, text)


__all__ = ["Capabilities", "FsspecStore", "LocalStore", "OutputFile", "Store", "open_store"]
