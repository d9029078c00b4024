"""S3 through s3fs's own client: multipart uploads with parts in flight, checked ranged GETs streamed into
their destinations, create-only PUTs whose lost race is read from S3's answer, unfinished uploads for gc.

Chosen by :func:`ckptfmt.storage.open_store` for ``s3://`` and ``s3a://`` URLs served by s3fs; everything
S3 shares with other object stores (error translation, the create-only probe, listings) is
:class:`~ckptfmt.storage.remote.FsspecStore`'s.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import SizeMismatchError, StorageError
from .base import OutputFile
from .multipart import MultipartOutput
from .remote import Fill, FsspecStore, caused_by

SCHEMES = ("s3://", "s3a://")
PART_SIZE = 16 << 20  # multipart part size (several parts in flight, storage/multipart.py)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
T = TypeVar("T")


def with_retries(options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage_options`` for s3fs with throttling, 5xx and dropped connections retried with backoff by
    botocore's standard mode (5 attempts), unless the caller configured retries."""
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
    out["config_kwargs"] = config
    return out


def lost_create_race(exc: BaseException) -> bool:
    """Whether an exclusive write failed because the object exists: S3 answers a lost
    ``If-None-Match: *`` with HTTP 412 ``PreconditionFailed``. Read from the status code and error
    code of any botocore-style error in the exception's cause/context chain, never from its text."""

    def refused(current: BaseException) -> bool:
        if isinstance(current, FileExistsError):
            return True
        response = getattr(current, "response", None)
        if not isinstance(response, dict):
            return False
        error = response.get("Error")
        meta = response.get("ResponseMetadata")
        code = error.get("Code") if isinstance(error, dict) else None
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        return code == "PreconditionFailed" or status == 412

    return caused_by(exc, refused)


class RangeNotHonoured(Exception):
    """A ranged GET was answered with other bytes than it asked for (the store raises a StorageError)."""


def answered_range(resp: Mapping[str, Any], start: int, end: int) -> int:
    """How many of the bytes ``[start, end)`` a GET's answer holds, from ``start`` on, read from its status,
    Content-Range and Content-Length: all of them, or fewer where the object ends first. Raises
    RangeNotHonoured where the answer holds other bytes, so a store that ignores or misreads Range never
    hands a reader another part of the file.

    A 200 is the whole object (HTTP lets a server ignore Range): from byte 0 its first bytes are the asked
    ones, and the caller reads just those; from anywhere else it is refused, not skipped through, since
    every GET would then cost the object up to its range (a shard read in 64 MiB pieces, many times over).
    """
    meta = resp.get("ResponseMetadata")
    status = meta.get("HTTPStatusCode") if isinstance(meta, Mapping) else None
    length = resp.get("ContentLength")
    length = length if isinstance(length, int) else None
    asked = f"bytes {start}-{end - 1}"
    if status == 200:
        if start != 0:
            raise RangeNotHonoured(
                f"asked for {asked}, got HTTP 200 with the whole object ({length} bytes): the store ignores Range"
            )
        return end if length is None else min(length, end)
    content_range = resp.get("ContentRange")
    match = _CONTENT_RANGE.fullmatch(content_range.strip()) if isinstance(content_range, str) else None
    if status != 206 or match is None:
        raise RangeNotHonoured(f"asked for {asked}, got HTTP {status} with Content-Range {content_range!r}")
    first, last, total = int(match[1]), int(match[2]), match[3]
    ends_first = last < end - 1 and total == str(last + 1)  # the object is shorter than the range asked
    if first != start or last > end - 1 or (last < end - 1 and not ends_first) or length != last + 1 - first:
        raise RangeNotHonoured(f"asked for {asked}, got Content-Range {content_range!r} with Content-Length {length}")
    return last + 1 - start


