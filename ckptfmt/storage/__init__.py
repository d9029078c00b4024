"""Storage backends, chosen by URL: local paths and file:// go to the os module, everything else to fsspec."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import StorageError
from .base import Capabilities, OutputFile, Store
from .local import LocalStore

if TYPE_CHECKING:
    from .remote import FsspecStore


def open_store(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a checkpoint URL: a path, ``file://``, ``memory://``, ``s3://`` or any fsspec URL."""
    text = os.fspath(url)
    if "://" not in text:
        return LocalStore(text)
    if text.startswith("file://"):
        return LocalStore(text[len("file://") :])
    options = dict(storage_options or {})
    if text.startswith(("s3://", "s3a://")):
        # Throttling, 5xx and dropped connections are retried with backoff by botocore's standard mode.
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        options["config_kwargs"] = config
    try:
        import fsspec.core

        fs, root = fsspec.core.url_to_fs(text, **options)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"no storage backend for {text!r}: {exc}") from exc
    from .remote import FsspecStore  # asyncio and friends: only for a store that needs them (30 ms a process)

    return FsspecStore(fs, root, text)


def __getattr__(name: str) -> Any:
    if name == "FsspecStore":
        from .remote import FsspecStore

        return FsspecStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Capabilities", "FsspecStore", "LocalStore", "OutputFile", "Store", "open_store"]
