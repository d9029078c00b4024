"""S3 uploads with several multipart parts in flight (storage/multipart.py), against moto's real HTTP server."""

from __future__ import annotations

import os
from typing import Any

import pytest
from s3_server import CountingProxy, MotoServer

import ckptfmt
from ckptfmt.storage import multipart, open_store, s3

MiB = 1 << 20
PATH = "weights/r00000-00000.safetensors"


@pytest.fixture
def bucket(moto_server: MotoServer) -> str:
    return moto_server.create_bucket()


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 MiB parts (S3's minimum), so a few MiB make a real multipart upload."""
    monkeypatch.setattr(s3, "PART_SIZE", 5 * MiB)


def fast_fail(options: dict[str, Any]) -> dict[str, Any]:
    return {**options, "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}


def write_in_pieces(out: ckptfmt.OutputFile, data: bytes, piece: int) -> None:
    for lo in range(0, len(data), piece):
        out.write(memoryview(data)[lo : lo + piece])


def etag(moto_server: MotoServer, bucket: str, key: str) -> str:
    """S3 (and moto) tag a multipart object ``"<md5>-<parts>"``, a single PUT plain ``"<md5>"``."""
    return str(moto_server.client().head_object(Bucket=bucket, Key=key)["ETag"]).strip('"')


def nothing_left(moto_server: MotoServer, bucket: str) -> None:
    client = moto_server.client()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_parts_upload_concurrently_and_round_trip(moto_server: MotoServer, bucket: str) -> None:
    data = os.urandom(27 * MiB + 12345)  # five full parts and a short last one
    with CountingProxy(moto_server.port).running() as proxy:
        store = open_store(f"s3://{bucket}/ck", moto_server.storage_options(proxy.endpoint))
        out = store.create(PATH)
        proxy.reset()
        write_in_pieces(out, data, 3 * MiB + 1)  # writes that straddle part boundaries
        out.commit()
        in_flight = proxy.max_busy
    # Seen on the wire: several upload_part requests unanswered at once, never more than the bound.
    assert 3 <= in_flight <= multipart.parts_in_flight(5 * MiB, 5 * MiB), in_flight
    assert etag(moto_server, bucket, f"ck/{PATH}").endswith("-6")
    store = open_store(f"s3://{bucket}/ck", moto_server.storage_options())
    assert store.read(PATH) == data
    assert store.pending_uploads() == []


@pytest.mark.parametrize("size", [0, 1000, 5 * MiB])
def test_a_file_of_at_most_one_part_is_one_put(moto_server: MotoServer, bucket: str, size: int) -> None:
    data = os.urandom(size)
    store = open_store(f"s3://{bucket}/ck", moto_server.storage_options())
    out = store.create(PATH)
    write_in_pieces(out, data, 2 * MiB)
    assert not store.exists(PATH)
    out.commit()
    assert store.read(PATH) == data
    assert "-" not in etag(moto_server, bucket, f"ck/{PATH}")
    assert store.pending_uploads() == []


def test_abort_before_commit_leaves_nothing(moto_server: MotoServer, bucket: str) -> None:
    store = open_store(f"s3://{bucket}/ck", moto_server.storage_options())
    out = store.create(PATH)
    out.write(os.urandom(16 * MiB))  # three parts sent, the fourth being filled
    assert [p for p, _ in store.pending_uploads()] == [PATH]
    assert not store.exists(PATH)
    out.abort()
    out.abort()
    nothing_left(moto_server, bucket)


def test_failed_part_aborts_the_upload(moto_server: MotoServer, bucket: str) -> None:
    """The upload disappears under the writer (another process aborted it): every later part is
    refused (NoSuchUpload), the write fails naming the file, and nothing is published or left pending."""
    store = open_store(f"s3://{bucket}/ck", fast_fail(moto_server.storage_options()))
    out = store.create(PATH)
    out.write(os.urandom(6 * MiB))  # part 1 sent: the upload exists
    [(path, upload_id)] = store.pending_uploads()
    store.abort_upload(path, upload_id)
    with pytest.raises(ckptfmt.StorageError, match="part") as raised:
        out.write(os.urandom(20 * MiB))
        out.commit()
    assert raised.value.path == PATH
    out.abort()  # already aborted: a no-op
    nothing_left(moto_server, bucket)


def test_network_cut_mid_upload_fails_and_publishes_nothing(moto_server: MotoServer, bucket: str) -> None:
    """The abort cannot reach the server either: the upload stays listed for gc, nothing is published."""
    with CountingProxy(moto_server.port).running() as proxy:
        store = open_store(f"s3://{bucket}/ck", fast_fail(moto_server.storage_options(proxy.endpoint)))
        out = store.create(PATH)
        proxy.cut_after = proxy.sent_to_server + 12 * MiB
        with pytest.raises(ckptfmt.StorageError) as raised:
            write_in_pieces(out, os.urandom(30 * MiB), MiB)
            out.commit()
        assert raised.value.path == PATH
    store = open_store(f"s3://{bucket}/ck", moto_server.storage_options())
    assert not store.exists(PATH)
    for path, upload_id in store.pending_uploads():
        store.abort_upload(path, upload_id)
    nothing_left(moto_server, bucket)


def test_too_many_parts_is_refused(moto_server: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "MAX_PARTS", 3)
    store = open_store(f"s3://{bucket}/ck", moto_server.storage_options())
    out = store.create(PATH)
    with pytest.raises(ckptfmt.StorageError, match="more than 3 parts"):
        write_in_pieces(out, os.urandom(32 * MiB), 4 * MiB)  # parts of 5, 10 and 10 MiB, then more
    nothing_left(moto_server, bucket)


def test_part_sizes_fit_s3_limits_within_the_memory_bound() -> None:
    base = 16 * MiB
    sizes = [multipart.part_size(n, base) for n in range(1, multipart.MAX_PARTS + 1)]
    assert min(sizes) >= multipart.MIN_PART
    assert sum(sizes) > 200 << 30  # a data file of hundreds of GiB still fits in S3's 10,000 parts
    for size in set(sizes):
        # the parts uploading and the one being filled stay within the stated bound (80 MiB a file)
        assert (multipart.parts_in_flight(size, base) + 1) * size <= multipart.BUFFER_PARTS * base
    assert multipart.parts_in_flight(base, base) == 4


def test_ranged_reads_share_gets_and_land_byte_exact(moto_server: MotoServer, bucket: str) -> None:
    data = os.urandom(MiB)
    store = open_store(f"s3://{bucket}/ck", moto_server.storage_options())
    store.put_exclusive(PATH, data)
    spans = [(0, 100), (100, 300), (300, 301), (5000, 9000)]
    with CountingProxy(moto_server.port).running() as proxy:
        proxied = open_store(f"s3://{bucket}/ck", moto_server.storage_options(proxy.endpoint))
        outs = [bytearray(end - begin) for begin, end in spans]
        proxy.reset()
        proxied.read_ranges(PATH, [(b, memoryview(o)) for (b, _), o in zip(spans, outs, strict=True)])
        moved, requests = proxy.received_from_server, proxy.requests
    assert [bytes(o) for o in outs] == [data[b:e] for b, e in spans]
    assert requests == 2  # the three neighbouring ranges share one GET
    assert moved < 301 + 4000 + 4096  # the bytes asked for, and headers
    overlapping = [bytearray(200), bytearray(200)]
    store.read_ranges(PATH, [(0, memoryview(overlapping[0])), (100, memoryview(overlapping[1]))])
    assert [bytes(o) for o in overlapping] == [data[:200], data[100:300]]
    with pytest.raises(ckptfmt.SizeMismatchError, match="ends before"):
        store.read_ranges(PATH, [(0, memoryview(bytearray(10))), (MiB - 10, memoryview(bytearray(20)))])
