"""Shared fixtures: the storage backends every store test runs against, and checkpoint builders.

Backends are a list of factories; a factory is a context manager that takes a fresh temporary
directory and the requesting test's ``FixtureRequest`` (to reach a server fixture, say) and yields
the URL of an empty checkpoint root, removing it afterwards. To run every ``store_url`` test
against another backend, append a ``Backend`` to ``BACKENDS``.

The ``s3`` backend is moto's real S3 server in a subprocess (one per session, started on first use)
with a fresh bucket per test. It is reached the way a user reaches S3 with no storage options: the
``AWS_ENDPOINT_URL`` and credential environment variables, set for the session. Every store test
function runs on all three; on S3 only its first parameter set, unless ``CKPTFMT_TEST_S3=all`` (see
``pytest_collection_modifyitems``).

Helpers are fixtures (``write_training``, ``write_weights``, ``fill_writer``, ``raw``) because
pytest's importlib import mode does not put ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.digests import base_algorithm, digest_of, parse_digest
from ckptfmt.storage import Store
from ckptfmt.tree_digests import file_digest_of

# ---------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    name: str
    factory: Callable[[Path, pytest.FixtureRequest], contextlib.AbstractContextManager[str]]
    local: bool  # a POSIX file system (symlinks, fsync, hidden temp files)


@contextlib.contextmanager
def _local(tmp: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    yield str(tmp / "ckpt")


@contextlib.contextmanager
def _memory(tmp: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    import fsspec

    root = f"/ckptfmt-tests-{uuid.uuid4().hex}"
    yield f"memory://{root}/ckpt"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1, shared by the session; the AWS environment variables point at it."""
    from s3_server import CREDENTIALS, MotoServer

    server = MotoServer()
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        mp.setenv("AWS_ENDPOINT_URL", server.endpoint)
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        try:
            yield server
        finally:
            server.kill()


