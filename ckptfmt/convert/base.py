"""What every converter shares: progress reporting, the result record, foreign-file access, provenance.

Foreign formats (Hugging Face, PyTorch, DCP) are read and written through fsspec, which follows
symlinks (a Hugging Face cache is made of them) and serves local paths and URLs alike; ckptfmt
checkpoints themselves always go through :mod:`ckptfmt`'s own strict storage layer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import CheckpointExistsError, CheckpointNotFoundError, SourceFormatError, StorageError, UsageError


class Progress(Protocol):
    """Receives the amount of work (bytes) up front, then advances as it is done."""

    def start(self, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...


class NoProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass


@dataclass(slots=True, kw_only=True)
class ConvertResult:
    """What a conversion produced; ``to_dict`` is the shape ``ckpt convert --json`` prints."""

    source: str
    source_format: str
    destination: str
    destination_format: str
    tensors: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)
    checkpoint_id: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": {"url": self.source, "format": self.source_format},
            "destination": {"url": self.destination, "format": self.destination_format},
            "tensors": self.tensors,
            "bytes": self.bytes,
            "files": list(self.files),
            "checkpoint_id": self.checkpoint_id,
            "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class Location:
    """A foreign file or directory: its fsspec filesystem and the path on it."""

    fs: Any
    path: str
    url: str

    def join(self, name: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.url.rstrip('/')}/{name}")

    @property
    def is_local(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return "file" in protocols or "local" in protocols


def locate(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Location:
    import fsspec.core

    text = os.fspath(url)
    try:
        fs, path = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"no storage backend for {text!r}: {exc}") from exc
    return Location(fs, str(path), text if "://" in text else os.path.abspath(text))


def fs_call(where: str, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an fsspec method, turning its exceptions into ckptfmt errors that name ``where``."""
    try:
        return func(*args, **kwargs)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError("no such file or directory", path=where) from exc
    except OSError as exc:
        raise StorageError(f"{type(exc).__name__}: {exc}", path=where) from exc


def read_range(loc: Location, begin: int, length: int) -> bytes:
    data: bytes = fs_call(loc.url, loc.fs.cat_file, loc.path, start=begin, end=begin + length)
    if len(data) != length:
        raise SourceFormatError(f"file ends before byte {begin + length}", path=loc.url)
    return data


def list_names(loc: Location) -> dict[str, str]:
    """Entries directly inside a directory: name -> "file" or "directory" (empty if not a directory)."""
    if not fs_call(loc.url, loc.fs.isdir, loc.path):
        return {}
    out: dict[str, str] = {}
    for info in fs_call(loc.url, loc.fs.ls, loc.path, detail=True):
        name = str(info["name"]).rstrip("/").rpartition("/")[2]
        out[name] = "directory" if info.get("type") == "directory" else "file"
    return out


def refuse_existing(loc: Location, names: list[str], overwrite: bool) -> None:
    """Refuse to write over an existing foreign checkpoint unless asked to."""
    if overwrite:
        return
    present = [n for n in names if fs_call(loc.url, loc.fs.exists, loc.join(n).path)]
    if present:
        raise CheckpointExistsError(
            f"{', '.join(present)} already exist(s) here; pass --overwrite to replace", path=loc.url
        )


def converted_from(fmt: str, url: str, **extra: object) -> dict[str, object]:
    """The provenance of a converted checkpoint: only what the tool knows (the writer adds who and when)."""
    return {"converted_from": {"format": fmt, "url": url, **extra}}


def parse_size(value: str | int) -> int:
    """``123``, ``"5GB"``, ``"500MB"``, ``"2GiB"`` -> bytes (decimal units as huggingface_hub reads them)."""
    if isinstance(value, int):
        size = value
    else:
        text = value.strip().upper().replace(" ", "")
        units = {"TIB": 1 << 40, "GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10}
        units |= {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
        unit = next((u for u in units if text.endswith(u)), "")
        number, factor = (text[: -len(unit)], units[unit]) if unit else (text, 1)
        try:
            size = int(float(number) * factor)
        except ValueError:
            raise UsageError(f"cannot read size {value!r}; write e.g. 5GB, 500MB, 2GiB or a number of bytes") from None
    if size <= 0:
        raise UsageError(f"size must be positive, got {value!r}")
    return size
