"""Filesystem hostility: symlinks, special files and sparse files wherever ckptfmt expects a file or directory.

Every test builds a sentinel tree *outside* the checkpoint root / destination / run directory /
converter source and checks, by hashing it before and after, that nothing there was read through a
symlink (its marker never shows up), written, or deleted. Hangs (a FIFO opened for reading) are
caught by running the operation in a thread with a generous deadline: a hang fails the test, no
timing is asserted.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import run_cli

import ckptfmt
from ckptfmt.errors import SizeMismatchError, UnsafePathError
from ckptfmt.storage import LocalStore

T = TypeVar("T")
MARKER = b"SENTINEL-7f3a"  # appears in every sentinel file: output showing it was read through a symlink
GiB = 1 << 30


# ---------------------------------------------------------------- the sentinel tree


def snapshot(top: Path) -> dict[str, str]:
    """Every entry below ``top`` (symlinks not followed): kind, and a hash of each regular file."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            rel = str(path.relative_to(top))
            if stat.S_ISREG(st.st_mode):
                out[rel] = "file " + hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = "link " + os.readlink(path)
            else:
                out[rel] = f"mode {stat.S_IFMT(st.st_mode):o}"
    return out


class Sentinel:
    """A tree outside the place under test: files holding MARKER, a directory, a FIFO, a valid checkpoint."""

    def __init__(self, top: Path) -> None:
        self.top = top
        (top / "dir").mkdir(parents=True)
        (top / "secret.txt").write_bytes(MARKER + b" do not read, write or delete\n")
        (top / "dir" / "inner.bin").write_bytes(MARKER * 4)
        os.mkfifo(top / "pipe")
        self.ckpt = top / "ckpt"  # a committed checkpoint whose contents would show up if followed
        with ckptfmt.open_writer(self.ckpt, profile="weights") as w:
            w.write_tensors("weights", {"outside": np.frombuffer(MARKER.ljust(16, b"!"), np.uint8).copy()})
            w.write_context("provenance", {"step": 7})
        self.before = snapshot(top)

    def assert_untouched(self) -> None:
        assert snapshot(self.top) == self.before


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Sentinel]:
    sentinel = Sentinel(tmp_path / "outside")
    yield sentinel
    sentinel.assert_untouched()


def no_hang(func: Callable[[], T], deadline: float = 60.0) -> T:
    """``func()``'s result (or exception), failing the test if it is still blocked after ``deadline`` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = func()
        except BaseException as exc:  # re-raised in the caller thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(deadline)
    assert not thread.is_alive(), "blocked: a special file was opened as if it were a regular file"
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def small_checkpoint(root: Path, **kw: Any) -> None:
    with ckptfmt.open_writer(root, profile="weights", **kw) as w:
        w.write_tensors("weights", {"w": np.arange(8, dtype=np.float32)})
        w.write_context("provenance", {"step": 1})


def assert_clean_failure(result: Any, *, codes: tuple[int, ...] = (1,)) -> None:
    assert result.exit_code in codes, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    assert MARKER.decode() not in result.stdout + result.stderr


def make_special(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":  # a /dev/zero node (major 1, minor 5): endless zeros if ever opened
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "devzero_link":
        path.symlink_to("/dev/zero")
    else:
        raise AssertionError(kind)


SPECIALS = ["fifo", "chardev", "socket", "devzero_link"]


# ---------------------------------------------------------------- 1. writes through symlinks


def test_writer_refuses_a_symlinked_field_directory(tmp_path: Path, outside: Sentinel) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "weights").symlink_to(outside.top / "dir")
    with pytest.raises(UnsafePathError, match="weights"):
        small_checkpoint(dst)
    assert set(snapshot(dst)) <= {"weights", "provenance"}  # no manifest, no lock, no file left behind


def test_writer_refuses_a_field_directory_that_is_a_file(tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "weights").write_bytes(b"user data")
    with pytest.raises(UnsafePathError, match="weights"):
        small_checkpoint(dst)
    assert (dst / "weights").read_bytes() == b"user data"


def test_a_symlinked_lock_or_manifest_name_is_never_written_through(tmp_path: Path, outside: Sentinel) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / ".writer-lock").symlink_to(outside.top / "secret.txt")
    with pytest.raises(ckptfmt.CheckpointLockedError):  # the name is taken; its "holder" cannot be read
        small_checkpoint(dst)
    (dst / ".writer-lock").unlink()
    (dst / "manifest.json").symlink_to(outside.ckpt / "manifest.json")
    small_checkpoint(dst, overwrite=True)  # the old "manifest" is unlinked (the link itself), then replaced
    assert not (dst / "manifest.json").is_symlink()
    assert ckptfmt.verify(dst).ok


def test_convert_refuses_a_symlinked_destination_directory(tmp_path: Path, outside: Sentinel) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "weights").symlink_to(outside.top / "dir")
    result = run_cli("convert", str(outside.ckpt), str(dst), "--to", "ckptfmt")
    assert_clean_failure(result)
    assert "symlink" in result.stderr


def test_store_mutations_refuse_symlinked_components(tmp_path: Path, outside: Sentinel) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").symlink_to(outside.top / "dir")
    store = LocalStore(root)
    for call in (
        lambda: store.create("a/new.bin"),
        lambda: store.put_exclusive("a/new.bin", b"x"),
        lambda: store.delete("a/inner.bin"),
        lambda: store.sync_dirs(["a/inner.bin"]),
        lambda: store.exists("a/inner.bin"),
        lambda: store.read("a/inner.bin"),
        lambda: store.size("a/inner.bin"),
    ):
        with pytest.raises(UnsafePathError, match="'a' is a symlink"):
            call()
    store.remove_empty_dirs("a")  # not a directory of the root: left alone
    store.remove_empty_dirs()
    assert store.list() == {"a": len(str(outside.top / "dir"))}  # reported, not descended into
    store.delete("a")  # removes the link itself, never what it points to
    assert not (root / "a").exists()


@pytest.mark.parametrize("path", ["../escape", "/abs", "a//b", "a/./b", "a/../b"])
def test_store_refuses_paths_that_are_not_plain(tmp_path: Path, path: str) -> None:
    store = LocalStore(tmp_path / "root")
    with pytest.raises(UnsafePathError):
        store.create(path)
    with pytest.raises(UnsafePathError):
        store.read(path)


def test_the_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    """The caller's own path may go through a symlink; only what lies below the root is never followed."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    small_checkpoint(tmp_path / "alias")
    assert ckptfmt.verify(real).ok


