"""Streaming S3 uploads with several multipart parts in flight (s3fs's own writer sends one at a time).

Bytes are copied once, into the part being filled; a full part is sent as ``upload_part`` on s3fs's
event loop while the caller goes on writing. Memory bound, per file: the part being filled plus the
parts uploading never hold more than ``BUFFER_PARTS`` base parts (5 x 16 MiB = 80 MiB with the
default ``s3.PART_SIZE``: 4 parts uploading, 1 filling; once parts double, 1 uploading and
1 filling), so a writer saving two files at once holds at most 160 MiB above the caller's tensors.

Part sizes: S3 takes at most ``MAX_PARTS`` parts of at least 5 MiB (the last excepted). The first
``MAX_PARTS // 2`` parts are the base size and the rest twice it, so a file may reach 15,000 base
parts (234 GiB at 16 MiB); a file that needs more is refused with a StorageError, never truncated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from ..errors import StorageError
from .base import OutputFile

MIN_PART = 5 << 20  # S3's smallest part (every part but the last)
MAX_PARTS = 10_000  # S3's most parts in one upload (s3fs.core.MAX_UPLOAD_PARTS)
BUFFER_PARTS = 5  # base parts of memory per file: the part being filled plus those uploading


def part_size(number: int, base: int) -> int:
    """The size of part ``number`` (1-based): the base size for the first half of S3's parts, then twice it."""
    return base if number <= MAX_PARTS // 2 else 2 * base


def parts_in_flight(size: int, base: int) -> int:
    """How many parts of ``size`` may upload while one more is being filled, within the memory bound."""
    return max(1, BUFFER_PARTS * base // size - 1)


class MultipartOutput(OutputFile):
    """Streams into an S3 object through s3fs's client: one ``put_object`` for a file of at most one
    part, else a multipart upload whose parts upload concurrently. Nothing is visible under the final
    name before ``commit`` completes the upload; ``abort`` (and any failed part) aborts it."""

    def __init__(self, fs: Any, full: str, rel: str, *, part_bytes: int) -> None:
        self._fs = fs
        self._full = full
        self._rel = rel
        self._bucket, self._key, _ = fs.split_path(full)
        self._base = max(part_bytes, MIN_PART)
        self._part = bytearray()  # allocated at its full size (lazily zeroed pages), filled up to _filled
        self._filled = 0
        self._upload_id: str | None = None
        self._inflight: dict[int, concurrent.futures.Future[Any]] = {}
        self._etags: dict[int, str] = {}
        self._done = False

    def _call(self, method: str, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start one S3 call on s3fs's event loop (with s3fs's retries and error translation)."""
        coro = self._fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, self._fs.loop)

    def _fail(self, doing: str, exc: BaseException) -> StorageError:
        self.abort()
        return StorageError(f"{doing} failed for s3://{self._full}: {type(exc).__name__}: {exc}", path=self._rel)

    def _number(self) -> int:
        """The number of the part being filled."""
        return len(self._etags) + len(self._inflight) + 1

    def _collect(self, keep: int) -> None:
        """Wait until at most ``keep`` parts are uploading, recording each finished part's ETag."""
        while len(self._inflight) > keep:
            done, _ = concurrent.futures.wait(self._inflight.values(), return_when=concurrent.futures.FIRST_COMPLETED)
            for number, future in list(self._inflight.items()):
                if future in done:
                    del self._inflight[number]
                    try:
                        self._etags[number] = future.result()["ETag"]
                    except Exception as exc:
                        raise self._fail(f"upload of part {number}", exc) from exc

    def _send_part(self) -> None:
        """Upload the part being filled, in the background once the in-flight bound allows."""
        if self._upload_id is None:
            try:
                self._upload_id = self._call("create_multipart_upload").result()["UploadId"]
            except Exception as exc:
                raise self._fail("starting a multipart upload", exc) from exc
        self._collect(parts_in_flight(len(self._part), self._base) - 1)
        number = self._number()
        body, self._part = self._part, bytearray()
        del body[self._filled :]
        self._filled = 0
        self._inflight[number] = self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=body)

    def write(self, data: bytes | memoryview) -> None:
        assert not self._done, "write after commit/abort"
        view = memoryview(data).cast("B")
        while len(view):
            if self._filled == len(self._part) and self._filled:  # full, and more bytes follow
                if self._number() == MAX_PARTS:
                    error = OverflowError(f"a file of more than {MAX_PARTS} parts")
                    raise self._fail("upload", error) from error
                self._send_part()
            if not self._part:
                self._part = bytearray(part_size(self._number(), self._base))
            take = min(len(self._part) - self._filled, len(view))
            self._part[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]

    def commit(self) -> None:
        assert not self._done, "commit after commit/abort"
        if self._upload_id is None:
            try:
                del self._part[self._filled :]
                self._call("put_object", Body=self._part).result()
            except Exception as exc:
                raise self._fail("upload", exc) from exc
        else:
            if self._filled:
                self._send_part()
            self._collect(0)
            parts = {"Parts": [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]}
            try:
                self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload=parts).result()
            except Exception as exc:
                raise self._fail("completing the multipart upload", exc) from exc
        self._done = True
        self._part, self._filled = bytearray(), 0
        self._fs.invalidate_cache(self._full)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._part, self._filled = bytearray(), 0
        # Parts still uploading finish (or fail) first: an abort racing them could leave stored parts behind.
        concurrent.futures.wait(self._inflight.values())
        self._inflight.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._call("abort_multipart_upload", UploadId=upload_id).result()
            except Exception:
                pass  # the upload stays listed in Store.pending_uploads, for gc to abort


__all__ = ["MAX_PARTS", "MIN_PART", "MultipartOutput", "part_size", "parts_in_flight"]
