"""The commit procedure as a sequence of system calls: what no conformance vector can see (spec/commit.md).

A black-box check of a writer's output cannot tell when a file was fsynced, under which name it
was written or whether it was read back. These tests record the reference writer's calls to
``os.open``, ``os.fsync``, ``os.rename``, ``os.link`` and ``os.unlink`` on a local disk and check
their order. conformance/coverage.json cites them for COM-3, COM-4, COM-5, COM-7, COM-8, COM-9,
COM-10 and COM-11.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt.errors import StorageError

PROVENANCE = {"writer": {"name": "tests", "version": "1"}, "created_at": "2025-01-01T00:00:00Z", "host": "h"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


@dataclass(frozen=True)
class Call:
    op: str  # open, fsync, rename, link, unlink
    path: str
    target: str = ""
    flags: int = 0


class Trace:
    """Records file-system calls (by absolute path) while installed; thread-safe."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_fsync: str | None = None) -> None:
        self.calls: list[Call] = []
        self._fds: dict[int, str] = {}
        self._lock = threading.Lock()
        self.fail_fsync = fail_fsync  # a regex: fsync of a matching path raises EIO
        real_open, real_fsync, real_rename, real_link, real_unlink = os.open, os.fsync, os.rename, os.link, os.unlink

        def rec(call: Call) -> None:
            with self._lock:
                self.calls.append(call)

        def full(path: object, dir_fd: object = None) -> str:
            # LocalStore works through directory fds (dir_fd=): name the file by its absolute path.
            name = str(os.fspath(path))  # type: ignore[call-overload]
            return name if dir_fd is None else os.path.join(self._fds.get(dir_fd, "<dir_fd>"), name)  # type: ignore[call-overload]

        def open_(path: object, flags: int, *args: object, **kwargs: object) -> int:
            fd = real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
            name = full(path, kwargs.get("dir_fd"))
            self._fds[fd] = name
            rec(Call("open", name, flags=flags))
            return fd

        def fsync(fd: int) -> None:
            path = self._fds.get(fd, "?")
            rec(Call("fsync", path))
            if self.fail_fsync and re.search(self.fail_fsync, path):
                raise OSError(errno.EIO, "injected fsync failure")
            real_fsync(fd)

        def rename(src: object, dst: object, **kwargs: object) -> None:
            rec(Call("rename", full(src, kwargs.get("src_dir_fd")), full(dst, kwargs.get("dst_dir_fd"))))
            real_rename(src, dst, **kwargs)  # type: ignore[arg-type]

        def link(src: object, dst: object, **kwargs: object) -> None:
            rec(Call("link", full(src, kwargs.get("src_dir_fd")), full(dst, kwargs.get("dst_dir_fd"))))
            real_link(src, dst, **kwargs)  # type: ignore[arg-type]

        def unlink(path: object, *args: object, **kwargs: object) -> None:
            rec(Call("unlink", full(path, kwargs.get("dir_fd"))))
            real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

        for name, fn in (("open", open_), ("fsync", fsync), ("rename", rename), ("link", link), ("unlink", unlink)):
            monkeypatch.setattr(os, name, fn)

    def index(self, op: str, path: str, *, target: str | None = None) -> int:
        for i, call in enumerate(self.calls):
            if call.op == op and call.path == path and (target is None or call.target == target):
                return i
        raise AssertionError(f"no {op} of {path}")

    def last(self, op: str, path: str) -> int:
        return max(i for i, c in enumerate(self.calls) if c.op == op and c.path == path)


def save(root: Path, *, overwrite: bool = False, seed: int = 0) -> ckptfmt.Manifest:
    with ckptfmt.open_writer(root, profile="weights", target_file_size=64, overwrite=overwrite) as w:
        w.write_tensors("weights", {f"w{i}": np.full((4, 4), seed + i, np.float32) for i in range(3)})
        w.write_tensors(f"extra{seed}", {"t": np.zeros(2, np.int8)})
        w.write_context("provenance", PROVENANCE)
    return ckptfmt.open(root).manifest


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "ckpt"


def finals(root: Path, manifest: ckptfmt.Manifest) -> list[str]:
    return [str(root.joinpath(*f.path.split("/"))) for f in manifest.files]