@contextlib.contextmanager
def _s3(tmp: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    server = request.getfixturevalue("moto_server")
    client = server.client()
    bucket = server.create_bucket()
    yield f"s3://{bucket}/ckpt"
    # moto keeps everything in memory for the whole session: drop this test's objects and parts
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    client.delete_bucket(Bucket=bucket)


BACKENDS: list[Backend] = [
    Backend("local", _local, local=True),
    Backend("memory", _memory, local=False),
    Backend("s3", _s3, local=False),
]


def _applies(item: pytest.Item) -> bool:
    """False for a contract test whose ``applies_when`` flags its class does not have (tests/test_storage.py)."""
    cls = getattr(item, "cls", None)
    return cls is None or all(
        getattr(cls, flag) == value for mark in item.iter_markers("applies_when") for flag, value in mark.kwargs.items()
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Contract tests that cannot apply to a backend are not collected for it; on S3, every store test function
    runs, but only its first parameter set (unless CKPTFMT_TEST_S3=all).

    The other parameter sets vary what is in the manifest or the arrays (28 unsafe paths, 25 memory
    layouts, ...), not the storage calls, which are the same few PUTs and ranged GETs each time; on S3
    each costs a bucket and several HTTP round trips: 316 tests in 50 s for all of them, 111 in 26 s for this.
    """
    keep, drop, seen = [], [], set()
    every_s3 = os.environ.get("CKPTFMT_TEST_S3") == "all"
    for item in items:
        if not _applies(item):
            drop.append(item)
            continue
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend") if callspec is not None else None
        if isinstance(backend, Backend) and backend.name == "s3" and not every_s3:
            function = (item.nodeid.partition("::")[0], getattr(item, "originalname", item.name))
            if function in seen:
                drop.append(item)
                continue
            seen.add(function)
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ---------------------------------------------------------------- no process outlives the session


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """End what this pytest process started for the whole session and left running: DataLoader workers, the warm
    servers (tests/warm_server.py), multiprocessing's fork server (tests/warm_ranks.py) and resource tracker.
    scripts/test.sh fails a run that leaves any process behind (issue 37: 13 were alive 17 minutes after one)."""
    gc.collect()  # a DataLoader iterator left in a cycle ends its workers when collected
    warm = sys.modules.get("warm_server")
    if warm is not None:
        warm.close_shared()
    stop_multiprocessing_helpers()


def stop_multiprocessing_helpers() -> None:
    """Stop multiprocessing's fork server and resource tracker, where this process started them.

    Each waits for end of file on a pipe whose write end every process it serves holds: this one, the fork
    server's forks and whatever they forked in turn. Left to themselves they exit with the last of those, so one
    forgotten grandchild keeps a fork server (torch imported) and the tracker alive. Closing this process's end is
    their cue, as Python 3.12's ``_stop`` does; unlike it, the wait here has a bound, then SIGKILL. The fork server
    is SIGKILLed at once: it holds nothing to clean up, and an interpreter that imported torch takes 2 s to exit.
    """
    module = sys.modules.get("multiprocessing.forkserver")
    server = getattr(module, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is not None:
        from multiprocessing import util

        with server._lock:
            os.close(server._forkserver_alive_fd)
            _end_child(server._forkserver_pid, grace_s=0.0)
            address = server._forkserver_address
            if address is not None and not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    module = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(module, "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_fd", None) is not None and tracker._pid is not None:
        with tracker._lock:
            os.close(tracker._fd)
            _end_child(tracker._pid)
            tracker._fd = tracker._pid = None


def _end_child(pid: int, grace_s: float = 30.0) -> None:
    """Reap ``pid``, a child of this process that was asked to exit; SIGKILL it if it still runs after ``grace_s``
    (a hang guard: a process of the run that still holds the pipe hides the cue)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped already
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


@pytest.fixture
def memory_url(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty checkpoint root on fsspec's memory filesystem."""
    with _memory(tmp_path, request) as url:
        yield url


@pytest.fixture
def s3_url(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty checkpoint root in a fresh bucket of the session's moto server."""
    with _s3(tmp_path, request) as url:
        yield url


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def store_url(backend: Backend, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of an empty checkpoint root, once per backend in BACKENDS."""
    with backend.factory(tmp_path, request) as url:
        yield url


@pytest.fixture
def new_url(backend: Backend, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[[], str]]:
    """Make more empty roots on the same backend as ``store_url`` (for tests that need two)."""
    with contextlib.ExitStack() as stack:
        counter = iter(range(1_000_000))

        def make() -> str:
            sub = tmp_path / f"extra{next(counter)}"
            sub.mkdir()
            return stack.enter_context(backend.factory(sub, request))

        yield make


@pytest.fixture
def local_url(tmp_path: Path) -> str:
    """A local checkpoint root, for tests of what only a POSIX file system has (symlinks, hidden temp files)."""
    return str(tmp_path / "ckpt")


# ---------------------------------------------------------------- checkpoint contents

FIXED_PROVENANCE: dict[str, object] = {
    "writer": {"name": "ckptfmt-tests", "version": "1"},
    "created_at": "2026-01-02T03:04:05Z",
    "host": "test-host",
    "step": 100,
}


def training_contents(seed: int = 0) -> dict[str, Any]:
    """A small but complete set of the seven training fields."""
    rng = np.random.default_rng(seed)
    return {
        "weights": {
            "layer0.w": rng.standard_normal((4, 3)).astype(np.float32),
            "layer0.b": rng.standard_normal(3).astype(np.float32),
        },
        "optimizer": {
            "layer0.w.exp_avg": rng.standard_normal((4, 3)).astype(np.float32),
            "step": np.array(7, dtype=np.int64),
        },
        "optimizer_context": {"param_groups": [{"lr": 0.001, "params": ["layer0.w", "layer0.b"]}]},
        "rng": {"generators": {"numpy": {"kind": "numpy.bit_generator", "state": np.random.PCG64(seed).state}}},
        "data": {"epoch": 1, "global_sample_offset": 4096, "shard_offsets": {"shard-0": 12}},
        "config": {"model": {"layers": 1, "hidden": 3}, "lr": 0.001, "seed": seed},
        "topology": {"world_size": 1, "rank": 0},
        "provenance": dict(FIXED_PROVENANCE),
    }


TRAINING_FIELDS = ("weights", "optimizer", "rng", "data", "config", "topology", "provenance")
WEIGHTS_FIELDS = ("weights", "provenance")


def write_training_into(w: ckptfmt.CheckpointWriter, *, omit: tuple[str, ...] = (), seed: int = 0) -> None:
    """Write the seven training fields (minus ``omit``) into an open writer, without committing."""
    c = training_contents(seed)
    if "weights" not in omit:
        w.write_tensors("weights", c["weights"])
    if "optimizer" not in omit:
        w.write_tensors("optimizer", c["optimizer"])
        w.write_context("optimizer", c["optimizer_context"])
    for name in ("rng", "data", "topology", "provenance"):
        if name not in omit:
            w.write_context(name, c[name])
    if "config" not in omit:
        w.write_config(c["config"])


def fill_writer_into(
    w: ckptfmt.CheckpointWriter, *, profile: str = "training", omit: tuple[str, ...] = (), seed: int = 0
) -> None:
    """Write every field ``profile`` requires (minus ``omit``) into an open writer, without committing."""
    if profile == "training":
        write_training_into(w, omit=omit, seed=seed)
        return
    c = training_contents(seed)
    if "weights" not in omit:
        w.write_tensors("weights", c["weights"])
    if "provenance" not in omit:
        w.write_context("provenance", c["provenance"])


@pytest.fixture
def fill_writer() -> Callable[..., None]:
    """``fill_writer(w, profile="training", omit=(), seed=0)``: the profile's fields into an open writer."""
    return fill_writer_into


def _write_training(url: str, *, omit: tuple[str, ...] = (), seed: int = 0, **options: Any) -> str:
    with ckptfmt.open_writer(url, profile="training", **options) as w:
        write_training_into(w, omit=omit, seed=seed)
    assert w.checkpoint_id is not None
    return w.checkpoint_id


def _write_weights(
    url: str, tensors: Mapping[str, object] | None = None, *, field: str = "weights", **options: Any
) -> str:
    if tensors is None:
        tensors = training_contents()["weights"]
    with ckptfmt.open_writer(url, profile="weights", **options) as w:
        if field != "weights":
            w.write_tensors("weights", {})
        w.write_tensors(field, tensors)
        w.write_context("provenance", FIXED_PROVENANCE)
    assert w.checkpoint_id is not None
    return w.checkpoint_id


@pytest.fixture
def write_training() -> Callable[..., str]:
    """``write_training(url, omit=(), seed=0, **open_writer_options)`` -> checkpoint id."""
    return _write_training


@pytest.fixture
def write_weights() -> Callable[..., str]:
    """``write_weights(url, tensors=None, field="weights", **open_writer_options)`` -> checkpoint id."""
    return _write_weights


# ---------------------------------------------------------------- raw access, for tampering


def raw_files(url: str) -> dict[str, bytes]:
    """Every file under the root (hidden ones included) and its bytes."""
    store = ckptfmt.open_store(url)
    return {path: store.read(path) for path in sorted(store.list())}


def put_raw(url: str, path: str, data: bytes) -> None:
    """Replace (or create) one file's bytes, leaving the manifest as it is."""
    out = ckptfmt.open_store(url).create(path)
    out.write(data)
    out.commit()


def delete_raw(url: str, path: str) -> None:
    ckptfmt.open_store(url).delete(path)


def read_manifest_doc(url: str) -> dict[str, Any]:
    return json.loads(ckptfmt.open_store(url).read("manifest.json"))  # type: ignore[no-any-return]


def write_manifest_doc(url: str, doc: object, *, canonical: bool = True) -> None:
    """Replace manifest.json with ``doc`` (a dict, or already-encoded bytes)."""
    if isinstance(doc, bytes):
        data = doc
    elif canonical:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    else:
        data = json.dumps(doc, indent=2).encode()
    store: Store = ckptfmt.open_store(url)
    store.delete("manifest.json")
    store.put_exclusive("manifest.json", data)


def edit_manifest_doc(url: str, edit: Callable[[dict[str, Any]], object]) -> None:
    """Apply ``edit`` (which mutates the parsed manifest in place) and store the result."""
    doc = read_manifest_doc(url)
    edit(doc)
    write_manifest_doc(url, doc)


def forge_file(url: str, path: str, data: bytes) -> None:
    """Replace a file and update its size and digest in the manifest, as a writer with a bug would."""
    put_raw(url, path, data)

    def edit(doc: dict[str, Any]) -> None:
        for record in doc["files"]:
            if record["path"] == path:
                record["size"] = len(data)
                algorithm = record["digest"].partition(":")[0]
                record["digest"] = file_digest_of(algorithm, data)
                if not parse_digest(record["digest"]):  # bytes that are no data file have no tree digest
                    record["digest"] = digest_of(base_algorithm(algorithm), data)
                return
        raise AssertionError(f"{path} not in the manifest")

    edit_manifest_doc(url, edit)


def data_files(url: str, field: str) -> list[str]:
    """The data files of one field, from the manifest."""
    ckpt = ckptfmt.open(url)
    return sorted({c.path for t in ckpt.fields[field].tensors.values() for c in t.chunks})


@dataclass(frozen=True)
class Raw:
    """The raw-access helpers, as one fixture."""

    files = staticmethod(raw_files)
    put = staticmethod(put_raw)
    delete = staticmethod(delete_raw)
    manifest = staticmethod(read_manifest_doc)
    write_manifest = staticmethod(write_manifest_doc)
    edit_manifest = staticmethod(edit_manifest_doc)
    forge = staticmethod(forge_file)
    data_files = staticmethod(data_files)


@pytest.fixture
def raw() -> Raw:
    return Raw()


def bits(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The array's little-endian C-order bytes (so NaNs and -0.0 compare by bit pattern)."""
    a = array.astype(array.dtype.newbyteorder("<"), copy=False) if array.dtype.byteorder == ">" else array
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8)


def assert_same_bits(actual: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype.newbyteorder("<") or actual.dtype == expected.dtype
    assert np.array_equal(bits(actual), bits(expected))


@pytest.fixture
def same_bits() -> Callable[[np.ndarray[Any, Any], np.ndarray[Any, Any]], None]:
    return assert_same_bits
