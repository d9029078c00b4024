"""S3 end to end, against moto's real S3 HTTP server on 127.0.0.1 (no patched client)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from s3_server import CountingProxy, MotoServer

import ckptfmt
from ckptfmt.storage import open_store, s3

MiB = 1 << 20


@pytest.fixture
def moto(moto_server: MotoServer) -> MotoServer:
    """The session's server (conftest.py)."""
    return moto_server


@pytest.fixture
def bucket(moto: MotoServer) -> str:
    return moto.create_bucket()


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 MiB multipart parts (S3's minimum), so tests see real multipart uploads with little data."""
    monkeypatch.setattr(s3, "PART_SIZE", 5 * MiB)


def fast_fail(options: dict[str, Any]) -> dict[str, Any]:
    """Few retries, so tests of an unreachable endpoint finish quickly."""
    config = {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 20}
    return {**options, "config_kwargs": config}


def write_training(url: str, options: dict[str, Any], tensors: dict[str, np.ndarray[Any, Any]], **kw: Any) -> str:
    with ckptfmt.open_writer(url, storage_options=options, **kw) as w:
        for name, array in tensors.items():
            w.write_tensor("weights", name, array)
        w.write_tensors("optimizer", {"step": np.array(3, np.int64)})
        w.write_context("rng", {"generators": {}})
        w.write_context("data", {"epoch": 0, "global_sample_offset": 96})
        w.write_config({"lr": 0.001})
        w.write_context("topology", {"world_size": 1})
        w.write_context("provenance", {"step": 3})
    assert w.checkpoint_id is not None
    return w.checkpoint_id


def model(seed: int = 0, big_mib: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    out = {f"layer{i}.w": rng.standard_normal((64, 64), dtype=np.float32) for i in range(4)}
    if big_mib:
        out["big"] = rng.standard_normal(big_mib * MiB // 4, dtype=np.float32)
    return out


def test_write_open_read_verify_on_s3(moto: MotoServer, bucket: str, small_parts: None) -> None:
    url = f"s3://{bucket}/run/step-3"
    tensors = model(big_mib=12)  # > 2 parts: a real multipart upload
    ckpt_id = write_training(url, moto.storage_options(), tensors, target_file_size=4 * MiB)
    with ckptfmt.open(url, storage_options=moto.storage_options()) as ckpt:
        assert ckpt.id == ckpt_id
        for name, array in tensors.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), array)
        assert ckpt.read_context("data")["global_sample_offset"] == 96
        report = ckpt.verify()
        assert report.ok, report.problems
        assert report.files_checked == len(ckpt.manifest.files)


def test_exception_in_block_leaves_no_object_and_no_upload(moto: MotoServer, bucket: str, small_parts: None) -> None:
    url = f"s3://{bucket}/ck"
    with (
        pytest.raises(RuntimeError, match="trainer blew up"),
        ckptfmt.open_writer(url, storage_options=moto.storage_options(), target_file_size=1 * MiB) as w,
    ):
        w.write_tensor("weights", "a", np.ones(3 * MiB // 4, np.float32))
        w.write_tensor("weights", "b", np.ones(12 * MiB // 4, np.float32))  # flushes "a"
        w.flush()
        raise RuntimeError("trainer blew up")
    client = moto.client()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_aborted_output_file_publishes_nothing(moto: MotoServer, bucket: str, small_parts: None) -> None:
    """The s3fs trap: a plain `with fs.open(..., 'wb')` publishes a truncated object on error. Ours must not."""
    store = open_store(f"s3://{bucket}/x", moto.storage_options())
    out = store.create("weights/r00000-00000.safetensors")
    out.write(b"\0" * (11 * MiB))  # two parts already uploaded
    out.abort()
    del out
    client = moto.client()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_second_writer_is_refused(moto: MotoServer, bucket: str) -> None:
    url = f"s3://{bucket}/ck"
    first = ckptfmt.open_writer(url, storage_options=moto.storage_options())
    with pytest.raises(ckptfmt.CheckpointLockedError):
        ckptfmt.open_writer(url, storage_options=moto.storage_options())
    first.abort()


def test_manifest_is_create_only(moto: MotoServer, bucket: str) -> None:
    """Two racing commits: S3's If-None-Match makes exactly one win (COM-11; every store: test_storage.py)."""
    store = open_store(f"s3://{bucket}/ck", moto.storage_options())
    store.put_exclusive("manifest.json", b"{}")
    with pytest.raises(FileExistsError):
        store.put_exclusive("manifest.json", b"{ }")
    assert store.read("manifest.json") == b"{}"


def test_committed_checkpoint_is_not_overwritten(moto: MotoServer, bucket: str) -> None:
    url = f"s3://{bucket}/ck"
    write_training(url, moto.storage_options(), model(0))
    with pytest.raises(ckptfmt.CheckpointExistsError):
        write_training(url, moto.storage_options(), model(1))
    write_training(url, moto.storage_options(), model(1), overwrite=True)
    with ckptfmt.open(url, storage_options=moto.storage_options()) as ckpt:
        assert np.array_equal(ckpt.read_tensor("weights", "layer0.w"), model(1)["layer0.w"])
        assert ckpt.verify().ok


def test_single_tensor_read_moves_only_its_bytes(moto: MotoServer, bucket: str, small_parts: None) -> None:
    url = f"s3://{bucket}/ck"
    tensors = model(big_mib=32)
    write_training(url, moto.storage_options(), tensors)
    with CountingProxy(moto.port).running() as proxy:
        options = moto.storage_options(proxy.endpoint)
        proxy.reset()
        with ckptfmt.open(url, storage_options=options) as ckpt:
            manifest_size = ckpt.store.size("manifest.json")
            proxy.reset()
            got = ckpt.read_tensor("weights", "layer2.w")
            moved = proxy.received_from_server
            data_file = ckpt.tensor("weights", "layer2.w").chunks[0].path
            file_size = ckpt.store.size(data_file)
    assert np.array_equal(got, tensors["layer2.w"])
    tensor_bytes = tensors["layer2.w"].nbytes
    # the tensor's bytes plus HTTP headers: nowhere near the 32 MiB file it lives in
    assert tensor_bytes <= moved <= tensor_bytes + 16 * 1024, (moved, tensor_bytes)
    assert file_size > 32 * MiB
    assert manifest_size < 64 * 1024


def test_no_such_bucket_is_a_clear_error(moto: MotoServer) -> None:
    with pytest.raises(ckptfmt.StorageError, match="no-such-bucket"):
        ckptfmt.open_writer("s3://no-such-bucket/ck", storage_options=moto.storage_options())


def test_open_missing_prefix_is_not_found(moto: MotoServer, bucket: str) -> None:
    with pytest.raises(ckptfmt.CheckpointNotFoundError):
        ckptfmt.open(f"s3://{bucket}/nothing-here", storage_options=moto.storage_options())


def test_partition_mid_upload_then_retry_commits(moto: MotoServer, bucket: str, small_parts: None) -> None:
    url = f"s3://{bucket}/run/step-7"
    tensors = model(big_mib=16)
    with CountingProxy(moto.port).running() as proxy:
        options = fast_fail(moto.storage_options(proxy.endpoint))
        proxy.cut_after = 12 * MiB  # the network goes away in the middle of the multipart upload
        with pytest.raises(ckptfmt.StorageError):
            write_training(url, options, tensors, target_file_size=1 * MiB)
        proxy.heal()
        direct = moto.storage_options()
        with pytest.raises(ckptfmt.IncompleteCheckpointError):
            ckptfmt.open(url, storage_options=direct)
        # the same process retries once the network is back: it takes over its own abandoned lock
        ckpt_id = write_training(url, options, tensors, target_file_size=1 * MiB)
    with ckptfmt.open(url, storage_options=moto.storage_options()) as ckpt:
        assert ckpt.id == ckpt_id
        assert ckpt.verify().ok
        assert np.array_equal(ckpt.read_tensor("weights", "big"), tensors["big"])


def test_server_killed_mid_upload_then_restarted(small_parts: None) -> None:
    server = MotoServer()
    server.start()
    try:
        bucket = server.create_bucket()
        url = f"s3://{bucket}/ck"
        tensors = model(big_mib=24)
        options = fast_fail(server.storage_options())
        errors: list[BaseException] = []

        def run() -> None:
            try:
                write_training(url, options, tensors, target_file_size=1 * MiB)
            except BaseException as exc:
                errors.append(exc)

        with CountingProxy(server.port).running() as proxy:
            proxied = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy.endpoint}}
            killed = threading.Event()

            def watch() -> None:
                while proxy.sent_to_server < 8 * MiB:
                    threading.Event().wait(0.01)
                server.kill()
                killed.set()

            threading.Thread(target=watch, daemon=True).start()
            options = proxied
            writer = threading.Thread(target=run)
            writer.start()
            writer.join(timeout=120)
            assert killed.is_set()
        assert not writer.is_alive()
        assert errors and isinstance(errors[0], ckptfmt.StorageError), errors
        server.start()  # moto keeps no state across restarts: the bucket comes back empty
        bucket_again = server.create_bucket()
        url = f"s3://{bucket_again}/ck"
        ckpt_id = write_training(url, server.storage_options(), tensors, target_file_size=1 * MiB)
        with ckptfmt.open(url, storage_options=server.storage_options()) as ckpt:
            assert ckpt.id == ckpt_id and ckpt.verify().ok
    finally:
        server.kill()


def test_lost_create_race_is_read_from_the_status_code_not_the_message() -> None:
    """A 412 PreconditionFailed anywhere in the cause chain is a lost race; "412" in a message is not."""
    from botocore.exceptions import ClientError

    def client_error(code: str, status: int) -> ClientError:
        response: Any = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return ClientError(response, "PutObject")

    def wrapped(inner: BaseException) -> OSError:
        try:
            raise inner
        except BaseException as exc:
            try:
                raise OSError("upload failed") from exc
            except OSError as outer:
                return outer

    assert s3.lost_create_race(wrapped(client_error("PreconditionFailed", 412)))
    assert s3.lost_create_race(wrapped(client_error("SomethingElse", 412)))
    assert s3.lost_create_race(FileExistsError("exists"))
    assert not s3.lost_create_race(wrapped(client_error("SlowDown", 503)))
    assert not s3.lost_create_race(OSError("timeout after 412 ms to bucket-412"))


def test_read_is_bounded_on_object_stores(moto: MotoServer, bucket: str) -> None:
    from ckptfmt.errors import SizeMismatchError

    store = open_store(f"s3://{bucket}/bounded", moto.storage_options())
    store.put_exclusive("doc.json", b"x" * 100)
    store.put_exclusive("empty", b"")
    assert store.read("doc.json", max_size=100) == b"x" * 100
    assert store.read("empty", max_size=0) == b""
    with pytest.raises(SizeMismatchError, match="more than the 99"):
        store.read("doc.json", max_size=99)