def test_files_are_written_under_a_temporary_name_synced_and_renamed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COM-4: `.<name>.tmp-<nonce>` in the final directory, fsync, then rename to the final name."""
    trace = Trace(monkeypatch)
    manifest = save(root)
    for final in finals(root, manifest):
        rename = next(c for c in trace.calls if c.op == "rename" and c.target == final)
        directory, name = os.path.split(final)
        assert os.path.dirname(rename.path) == directory
        assert re.fullmatch(rf"\.{re.escape(name)}\.tmp-[0-9a-f]+", os.path.basename(rename.path))
        created = trace.index("open", rename.path)
        assert trace.calls[created].flags & os.O_CREAT and trace.calls[created].flags & os.O_EXCL
        assert created < trace.index("fsync", rename.path) < trace.index("rename", rename.path, target=final)


@pytest.mark.parametrize("overwrite", [False, True])
def test_no_final_name_is_ever_opened_for_writing(root: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool) -> None:
    """COM-5: final names (data files, blobs, the manifest) appear only through rename and link."""
    if overwrite:
        save(root)
    trace = Trace(monkeypatch)
    manifest = save(root, overwrite=overwrite)
    names = set(finals(root, manifest)) | {str(root / "manifest.json")}
    assert not [c for c in trace.calls if c.op == "open" and c.path in names and c.flags & WRITE_FLAGS]


def test_the_writer_never_reads_back_what_it_wrote(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """COM-7: digests are computed in the writing pass: no written file or temp file is opened for reading."""
    trace = Trace(monkeypatch)
    manifest = save(root)
    written = set(finals(root, manifest)) | {c.path for c in trace.calls if c.op == "rename"}
    reads = [c for c in trace.calls if c.op == "open" and c.path in written and not c.flags & (os.O_WRONLY | os.O_RDWR)]
    assert reads == []
    assert ckptfmt.verify(root).ok  # and the digests so computed are right


def test_directories_are_synced_after_the_renames_and_before_the_manifest(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COM-8 and COM-10: every directory holding a new file (and the root, for new subdirectories) is fsynced
    after the last rename of a listed file; the manifest is started only after both."""
    trace = Trace(monkeypatch)
    manifest = save(root)
    last_rename = max(
        trace.index("rename", c.path, target=c.target)
        for c in trace.calls
        if c.op == "rename" and c.target in finals(root, manifest)
    )
    manifest_tmp = next(
        i
        for i, c in enumerate(trace.calls)
        if c.op == "open" and os.path.basename(c.path).startswith(".manifest.json.tmp-")
    )
    for directory in {os.path.dirname(f) for f in finals(root, manifest)} | {str(root)}:
        synced = [i for i, c in enumerate(trace.calls) if c.op == "fsync" and c.path == directory]
        assert any(last_rename < i < manifest_tmp for i in synced), directory
    assert last_rename < manifest_tmp


@pytest.mark.parametrize("target", [r"\.r00000-00001\.safetensors\.tmp-", r"/weights$"])
def test_a_failed_fsync_aborts_the_save_without_retrying(
    root: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """COM-9: a failing fsync (of a data file, or of its directory) aborts; it is not called again."""
    trace = Trace(monkeypatch, fail_fsync=target)
    with pytest.raises(StorageError):
        save(root)
    failing = [c for c in trace.calls if c.op == "fsync" and re.search(target, c.path)]
    assert len(failing) == 1
    assert not (root / "manifest.json").exists()
    assert [p for p in root.rglob("*") if p.is_file()] == []


def test_the_manifest_is_linked_create_only_then_the_root_is_synced(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COM-11: temp file in the root, fsync, link to manifest.json, unlink the temp, fsync the root."""
    trace = Trace(monkeypatch)
    save(root)
    final = str(root / "manifest.json")
    link = next(i for i, c in enumerate(trace.calls) if c.op == "link" and c.target == final)
    tmp = trace.calls[link].path
    assert os.path.dirname(tmp) == str(root) and os.path.basename(tmp).startswith(".manifest.json.tmp-")
    assert trace.index("open", tmp) < trace.index("fsync", tmp) < link < trace.last("unlink", tmp)
    assert any(c.op == "fsync" and c.path == str(root) for c in trace.calls[link:])
    assert not [c for c in trace.calls if c.op == "rename" and c.target == final]  # rename would replace


def test_a_manifest_that_appears_meanwhile_is_not_replaced(root: Path) -> None:
    """COM-11 (create-only): a manifest committed by someone else before ours wins, and stays intact."""
    w = ckptfmt.open_writer(root, profile="weights")
    w.write_tensors("weights", {"w": np.zeros(2, np.float32)})
    w.write_context("provenance", PROVENANCE)
    (root / "manifest.json").write_bytes(b"theirs")
    with pytest.raises(ckptfmt.CheckpointExistsError):
        w.commit()
    assert (root / "manifest.json").read_bytes() == b"theirs"


def test_replace_deletes_the_old_manifest_before_writing_anything(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """COM-3: on replace, the old manifest is unlinked right after the lock, before any other file is created."""
    old = save(root)
    trace = Trace(monkeypatch)
    save(root, overwrite=True, seed=1)
    unlinked = trace.index("unlink", str(root / "manifest.json"))
    creates = [i for i, c in enumerate(trace.calls) if c.op == "open" and c.flags & os.O_CREAT]
    lock_tmp = [i for i in creates if ".writer-lock.tmp-" in trace.calls[i].path]
    assert all(i < unlinked for i in lock_tmp)
    assert all(i > unlinked for i in creates if i not in lock_tmp)
    assert {f.path for f in old.files} - {f.path for f in ckptfmt.open(root).manifest.files}  # extra0 went away
