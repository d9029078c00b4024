"""Any fsspec filesystem (memory://, s3://, ...). Object stores publish a file in one step on close."""

from __future__ import annotations

import asyncio
import builtins
import itertools
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import MissingFileError, SizeMismatchError, StorageError
from .base import DEFAULT_MAX_READ, Capabilities, OutputFile, Store
from .multipart import MultipartOutput

# Filesystems whose writes become visible only when complete (multipart upload), so a failed write
# can be discarded without ever appearing under the final name.
_ATOMIC_PUT = {"s3", "s3a", "gcs", "gs", "abfs", "az"}
PART_SIZE = 16 << 20  # multipart part size (s3fs: several in flight, storage/multipart.py; others: one)
READ_PIECE = 64 << 20  # the largest ranged GET: longer runs of neighbouring ranges are split, fetched together
# The object an exclusive-create probe writes and deletes (FsspecStore._probe_create_only): the temp name of a
# manifest, so `ckpt gc` recognises one a killed process leaves behind as a writer's (ckptfmt/run.py).
PROBE_NAME = ".manifest.json.tmp-{token}"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def lost_create_race(exc: BaseException) -> bool:
    """Whether an exclusive write failed because the object exists: S3 answers a lost
    ``If-None-Match: *`` with HTTP 412 ``PreconditionFailed``. Read from the status code and error
    code of any botocore-style error in the exception's cause/context chain, never from its text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 32:
        seen.add(id(current))
        if isinstance(current, FileExistsError):
            return True
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            error = response.get("Error")
            meta = response.get("ResponseMetadata")
            code = error.get("Code") if isinstance(error, dict) else None
            status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
            if code == "PreconditionFailed" or status == 412:
                return True
        current = current.__cause__ or current.__context__
    return False


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


class DirectOutput(OutputFile):
    """Streams into the final name; the object store publishes it on close, discards on abort."""

    def __init__(self, fs: Any, full: str, rel: str) -> None:
        self._rel = rel
        try:
            self._file: Any = fs.open(full, "wb", block_size=PART_SIZE)
        except Exception as exc:
            raise StorageError(f"cannot create: {exc}", path=rel) from exc

    def write(self, data: bytes | memoryview) -> None:
        assert self._file is not None, "write after commit/abort"
        try:
            self._file.write(data)
        except Exception as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._rel) from exc

    def commit(self) -> None:
        assert self._file is not None, "commit after commit/abort"
        try:
            self._file.close()
        except Exception as exc:
            self.abort()
            raise StorageError(f"upload failed: {exc}", path=self._rel) from exc
        self._file = None

    def abort(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            file.discard()  # aborts the multipart upload instead of publishing a truncated object
        except Exception:
            pass
        file.closed = True  # never let close() (or the finalizer) publish what was written


class RenameOutput(OutputFile):
    """Writes under a hidden temp name, renames into place on commit."""

    def __init__(self, fs: Any, full: str, rel: str) -> None:
        self._fs = fs
        self._full = full
        self._rel = rel
        head, _, name = full.rpartition("/")
        self._tmp = f"{head}/.{name}.tmp-{secrets.token_hex(6)}"
        try:
            self._file: Any = fs.open(self._tmp, "wb")
        except Exception as exc:
            raise StorageError(f"cannot create: {exc}", path=rel) from exc

    def write(self, data: bytes | memoryview) -> None:
        assert self._file is not None, "write after commit/abort"
        try:
            self._file.write(data)
        except Exception as exc:
            self.abort()
            raise StorageError(f"write failed: {exc}", path=self._rel) from exc

    def commit(self) -> None:
        assert self._file is not None, "commit after commit/abort"
        try:
            self._file.close()
            self._file = None
            self._fs.mv(self._tmp, self._full)
        except Exception as exc:
            self.abort()
            raise StorageError(f"could not publish: {exc}", path=self._rel) from exc

    def abort(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception:
                pass
            self._file = None
        try:
            self._fs.rm_file(self._tmp)
        except Exception:
            pass


def plan_gets(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranged GETs that fetch sorted ``[begin, end)`` ranges: neighbouring (or overlapping) ranges share
    one GET, since every request costs a round trip; a run longer than ``READ_PIECE`` is cut into equal
    pieces fetched concurrently, since one stream of an object store is slower than several."""
    runs: list[tuple[int, int]] = []
    for begin, end in ranges:
        if runs and begin <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(end, runs[-1][1]))
        else:
            runs.append((begin, end))
    gets: list[tuple[int, int]] = []
    for begin, end in runs:
        pieces = -(-(end - begin) // READ_PIECE)
        bounds = [begin + (end - begin) * i // pieces for i in range(pieces + 1)]
        gets.extend(itertools.pairwise(bounds))
    return gets


Fill = list[tuple[int, memoryview]]  # (offset in a GET, destination) pieces, in order


def _fills(gets: Sequence[tuple[int, int]], todo: Sequence[tuple[int, memoryview]]) -> list[Fill]:
    """For each GET, the ``(offset in the GET, destination)`` pieces its bytes fill, in order."""
    fills: list[Fill] = [[] for _ in gets]
    index = 0
    for begin, view in todo:
        while gets[index][1] <= begin:
            index += 1
        at, piece = begin, index
        while at < begin + len(view):
            start, end = gets[piece]
            take = min(end, begin + len(view)) - at
            fills[piece].append((at - start, view[at - begin : at - begin + take]))
            at += take
            piece += 1
    return fills


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


class FsspecStore(Store):
    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.capabilities = Capabilities(exclusive_create=bool(_ATOMIC_PUT.intersection(protocols)), local=False)
        # s3fs: uploads with parts in flight, through its client (its S3File sends one part at a time)
        self._s3_client = "s3" in protocols and hasattr(fs, "_call_s3")
        # whether the store was seen to refuse a create-only PUT over an existing object (_probe_create_only)
        self._create_only_checked = not self.capabilities.exclusive_create
        self._probe_lock = threading.Lock()

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}"

    def sibling(self, name: str) -> FsspecStore:
        parent = self.root.rpartition("/")[0]
        url = self.url.rstrip("/")
        return FsspecStore(self.fs, f"{parent}/{name}", f"{url.rpartition('/')[0]}/{name}")

    def _wrap(self, exc: Exception, path: str, doing: str, *, writing: bool = False) -> Exception:
        where = f"{self.url.rstrip('/')}/{path}" if path else self.url
        if isinstance(exc, FileNotFoundError):
            if writing:  # on a write, "not found" means the bucket (or container) is missing
                return StorageError(f"{doing} failed: no such bucket or location for {where}", path=path)
            return MissingFileError("file is missing", path=path)
        if isinstance(exc, PermissionError):
            return StorageError(f"{doing} failed: access denied to {where}: {exc}", path=path)
        return StorageError(f"{doing} failed for {where}: {type(exc).__name__}: {exc}", path=path)

    def create(self, path: str) -> OutputFile:
        full = self._full(path)
        try:
            if self._s3_client:
                return MultipartOutput(self.fs, full, path, part_bytes=PART_SIZE)
            if self.capabilities.exclusive_create:  # uploads appear whole: no temporary name needed
                return DirectOutput(self.fs, full, path)
            return RenameOutput(self.fs, full, path)
        except StorageError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            raise self._wrap(cause, path, "create", writing=True) from exc

    def put_exclusive(self, path: str, data: bytes) -> None:
        """Create-only (S3: ``If-None-Match: *``). Before a store's first one, the store is seen to honour it
        (``_probe_create_only``): a store that ignores the condition would let two writers both commit."""
        if not self._create_only_checked:
            with self._probe_lock:
                if not self._create_only_checked:
                    self._probe_create_only(path)
                    self._create_only_checked = True
        self._put_create_only(path, data)

    def _put_create_only(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._full(path), data, mode="create")
        except FileExistsError:
            raise
        except Exception as exc:
            if lost_create_race(exc):
                raise FileExistsError(path) from exc
            raise self._wrap(exc, path, "exclusive write", writing=True) from exc

    def _probe_create_only(self, path: str) -> None:
        """Write a probe object, then create-only again over it: that must fail as a lost race (HTTP 412).
        A store (or a proxy before it) that drops ``If-None-Match`` overwrites instead, and is refused.

        A probe, not a read-back of the manifest after its PUT: a read-back sees the writer's own bytes even
        when a second writer overwrites them a moment later, so it cannot tell a store that honours the
        condition from one that does not. Three requests, once per store; the probe is deleted either way.
        A refusal names ``path``, the lock or manifest that was about to be written.
        """
        probe = PROBE_NAME.format(token=secrets.token_hex(6))
        where = f"{self.url.rstrip('/')}/"
        try:
            try:
                self._put_create_only(probe, b"probe")
            except FileExistsError as exc:  # not a lost race: nothing had that name
                raise StorageError(
                    f"{where} refused a create-only PUT of a new object ({probe}) as if it existed (HTTP 412)",
                    path=path,
                ) from exc
            try:
                self._put_create_only(probe, b"probe")
            except FileExistsError:
                return  # refused, as it must be
            raise StorageError(
                f"{where} does not honour conditional writes: a create-only PUT (If-None-Match: *) replaced "
                "an existing object instead of failing with 412, so two writers could both commit here and "
                "one save would silently disappear; refusing to write a lock or manifest to this store",
                path=path,
            )
        finally:
            try:
                self.delete(probe)
            except StorageError:
                pass  # a leftover probe is a writer's temp file to `ckpt gc`

    def read(self, path: str, *, max_size: int = DEFAULT_MAX_READ) -> bytes:
        size = self.size(path)
        if size > max_size:
            raise SizeMismatchError(f"is {size} bytes, more than the {max_size} this file may have", path=path)
        if size == 0:
            return b""  # a ranged GET of an empty object is "not satisfiable"
        try:
            # Ranged, so an object replaced meanwhile by a bigger one still costs at most max_size + 1 bytes.
            if self._s3_client:
                from fsspec.asyn import sync

                data = bytes(sync(self.fs.loop, _read_head, self.fs, self._full(path), max_size + 1))
            else:
                data = bytes(self.fs.cat_file(self._full(path), start=0, end=max_size + 1))
        except RangeNotHonoured as exc:
            raise self._not_honoured(exc, path) from exc
        except EOFError as exc:
            raise SizeMismatchError(f"file ends before byte {exc.args[0]}", path=path) from exc
        except Exception as exc:
            raise self._wrap(exc, path, "read") from exc
        if len(data) > max_size:
            raise SizeMismatchError(f"is more than the {max_size} bytes this file may have", path=path)
        return data

    def _not_honoured(self, exc: RangeNotHonoured, path: str) -> StorageError:
        where = f"{self.url.rstrip('/')}/{path}"
        return StorageError(f"ranged read of {where} not honoured: {exc}", path=path)

    def read_into(self, path: str, begin: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" else out
        if not len(view):
            return
        if self._s3_client:  # the checked GETs of read_ranges
            self.read_ranges(path, [(begin, view)])
            return
        try:
            data = self.fs.cat_file(self._full(path), start=begin, end=begin + len(view))
        except Exception as exc:
            raise self._wrap(exc, path, "ranged read") from exc
        if len(data) != len(view):
            raise SizeMismatchError(f"file ends before byte {begin + len(view)}", path=path)
        view[:] = data

    def read_ranges(self, path: str, requests: Sequence[tuple[int, memoryview]], *, keep_cached: bool = True) -> None:
        todo = sorted(
            ((begin, out.cast("B") if out.format != "B" else out) for begin, out in requests if len(out)),
            key=lambda r: r[0],
        )
        if not todo:
            return
        gets = plan_gets([(begin, begin + len(view)) for begin, view in todo])
        fills = _fills(gets, todo)
        disjoint = all(b0 + len(v0) <= b1 for (b0, v0), (b1, _) in itertools.pairwise(todo))
        blobs: builtins.list[Any]
        try:
            if self._s3_client:
                from fsspec.asyn import sync

                if disjoint:
                    sync(self.fs.loop, _stream_gets, self.fs, self._full(path), gets, fills)
                    return
                # overlapping destinations cannot both be streamed into: each GET lands in a buffer first
                blobs = [bytearray(end - start) for start, end in gets]
                sync(self.fs.loop, _stream_gets, self.fs, self._full(path), gets, [[(0, memoryview(b))] for b in blobs])
            else:
                # one call: fsspec sends the GETs together (concurrently on async backends)
                blobs = self.fs.cat_ranges([self._full(path)] * len(gets), [g[0] for g in gets], [g[1] for g in gets])
        except RangeNotHonoured as exc:
            raise self._not_honoured(exc, path) from exc
        except EOFError as exc:
            raise SizeMismatchError(f"file ends before byte {exc.args[0]}", path=path) from exc
        except Exception as exc:
            raise self._wrap(exc, path, "ranged read") from exc
        for (start, end), data, fill in zip(gets, blobs, fills, strict=True):
            if isinstance(data, Exception):
                raise self._wrap(data, path, "ranged read") from data
            if len(data) != end - start:
                raise SizeMismatchError(f"file ends before byte {end}", path=path)
            for offset, view in fill:
                view[:] = memoryview(data)[offset : offset + len(view)]

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._full(path)))
        except Exception as exc:
            raise self._wrap(exc, path, "stat") from exc

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(self._full(path)))
        except Exception as exc:
            raise self._wrap(exc, path, "stat") from exc

    def list(self) -> dict[str, int]:
        try:
            self.fs.invalidate_cache(self.root)
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._wrap(exc, "", "listing") from exc
        prefix = self.root + "/"
        out: dict[str, int] = {}
        for name, info in found.items():
            if name.startswith(prefix) and info.get("type", "file") == "file":
                out[name[len(prefix) :]] = int(info.get("size") or 0)
        return out

    def pending_uploads(self) -> builtins.list[tuple[str, str]]:
        if not hasattr(self.fs, "list_multipart_uploads"):
            return []
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

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._full(path))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._wrap(exc, path, "delete", writing=True) from exc
