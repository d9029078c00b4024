"""S3 stores that break HTTP's promises: a Range not honoured, an If-None-Match ignored.

Each is played by the proxy of s3_server.py editing requests on loopback in front of moto, never by
patching the client: what the library sees is a real server's answer to the request it did not send.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from s3_server import CountingProxy, MotoServer

import ckptfmt
from ckptfmt.storage import open_store


@pytest.fixture
def bucket(moto_server: MotoServer) -> str:
    return moto_server.create_bucket()


def write_weights(url: str, options: dict[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.w": rng.standard_normal((64, 64), dtype=np.float32) for i in range(4)}
    with ckptfmt.open_writer(url, profile="weights", storage_options=options) as w:
        w.write_tensors("weights", tensors)
        w.write_context("provenance", {"step": 1})
    return tensors


def data_file(url: str, options: dict[str, Any]) -> str:
    with ckptfmt.open(url, storage_options=options) as ckpt:
        (path,) = {c.path for t in ckpt.fields["weights"].tensors.values() for c in t.chunks}
    return path


def test_a_range_the_store_ignores_is_refused_not_read(moto_server: MotoServer, bucket: str) -> None:
    """The server answers 200 with the whole object: from byte 0 its first bytes are the asked ones, from
    anywhere else it is refused, naming the file and the range (it used to land the object's first bytes)."""
    url = f"s3://{bucket}/ck"
    tensors = write_weights(url, moto_server.storage_options())
    path = data_file(url, moto_server.storage_options())
    whole = open_store(url, moto_server.storage_options()).read(path)
    with CountingProxy(moto_server.port, drop_headers=frozenset({"range"})).running() as proxy:
        options = moto_server.storage_options(proxy.endpoint)
        with ckptfmt.open(url, storage_options=options) as ckpt:  # the manifest is read from byte 0
            with pytest.raises(ckptfmt.StorageError, match=r"asked for bytes \d+-\d+, got HTTP 200") as info:
                ckpt.read_tensor("weights", "layer2.w", verify=False)
            assert info.value.path == path
            store = ckpt.store
            assert store.read(path) == whole
            head = bytearray(8)
            store.read_into(path, 0, memoryview(head))
            assert bytes(head) == whole[:8]
            for requests in ([(100, bytearray(16))], [(100, bytearray(16)), (108, bytearray(16))]):  # overlapping
                with pytest.raises(ckptfmt.StorageError, match=re.escape(f"{path} not honoured")):
                    store.read_ranges(path, [(begin, memoryview(out)) for begin, out in requests])
        assert proxy.edited > 0
    with ckptfmt.open(url, storage_options=moto_server.storage_options()) as ckpt:
        assert np.array_equal(ckpt.read_tensor("weights", "layer2.w"), tensors["layer2.w"])


def test_a_range_answered_with_other_bytes_is_refused(moto_server: MotoServer, bucket: str) -> None:
    """A 206 whose Content-Range is not the range asked for (its bytes used to land as the asked ones)."""
    moto_server.client().put_object(Bucket=bucket, Key="ck/blob", Body=bytes(range(256)) * 4)
    with CountingProxy(moto_server.port, shift_range=4).running() as proxy:
        store = open_store(f"s3://{bucket}/ck", moto_server.storage_options(proxy.endpoint))
        out = bytearray(64)
        with pytest.raises(ckptfmt.StorageError, match=r"asked for bytes 200-263, got Content-Range 'bytes 204-267/"):
            store.read_into("blob", 200, memoryview(out))
        with pytest.raises(ckptfmt.StorageError, match=r"asked for bytes 0-\d+, got Content-Range 'bytes 4-1023/1024'"):
            store.read("blob")
        assert proxy.edited == 2


def test_a_store_that_ignores_if_none_match_is_refused(moto_server: MotoServer, bucket: str) -> None:
    """Create-only PUTs that overwrite: two writers would both take the lock and both commit, one save lost.
    The store is probed before its first lock or manifest, refused, and the probe deleted."""
    url = f"s3://{bucket}/ck"
    with CountingProxy(moto_server.port, drop_headers=frozenset({"if-none-match"})).running() as proxy:
        options = moto_server.storage_options(proxy.endpoint)
        with pytest.raises(ckptfmt.StorageError, match="does not honour conditional writes") as info:
            ckptfmt.open_writer(url, storage_options=options)
            ckptfmt.open_writer(url, storage_options=options)  # before the probe: a second "lock holder"
        assert info.value.path == ".writer-lock"
        assert proxy.edited >= 2
    assert moto_server.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_the_create_only_probe_runs_once_per_store_and_leaves_nothing(moto_server: MotoServer, bucket: str) -> None:
    with CountingProxy(moto_server.port, log_requests=True).running() as proxy:
        store = open_store(f"s3://{bucket}/ck", moto_server.storage_options(proxy.endpoint))
        store.put_exclusive("a", b"a")
        probe, put, delete, first = proxy.request_log
        assert re.fullmatch(rf"PUT /{bucket}/ck/\.manifest\.json\.tmp-[0-9a-f]{{12}}", probe)
        assert put == probe and delete == "DELETE" + probe[3:]  # the second create-only PUT was refused (412)
        assert first == f"PUT /{bucket}/ck/a"
        proxy.reset()
        store.put_exclusive("b", b"b")
        with pytest.raises(FileExistsError):
            store.put_exclusive("b", b"c")
        assert proxy.request_log == [f"PUT /{bucket}/ck/b"] * 2
    keys = [o["Key"] for o in moto_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["ck/a", "ck/b"]
