"""What every converter shares: progress reporting, the result record, foreign-file access, provenance.

Foreign formats (Hugging Face, PyTorch, DCP) on object stores are read and written through fsspec.
On a local disk every source file is opened through :func:`ckptfmt.storage.local.open_below`: below
the source the user named (a directory, or the file itself), no symlink is followed at any level,
and only regular files are opened (a FIFO, socket or device is refused, never opened), so a
``weight_map`` or DCP ``relative_path`` naming a symlinked directory cannot read outside the source.
A Hugging Face cache snapshot is made of symlinks: pass a copy (``cp -rL``) or the blob files.
ckptfmt checkpoints themselves always go through :mod:`ckptfmt`'s own strict storage layer.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MissingFileError,
    SizeMismatchError,
    SourceFormatError,
    StorageError,
    UnsafePathError,
    UsageError,
)
from ..storage.local import open_below, open_dir_below, pread_exact, read_fd, scan_dir


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
    """A foreign file or directory: its fsspec filesystem and the path on it.

    Local ones also carry ``root``, the path the user named (followed as given), and ``rel``, the
    '/'-separated path below it (empty: the root itself), which is opened following no symlink.
    """

    fs: Any
    path: str
    url: str
    root: str | None = None
    rel: str = ""

    def join(self, name: str) -> Location:
        rel = f"{self.rel}/{name}" if self.rel else name
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.url.rstrip('/')}/{name}", self.root, rel)

    def parent(self) -> Location:
        """The directory holding a file the user named: the new root (its siblings are the source)."""
        path = self.path.rstrip("/").rpartition("/")[0] or "/"
        url = self.url.rstrip("/").rpartition("/")[0] or "/"
        return Location(self.fs, path, url, path if self.is_local else None)

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
    loc = Location(fs, str(path), text if "://" in text else os.path.abspath(text))
    return Location(fs, loc.path, loc.url, os.path.abspath(loc.path)) if loc.is_local else loc


def open_local(loc: Location) -> int:
    """A read-only fd of a local source file: regular, reached following no symlink below the source root."""
    assert loc.root is not None, "not a local location"
    try:
        return open_below(loc.root, loc.rel)
    except MissingFileError:
        raise CheckpointNotFoundError("no such file or directory", path=loc.url) from None
    except UnsafePathError as exc:
        linked = exc.problem == "symlink"
        hint = "; to convert linked files (a Hugging Face cache), copy them with `cp -rL`" if linked else ""
        raise UnsafePathError(f"{exc.message} (below the source {loc.root}){hint}", path=loc.url) from exc
    except StorageError as exc:
        raise StorageError(exc.message, path=loc.url) from exc


def file_size(loc: Location) -> int:
    if loc.root is None:
        return int(fs_call(loc.url, loc.fs.size, loc.path))
    fd = open_local(loc)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_file(loc: Location, max_size: int) -> bytes:
    """A whole small file (an index, DCP metadata), refused before reading when larger than ``max_size``."""
    if loc.root is None:
        size = int(fs_call(loc.url, loc.fs.size, loc.path))
        if size > max_size:
            raise SourceFormatError(f"is {size} bytes, more than the {max_size} this file may have", path=loc.url)
        data: bytes = fs_call(loc.url, loc.fs.cat_file, loc.path)
        if len(data) > max_size:
            raise SourceFormatError(f"is more than the {max_size} bytes this file may have", path=loc.url)
        return data
    fd = open_local(loc)
    try:
        return read_fd(fd, loc.url, max_size)
    except SizeMismatchError as exc:
        raise SourceFormatError(exc.message, path=loc.url) from exc
    finally:
        os.close(fd)


def fs_call(where: str, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an fsspec method, turning its exceptions into ckptfmt errors that name ``where``."""
    try:
        return func(*args, **kwargs)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError("no such file or directory", path=where) from exc
    except OSError as exc:
        raise StorageError(f"{type(exc).__name__}: {exc}", path=where) from exc


def read_range(loc: Location, begin: int, length: int) -> bytes:
    if loc.root is not None:
        if begin < 0 or length < 0:
            raise SourceFormatError(f"byte range [{begin}, {begin + length}) is not a range", path=loc.url)
        fd = open_local(loc)
        try:
            if begin + length > os.fstat(fd).st_size:  # checked before allocating the buffer
                raise SourceFormatError(f"file ends before byte {begin + length}", path=loc.url)
            first = os.pread(fd, length, begin)  # one copy, straight into the bytes returned
            if len(first) == length:
                return first
            out = bytearray(length)  # a short read (over 2 GiB at once, or the file shrank): fill the rest
            out[: len(first)] = first
            pread_exact(fd, loc.url, begin + len(first), memoryview(out)[len(first) :])
            return bytes(out)
        except SizeMismatchError as exc:
            raise SourceFormatError(exc.message, path=loc.url) from exc
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"read failed: {exc}", path=loc.url) from exc
        finally:
            os.close(fd)
    data: bytes = fs_call(loc.url, loc.fs.cat_file, loc.path, start=begin, end=begin + length)
    if len(data) != length:
        raise SourceFormatError(f"file ends before byte {begin + length}", path=loc.url)
    return data


