"""Local writes around the page cache (ckptfmt/storage/direct.py): exact bytes on every path, and fallbacks."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptfmt
from ckptfmt.errors import StorageError
from ckptfmt.storage import LocalStore, direct
from ckptfmt.writer import CheckpointWriter

BUF = direct.BUFFER_BYTES


def _pieces(seed: int = 0) -> list[bytes]:
    """An unaligned header, a piece spanning two staging buffers, small odd pieces, an unaligned tail."""
    rng = np.random.default_rng(seed)
    sizes = [117, 2 * BUF + 4093, 1, 5000, BUF - 7, 333]
    return [rng.bytes(n) for n in sizes]


def _write_and_check(root: Path, *, seed: int, direct_io: bool = True) -> None:
    out = LocalStore(root, direct_io=direct_io).create("d/f.bin")
    pieces = _pieces(seed)
    for piece in pieces:
        out.write(memoryview(piece))
    out.commit()
    assert (root / "d" / "f.bin").read_bytes() == b"".join(pieces)
    assert [p.name for p in (root / "d").iterdir()] == ["f.bin"]  # no temp file left


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT)


@pytest.mark.parametrize("direct_io", [True, False])
def test_written_file_is_exact(tmp_path: Path, direct_io: bool) -> None:
    _write_and_check(tmp_path, seed=0, direct_io=direct_io)


@pytest.mark.skipif(not direct.O_DIRECT, reason="O_DIRECT is Linux-only")
def test_large_writes_go_around_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole buffers are written with O_DIRECT on, the unaligned tail with it off; small files never turn it on."""
    seen: list[tuple[int, bool]] = []
    real_write = os.write

    def spy(fd: int, data: Any) -> int:
        seen.append((len(data), _is_direct(fd)))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    store = LocalStore(tmp_path)
    out = store.create("big.bin")
    out.write(b"x" * (BUF + 10))
    out.commit()
    small = store.create("small.bin")
    small.write(b"y" * 100)
    small.commit()
    if not any(on for _, on in seen):
        pytest.skip("this filesystem refuses O_DIRECT (the fallback is tested below)")
    assert seen == [(BUF, True), (10, False), (100, False)]
    assert (tmp_path / "big.bin").read_bytes() == b"x" * (BUF + 10)


@pytest.mark.skipif(not direct.O_DIRECT, reason="O_DIRECT is Linux-only")
def test_filesystem_refusing_direct_writes_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that takes the flag but fails the write with EINVAL: the bytes go through the page cache."""
    real_write = os.write
    refused = []

    def refusing(fd: int, data: Any) -> int:
        if _is_direct(fd):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing)
    _write_and_check(tmp_path, seed=1)
    assert len(refused) <= 1  # refused once, then never asked again


@pytest.mark.skipif(not direct.O_DIRECT, reason="O_DIRECT is Linux-only")
def test_filesystem_refusing_the_flag_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fcntl = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    _write_and_check(tmp_path, seed=2)


def test_write_error_aborts_and_returns_the_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC in the middle: a StorageError naming the file, no temp file left, the staging buffer reused."""
    real_write = os.write
    calls = {"n": 0}

    def failing(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", failing)
    out = LocalStore(tmp_path).create("w/f.bin")
    with pytest.raises(StorageError, match=r"w/f\.bin"):
        for _ in range(3):
            out.write(b"z" * BUF)
    assert list((tmp_path / "w").iterdir()) == []
    assert len(direct._POOL._idle) <= direct.POOL_IDLE


def test_pool_keeps_a_bounded_number_of_idle_buffers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    outs = [store.create(f"f{i}") for i in range(direct.POOL_IDLE + 3)]
    for out in outs:
        out.write(b"a")  # each takes a buffer
    for out in outs:
        out.abort()
    assert len(direct._POOL._idle) == direct.POOL_IDLE


@pytest.mark.parametrize("direct_io", [True, False])
def test_checkpoint_round_trip_either_way(tmp_path: Path, direct_io: bool) -> None:
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal((1500, 1500)).astype(np.float32), "b": np.arange(7, dtype=np.int64)}
    with CheckpointWriter(LocalStore(tmp_path / "c", direct_io=direct_io), profile="weights") as w:
        w.write_tensors("weights", tensors)
    with ckptfmt.open(str(tmp_path / "c")) as ckpt:
        assert ckpt.verify().ok
        got = ckpt.read_tensors("weights")
    assert all(np.array_equal(got[n], t) for n, t in tensors.items())


def _in_child(work: Any, *, timeout_s: float = 60.0) -> int:
    """Run ``work`` in a forked child; its exit status (SIGKILLed, and 99 returned, if it outlives ``timeout_s``)."""
    import signal
    import time

    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            work()
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return 99


def test_a_forked_child_does_not_share_the_parents_staging_buffers(tmp_path: Path) -> None:
    """The idle buffers a process keeps are its own after a fork: a child (a multi-rank test's ranks, a
    ``multiprocessing`` save) staging its bytes must not write into the buffer its parent stages into."""
    _write_and_check(tmp_path / "warm", seed=1)  # the pool now keeps idle buffers
    staged, go_on = os.pipe(), os.pipe()

    def child() -> None:
        out = LocalStore(tmp_path).create("child.bin")
        out.write(b"C" * 100)  # staged in a buffer taken from the pool inherited from the parent
        os.write(staged[1], b"1")
        os.read(go_on[0], 1)  # the parent has staged and written its own file meanwhile
        out.commit()

    pid_status: list[int] = []
    import threading

    thread = threading.Thread(target=lambda: pid_status.append(_in_child(child)))
    thread.start()
    os.read(staged[0], 1)
    out = LocalStore(tmp_path).create("parent.bin")
    out.write(b"P" * 100)
    out.commit()
    os.write(go_on[1], b"1")
    thread.join()
    assert pid_status == [0]
    assert (tmp_path / "parent.bin").read_bytes() == b"P" * 100
    assert (tmp_path / "child.bin").read_bytes() == b"C" * 100


def test_a_forked_child_writes_a_large_file_after_its_parent_did(tmp_path: Path) -> None:
    """The shared writer threads do not survive a fork: a child must get its own, not wait forever on the
    parent's (whose idle slot it inherited)."""
    _write_and_check(tmp_path / "parent", seed=2)  # the parent's writer threads ran and are idle
    status = _in_child(lambda: _write_and_check(tmp_path / "child", seed=3), timeout_s=30.0)
    assert status == 0, "the child hung (99) or failed"