# ---------------------------------------------------------------- 4. special files hang no reader


@pytest.mark.parametrize("kind", SPECIALS)
@pytest.mark.parametrize("name", ["manifest.json", "weights/r00000-00000.safetensors", "provenance/context.msgpack"])
def test_special_files_in_a_checkpoint_are_refused(tmp_path: Path, kind: str, name: str) -> None:
    root = tmp_path / "ckpt"
    small_checkpoint(root)
    (root / name).unlink()
    make_special(root / name, kind)

    def read_everything() -> None:
        with ckptfmt.open(root) as ckpt:
            ckpt.read_tensor("weights", "w")
            ckpt.read_context("provenance")

    with pytest.raises(UnsafePathError, match="symlink" if kind == "devzero_link" else "not a regular file"):
        no_hang(read_everything)
    assert_clean_failure(no_hang(lambda: run_cli("verify", str(root))))
    # inspect reads no data file: it may succeed, but must neither hang nor crash
    assert_clean_failure(no_hang(lambda: run_cli("inspect", str(root))), codes=(0, 1) if "weights" in name else (1,))


@pytest.mark.parametrize("kind", SPECIALS)
def test_special_file_as_the_writer_lock(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    make_special(root / ".writer-lock", kind)
    with pytest.raises(ckptfmt.CheckpointLockedError, match="holder unknown"):
        no_hang(lambda: small_checkpoint(root))
    result = no_hang(lambda: run_cli("inspect", str(root), "--json"))
    assert_clean_failure(result)


# ---------------------------------------------------------------- 5. sparse files


def sparse(path: Path, size: int, head: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def test_store_read_is_bounded(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    sparse(tmp_path / "big.json", 4 * GiB, b"{")
    with pytest.raises(SizeMismatchError, match=r"big\.json"):
        store.read("big.json")  # the default bound
    (tmp_path / "small").write_bytes(b"12345")
    with pytest.raises(SizeMismatchError):
        store.read("small", max_size=4)
    assert store.read("small", max_size=5) == b"12345"


def test_a_sparse_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    small_checkpoint(root)
    sparse(root / "manifest.json", 8 * GiB, b'{"format_version": "1.0"')
    with pytest.raises(SizeMismatchError, match=r"manifest\.json"):
        ckptfmt.open(root)
    assert_clean_failure(run_cli("inspect", str(root)))