def list_names(loc: Location) -> dict[str, str]:
    """Entries directly inside a directory: name -> "file" or "directory" (empty if not a directory).

    Locally, a symlink is listed as "symlink" and a FIFO, socket or device as "other": neither is
    followed, and opening one as a file is refused.
    """
    if loc.root is None:
        if not fs_call(loc.url, loc.fs.isdir, loc.path):
            return {}
        out: dict[str, str] = {}
        for info in fs_call(loc.url, loc.fs.ls, loc.path, detail=True):
            name = str(info["name"]).rstrip("/").rpartition("/")[2]
            out[name] = "directory" if info.get("type") == "directory" else "file"
        return out
    if not loc.rel:
        try:
            if not stat.S_ISDIR(os.stat(loc.root).st_mode):  # the user's own path: followed as given
                return {}
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StorageError(f"cannot stat: {exc}", path=loc.url) from exc
    try:
        fd = open_dir_below(loc.root, loc.rel)
    except MissingFileError:
        return {}
    except UnsafePathError:
        return {}  # a symlink or a file: not a directory to list
    try:
        entries = scan_dir(fd)
    except OSError as exc:
        raise StorageError(f"cannot list: {exc}", path=loc.url) from exc
    finally:
        os.close(fd)
    kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink"}
    return {name: kinds.get(stat.S_IFMT(st.st_mode), "other") for name, st in entries}


def exists(loc: Location) -> bool:
    """Whether anything is at ``loc`` (a local symlink counts, and is never followed)."""
    if loc.root is None:
        return bool(fs_call(loc.url, loc.fs.exists, loc.path))
    if not loc.rel:
        return os.path.exists(loc.root)
    parent, _, name = loc.rel.rpartition("/")
    holder = Location(loc.fs, loc.path, loc.url, loc.root, parent)
    return name in list_names(holder)


def refuse_links(out: Location) -> None:
    """Refuse a local export destination holding symlinks or special files: a writer going through fsspec
    or torch would write through them."""
    if out.root is None:
        return
    odd = sorted(f"{name} ({kind})" for name, kind in list_names(out).items() if kind in ("symlink", "other"))
    if odd:
        raise UnsafePathError(
            f"the destination holds {', '.join(odd[:5])}; exports write through nothing: remove them", path=out.url
        )


def refuse_existing(loc: Location, names: list[str], overwrite: bool) -> None:
    """Refuse to write over an existing foreign checkpoint unless asked to."""
    if overwrite:
        return
    present = [n for n in names if exists(loc.join(n))]
    if present:
        raise CheckpointExistsError(
            f"{', '.join(present)} already exist(s) here; pass --overwrite to replace", path=loc.url
        )


def converted_from(fmt: str, url: str, **extra: object) -> dict[str, object]:
    """The provenance of a converted checkpoint: only what the tool knows (the writer adds who and when)."""
    return {"converted_from": {"format": fmt, "url": url, **extra}}


def importer(fmt: str, convert: Callable[..., ConvertResult]) -> Callable[..., ConvertResult]:
    """The import of ``fmt`` as the registry calls it, ``import_FMT(src, dst, *, storage_options=None,
    overwrite=False, target_file_size=None, progress=None)``: the source located, then ``convert(location, dst,
    storage_options=, overwrite=, target_file_size=, progress=)`` (a progress that reports nothing by default)."""

    def run(
        src: str,
        dst: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        target_file_size: int | None = None,
        progress: Progress | None = None,
    ) -> ConvertResult:
        return convert(
            locate(src, storage_options),
            dst,
            storage_options=storage_options,
            overwrite=overwrite,
            target_file_size=target_file_size,
            progress=progress or NoProgress(),
        )

    run.__name__ = run.__qualname__ = f"import_{fmt.replace('-', '_')}"
    run.__doc__ = f"Import the {fmt} source at ``src`` as a ckptfmt checkpoint at ``dst``."
    return run


def writer_options(
    storage_options: Mapping[str, Any] | None, overwrite: bool, target_file_size: int | None
) -> dict[str, Any]:
    """``ckptfmt.open_writer``'s options for an import (no target file size given: the writer's default)."""
    options: dict[str, Any] = {"storage_options": storage_options, "overwrite": overwrite}
    if target_file_size is not None:
        options["target_file_size"] = target_file_size
    return options


def nbytes(value: Any) -> int:
    """The bytes of a numpy array or a torch tensor."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return int(value.numel()) * int(value.element_size())


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