async def _stream_gets(fs: Any, full: str, gets: Sequence[tuple[int, int]], fills: Sequence[Fill]) -> None:
    """s3fs: send every GET at once, each streaming its body straight into its destinations (which tile it),
    so no whole-range ``bytes`` is built and copied again. A GET whose stream breaks resumes where it
    stopped (up to ``fs.retries`` times); one that ends early raises EOFError(the byte it should reach);
    one answered with other bytes than asked raises RangeNotHonoured (``answered_range``)."""
    bucket, key, _ = fs.split_path(full)

    async def get(start: int, end: int, fill: Fill) -> None:
        at, attempts = start, 0
        while at < end:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={at}-{end - 1}", **fs.req_kw)
            body = resp["Body"]
            try:
                if at + answered_range(resp, at, end) < end:
                    raise EOFError(end)
                for offset, view in fill:
                    filled = max(at - start - offset, 0)  # destinations filled before a resumed GET are skipped
                    while filled < len(view):
                        got = await body.readinto(view[filled:])
                        if not got:
                            raise EOFError(end)
                        filled += got
                        at += got
            except (EOFError, RangeNotHonoured):
                raise
            except Exception:
                attempts += 1
                if attempts >= fs.retries:
                    raise
            finally:
                body.close()

    tasks = [get(start, end, fill) for (start, end), fill in zip(gets, fills, strict=True)]
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, BaseException):
            raise result


async def _read_head(fs: Any, full: str, limit: int) -> bytes:
    """s3fs: an object's first bytes, at most ``limit`` of them, in one ranged GET checked as ``_stream_gets``
    checks its own, retried as s3fs retries its reads."""
    from s3fs.core import _error_wrapper

    bucket, key, _ = fs.split_path(full)

    async def call() -> bytes:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit - 1}", **fs.req_kw)
        body = resp["Body"]
        try:
            out = bytearray(answered_range(resp, 0, limit))
            view, filled = memoryview(out), 0
            while filled < len(out):
                got = await body.readinto(view[filled:])
                if not got:
                    raise EOFError(len(out))
                filled += got
            return bytes(out)
        finally:
            body.close()

    data: bytes = await _error_wrapper(call, retries=fs.retries)
    return data


class S3Store(FsspecStore):
    """An S3 prefix through s3fs (``fs._call_s3``): uploads with parts in flight (its own S3File sends one at
    a time), reads as checked GETs, and the multipart uploads a killed writer leaves, for gc to abort."""

    def _output(self, full: str, path: str) -> OutputFile:
        return MultipartOutput(self.fs, full, path, part_bytes=PART_SIZE)

    def _lost_race(self, exc: BaseException) -> bool:
        return lost_create_race(exc)

    def _checked(self, path: str, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``call`` on s3fs's loop; a GET answered with other bytes, or ending early, becomes our error."""
        from fsspec.asyn import sync

        try:
            result: T = sync(self.fs.loop, call, self.fs, self._full(path), *args)
        except RangeNotHonoured as exc:
            where = f"{self.url.rstrip('/')}/{path}"
            raise StorageError(f"ranged read of {where} not honoured: {exc}", path=path) from exc
        except EOFError as exc:
            raise SizeMismatchError(f"file ends before byte {exc.args[0]}", path=path) from exc
        return result

    def _head(self, path: str, limit: int) -> bytes:
        return bytes(self._checked(path, _read_head, limit))

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" else out
        if len(view):
            self.read_ranges(path, [(begin, view)])  # the checked GETs

    def _fetch(
        self, path: str, gets: Sequence[tuple[int, int]], todo: Sequence[tuple[int, memoryview]], fills: list[Fill]
    ) -> builtins.list[Any] | None:
        if all(b0 + len(v0) <= b1 for (b0, v0), (b1, _) in itertools.pairwise(todo)):
            self._checked(path, _stream_gets, gets, fills)  # straight into the destinations
            return None
        # overlapping destinations cannot both be streamed into: each GET lands in a buffer first
        blobs = [bytearray(end - start) for start, end in gets]
        self._checked(path, _stream_gets, gets, [[(0, memoryview(b))] for b in blobs])
        return blobs

    def pending_uploads(self) -> builtins.list[tuple[str, str]]:
        bucket, _, prefix = self.root.partition("/")
        try:
            uploads = self.fs.list_multipart_uploads(bucket)
        except Exception as exc:
            raise self._wrap(exc, "", "listing multipart uploads") from exc
        start = prefix + "/" if prefix else ""
        return [(u["Key"][len(start) :], u["UploadId"]) for u in uploads if u["Key"].startswith(start)]

    def abort_upload(self, path: str, upload_id: str) -> None:
        bucket, _, prefix = self.root.partition("/")
        key = f"{prefix}/{path}" if prefix else path
        try:
            self.fs.abort_mpu(bucket, key, upload_id)
        except Exception as exc:
            raise self._wrap(exc, path, "aborting a multipart upload", writing=True) from exc


__all__ = ["PART_SIZE", "S3Store", "answered_range", "lost_create_race", "with_retries"]
