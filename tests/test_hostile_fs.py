"""Filesystem hostility: symlinks, special files and sparse files wherever ckptfmt expects a file or directory.

Every test builds a sentinel tree *outside* the checkpoint root / destination / run directory /
converter source and checks, by hashing it before and after, that nothing there was read through a
symlink (its marker never shows up), written, or deleted. Hangs (a FIFO opened for reading) are
caught by running the operation in a thread with a generous deadline: a hang fails the test, no
timing is asserted.
"""

from __future__ import annotations

import hashlib
import json
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
from run_helpers import dead_pid, lock_of, write_step

import ckptfmt
from ckptfmt.convert.hf import import_hf
from ckptfmt.errors import CheckpointError, SizeMismatchError, UnsafePathError
from ckptfmt.lock import read_lock
from ckptfmt.run import RunDirectory, checkpoint_name, writer_made
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


# How long an operation may block before it counts as hung (a generous bound, not a timing assertion);
# lower it (CKPTFMT_HANG_DEADLINE=3) to run these tests quickly against code that does hang.
HANG_DEADLINE = float(os.environ.get("CKPTFMT_HANG_DEADLINE", "60"))


def no_hang(func: Callable[[], T], deadline: float = HANG_DEADLINE) -> T:
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
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        except PermissionError:  # needs CAP_MKNOD (root); the devzero_link case still runs everywhere
            pytest.skip("os.mknod of a character device is not permitted here")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(path.parent)  # a relative name: AF_UNIX paths are limited to ~100 bytes
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
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


def test_writer_never_creates_the_target_of_a_dangling_symlink(tmp_path: Path, outside: Sentinel) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "weights").symlink_to(outside.top / "made-by-the-writer")
    with pytest.raises(UnsafePathError, match="'weights' is a symlink"):
        small_checkpoint(dst)
    assert not os.path.lexists(outside.top / "made-by-the-writer")


@pytest.mark.parametrize("command", ["inspect", "verify", "ls", "gc"])
def test_a_fifo_given_as_the_root_fails_fast(tmp_path: Path, command: str) -> None:
    make_special(tmp_path / "root", "fifo")
    assert_clean_failure(no_hang(lambda: run_cli(command, str(tmp_path / "root"))), codes=(1, 2))


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


def test_the_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    """The caller's own path may go through a symlink; only what lies below the root is never followed."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    small_checkpoint(tmp_path / "alias")
    assert ckptfmt.verify(real).ok


def test_a_symlinked_directory_inside_a_checkpoint_is_never_read(tmp_path: Path, outside: Sentinel) -> None:
    """The outside checkpoint has files of the very same names: following the link would read its MARKER."""
    root = tmp_path / "ckpt"
    small_checkpoint(root)
    for name in ("weights", "provenance"):
        (root / "moved").mkdir(exist_ok=True)
        (root / name).rename(root / "moved" / name)
        (root / name).symlink_to(outside.ckpt / name)
    with ckptfmt.open(root) as ckpt, pytest.raises(UnsafePathError, match="'weights' is a symlink"):
        ckpt.read_tensor("weights", "w")
    for command in ("verify", "inspect"):
        assert_clean_failure(run_cli(command, str(root)))


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


def test_a_sparse_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    small_checkpoint(root)
    sparse(root / "manifest.json", 8 * GiB, b'{"format_version": "1.0"')
    with pytest.raises(SizeMismatchError, match=r"manifest\.json"):
        ckptfmt.open(root)
    assert_clean_failure(run_cli("inspect", str(root)))


# ---------------------------------------------------------------- 2. gc deletes only what a writer made


@pytest.mark.parametrize(
    ("path", "made"),
    [
        ("manifest.json", True),
        (".writer-lock", True),
        ("weights/r00000-00000.safetensors", True),
        ("weights/r123456-00001.safetensors", True),
        ("optimizer/context.msgpack", True),
        ("rng/context.r00003.msgpack", True),
        ("rng/.context.r00003.msgpack.tmp-0123456789ab", True),
        ("rng/context.r3.msgpack", False),
        ("rng/context.r00003.msgpack.old", False),
        (".manifest.json.tmp-0123456789ab", True),
        ("..writer-lock.tmp-0123456789ab", True),
        ("weights/.r00000-00000.safetensors.tmp-0123456789ab", True),
        ("weights/.context.msgpack.tmp-0123456789ab", True),
        ("weights/context.msgpack.bak", False),
        ("weights/.context.msgpack.swp", False),
        ("weights/r00000-00000.safetensors.orig", False),
        ("weights/.r00000-00000.safetensors.tmp-xyz", False),
        ("weights/.r00000-00000.safetensors.tmp-0123456789abcdef", False),
        ("Weights/r00000-00000.safetensors", False),
        ("weights/sub/r00000-00000.safetensors", False),
        ("weights/manifest.json", False),
        ("notes.txt", False),
        ("weights/.writer-lock", False),
    ],
)
def test_writer_made_names_are_matched_exactly(path: str, made: bool) -> None:
    assert writer_made(path) is made


def test_writer_made_matches_what_the_writer_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every name a real save creates (temp names included) is one gc recognizes."""
    created: list[str] = []
    real_rename = os.rename

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        created.extend([str(src), str(dst)])
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    small_checkpoint(tmp_path / "ckpt")
    assert created and all(writer_made(f"weights/{n}") or writer_made(f"provenance/{n}") for n in created)
    assert all(writer_made(p) for p in LocalStore(tmp_path / "ckpt").list())


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for step in (1, 2, 3):
        write_step(root, step)
    return root


def test_gc_leaves_a_users_directory_with_a_leftover_looking_file(run: Path) -> None:
    """The reported hole: one `context.msgpack.bak` made gc delete the whole directory."""
    user = run / "analysis" / "weights"
    user.mkdir(parents=True)
    (user / "context.msgpack.bak").write_bytes(b"my backup")
    (run / "analysis" / "notes.txt").write_text("mine")
    (run / "tensorboard").mkdir()  # an empty directory of the user's: not gc's either
    before = snapshot(run / "analysis")
    assert "analysis" not in [e.name for e in RunDirectory(run).entries()]
    result = run_cli("gc", str(run), "--keep-last", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert snapshot(run / "analysis") == before
    assert (run / "tensorboard").is_dir()
    assert [d["name"] for d in result.json()["deleted"]] == [checkpoint_name(2), checkpoint_name(1)]


def test_gc_leaves_an_uncommitted_directory_holding_foreign_files_whole(run: Path) -> None:
    name = "exports"
    (run / name / "weights").mkdir(parents=True)
    (run / name / "weights" / "r00000-00000.safetensors").write_bytes(b"exactly a writer's name")
    (run / name / "weights" / "README").write_text("but this is not")
    (run / name / ".writer-lock").write_text(json.dumps(lock_of(dead_pid())))
    before = snapshot(run / name)
    entry = next(e for e in RunDirectory(run).entries() if e.name == name)
    assert entry.status == "incomplete" and entry.foreign == ("weights/README",)
    assert name not in [e.name for e in RunDirectory(run).gc(keep_last=None)]
    result = run_cli("gc", str(run), "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["left_alone"] == [{"name": name, "reason": "foreign files", "foreign": ["weights/README"]}]
    human = run_cli("gc", str(run))
    assert f"left alone {name} (foreign files" in human.stdout
    listed = run_cli("ls", str(run))
    assert listed.exit_code == 0 and f"{name}: 1 file(s) no ckptfmt writer made" in listed.stderr
    assert snapshot(run / name) == before


def test_gc_deletes_a_committed_checkpoints_files_one_by_one_and_leaves_the_rest(run: Path) -> None:
    doomed = run / checkpoint_name(1)
    (doomed / "NOTES.md").write_text("a user's note inside a checkpoint")
    (doomed / "weights" / "plot.png").write_bytes(b"png")
    (doomed / "weights" / ".r00000-00009.safetensors.tmp-0123456789ab").write_bytes(b"a writer's temp")
    result = run_cli("gc", str(run), "--keep-last", "2", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["deleted"][0]["left"] == ["NOTES.md", "weights/plot.png"]
    assert snapshot(doomed) == {
        "NOTES.md": "file " + hashlib.sha256(b"a user's note inside a checkpoint").hexdigest(),
        "weights": f"mode {stat.S_IFDIR:o}",
        "weights/plot.png": "file " + hashlib.sha256(b"png").hexdigest(),
    }


def test_gc_reports_a_symlink_where_a_listed_file_was(run: Path, outside: Sentinel) -> None:
    data = run / checkpoint_name(1) / "weights" / "r00000-00000.safetensors"
    data.unlink()
    data.symlink_to(outside.ckpt / "weights" / "r00000-00000.safetensors")
    result = run_cli("gc", str(run), "--keep-last", "2", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["deleted"][0]["left"] == ["weights/r00000-00000.safetensors"]
    assert data.is_symlink() and not (run / checkpoint_name(1) / "manifest.json").exists()


# ---------------------------------------------------------------- 7. run-directory hostility


def test_symlinked_checkpoint_in_a_run_directory_is_never_followed(run: Path, outside: Sentinel) -> None:
    (run / checkpoint_name(0)).symlink_to(outside.ckpt)
    names = [e.name for e in RunDirectory(run).entries()]
    assert checkpoint_name(0) not in names
    result = run_cli("ls", str(run))
    assert result.exit_code == 0 and f"skipped {checkpoint_name(0)} (a symlink)" in result.stderr
    result = run_cli("gc", str(run), "--keep-last", "1")
    assert result.exit_code == 0, result.stderr
    assert f"not followed: {checkpoint_name(0)} (a symlink)" in result.stderr
    assert (run / checkpoint_name(0)).is_symlink()


def test_symlinks_inside_checkpoint_directories(run: Path, outside: Sentinel) -> None:
    crashed = run / checkpoint_name(9)
    crashed.mkdir()
    (crashed / ".writer-lock").write_text(json.dumps(lock_of(dead_pid())))
    (crashed / "weights").symlink_to(outside.top / "dir")  # its data "lives" outside: not followed
    (run / checkpoint_name(1) / "extra").symlink_to(outside.top / "secret.txt")
    (run / checkpoint_name(2) / "optimizer").symlink_to(outside.ckpt / "weights")
    (run / "loop").symlink_to(".")
    entries = {e.name: e for e in RunDirectory(run).entries()}
    assert entries[checkpoint_name(9)].foreign == ("weights",)
    for command in (("ls", str(run), "--json"), ("gc", str(run), "--keep-last", "1")):
        assert run_cli(*command).exit_code == 0
    assert (crashed / "weights").is_symlink() and (crashed / ".writer-lock").exists()  # left alone, whole
    assert (run / checkpoint_name(1) / "extra").is_symlink()  # the link stays: gc made none
    assert not (run / checkpoint_name(1) / "manifest.json").exists()


@pytest.mark.parametrize("kind", SPECIALS)
def test_special_files_in_a_run_directory(run: Path, kind: str) -> None:
    crashed = run / checkpoint_name(8)
    (crashed / "weights").mkdir(parents=True)
    make_special(crashed / "weights" / "r00000-00000.safetensors", kind)
    (crashed / ".writer-lock").write_text(json.dumps(lock_of(dead_pid())))
    locked = run / checkpoint_name(7)
    locked.mkdir()
    make_special(locked / ".writer-lock", kind)
    make_special(run / "latest.json", kind)
    entries = {e.name: e for e in no_hang(lambda: RunDirectory(run).entries())}
    assert entries[checkpoint_name(8)].foreign == ("weights/r00000-00000.safetensors",)
    assert entries[checkpoint_name(7)].status == "writing"  # an unreadable lock is presumed live
    for command in ("ls", "gc"):
        result = no_hang(lambda c=command: run_cli(c, str(run), "--json"))  # type: ignore[misc]
        assert result.exit_code == 0, result.stderr
    hold = no_hang(lambda: run_cli("gc", str(run), "--keep-last", "1", "--json")).json()
    assert "latest.json" in hold["retention_hold"] and hold["deleted"] == []
    assert os.path.lexists(crashed / "weights" / "r00000-00000.safetensors")
    assert os.path.lexists(locked / ".writer-lock")


# ---------------------------------------------------------------- 6. hostile JSON in run-directory files and locks


HOSTILE_JSON = [
    b"[" * 5000 + b"]" * 5000,
    b'{"name": ' + b"9" * 5000 + b"}",
    b'{"name": NaN}',
    b'{"name": "a", "name": "b"}',
    b"\xff\xfe",
    b"[]",
    b'"just a string"',
    b'{"name": ["step-1"]}',
    b'{"name": "step-000000001", "step": "one"}',
    b'{"pinned": "step-000000001"}',
    b'{"pinned": [1, 2]}',
    b'{"pinned": {"a": 1}}',
]


@pytest.mark.parametrize("doc", HOSTILE_JSON)
def test_hostile_latest_and_pins(run: Path, doc: bytes) -> None:
    (run / "latest.json").write_bytes(doc)
    rd = RunDirectory(run)
    assert rd.latest() is None  # a hint: unreadable is "none"
    assert [e.name for e in rd.entries()] == [checkpoint_name(s) for s in (3, 2, 1)]  # still lists
    hold = rd.retention_hold()
    assert hold is not None and "latest.json" in hold
    assert rd.gc(keep_last=1) == []  # which checkpoint `latest` protects is unknown: none deleted
    (run / "latest.json").unlink()
    (run / "pins.json").write_bytes(doc)
    with pytest.raises(CheckpointError, match=r"pins\.json"):
        rd.pinned()
    assert rd.gc(keep_last=1) == []
    result = run_cli("gc", str(run), "--keep-last", "1")
    assert result.exit_code == 0 and "retention suspended" in result.stderr and "pins.json" in result.stderr


@pytest.mark.parametrize(
    "lock",
    [
        *HOSTILE_JSON,
        json.dumps({"host": socket.gethostname(), "pid": 2**80, "nonce": "n", "started_at": "2026-01-01T00:00:00Z"}),
        json.dumps({"host": socket.gethostname(), "pid": -1, "nonce": "n", "started_at": "2026-01-01T00:00:00Z"}),
        json.dumps({"host": socket.gethostname(), "pid": 0, "nonce": "n", "started_at": "2026-01-01T00:00:00Z"}),
        json.dumps({"host": "elsewhere", "pid": 1, "nonce": "n", "started_at": "2026-01-01T00:00:00"}),
        json.dumps({"host": "elsewhere", "pid": 1, "nonce": "n", "started_at": "9999-12-31T23:59:59-23:59"}),
        json.dumps({"host": "elsewhere", "pid": 1, "nonce": "n", "started_at": 5}),
    ],
)
def test_hostile_writer_locks(run: Path, tmp_path: Path, lock: bytes | str) -> None:
    data = lock.encode() if isinstance(lock, str) else lock
    crashed = run / checkpoint_name(9)
    (crashed / "weights").mkdir(parents=True)
    (crashed / "weights" / "r00000-00000.safetensors").write_bytes(b"x")
    (crashed / ".writer-lock").write_bytes(data)
    store = LocalStore(crashed)
    holder = read_lock(store)
    assert holder is None or isinstance(holder.holder_is_dead(), bool)
    if holder is not None:
        holder.age_seconds()
    entry = next(e for e in RunDirectory(run).entries() if e.name == checkpoint_name(9))
    assert entry.status == "writing"  # unknown or unreadable: presumed live, never deleted
    with pytest.raises(ckptfmt.CheckpointLockedError):
        small_checkpoint(crashed)
    for command in (("ls", str(run)), ("gc", str(run)), ("inspect", str(crashed), "--json")):
        result = run_cli(*command)
        assert result.exit_code in (0, 1) and "Traceback" not in result.stderr
    assert (crashed / ".writer-lock").read_bytes() == data


def test_sparse_run_directory_files_are_refused_unread(run: Path) -> None:
    sparse(run / "latest.json", 8 * GiB, b"{")
    sparse(run / "pins.json", 8 * GiB, b"{")
    crashed = run / checkpoint_name(9)
    crashed.mkdir()
    sparse(crashed / ".writer-lock", 8 * GiB, b"{")
    rd = RunDirectory(run)
    assert rd.latest() is None
    with pytest.raises(SizeMismatchError, match=r"pins\.json"):
        rd.pinned()
    assert read_lock(LocalStore(crashed)) is None
    assert next(e for e in rd.entries() if e.name == checkpoint_name(9)).status == "writing"
    assert_clean_failure(run_cli("inspect", str(crashed), "--json"))


# ---------------------------------------------------------------- 3. converter sources: nothing read outside


def hf_export(src: Path, dst: Path, *extra: str) -> None:
    result = run_cli("convert", str(src), str(dst), "--to", "hf", *extra)
    assert result.exit_code == 0, result.stderr


@pytest.fixture
def hf_outside(outside: Sentinel) -> Path:
    """A Hugging Face directory outside the source, whose one tensor holds MARKER."""
    target = outside.top / "hf"
    hf_export(outside.ckpt, target)
    outside.before = snapshot(outside.top)
    return target


def sharded_source(tmp_path: Path) -> Path:
    src_ckpt = tmp_path / "src-ckpt"
    with ckptfmt.open_writer(src_ckpt, profile="weights") as w:
        w.write_tensors("weights", {f"t{i}": np.full(8, i, np.float32) for i in range(3)})
    src = tmp_path / "src"
    hf_export(src_ckpt, src, "--max-shard-size", "40")
    assert (src / "model.safetensors.index.json").exists()
    return src


def convert_must_fail(src: Path, dst: Path, *, match: str) -> None:
    result = no_hang(lambda: run_cli("convert", str(src), str(dst), "--to", "ckptfmt"))
    assert_clean_failure(result)
    assert match in result.stderr, result.stderr
    assert not (dst / "manifest.json").exists()


def test_hf_weight_map_through_a_symlinked_directory_is_refused(
    tmp_path: Path, outside: Sentinel, hf_outside: Path
) -> None:
    """The reported hole: `weight_map` names sub/<shard>, where sub is a symlink to a directory elsewhere."""
    src = sharded_source(tmp_path)
    (src / "sub").symlink_to(hf_outside)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["outside"] = "sub/model.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafePathError, match="'sub' is a symlink"):
        no_hang(lambda: import_hf(str(src), str(tmp_path / "dst")))
    convert_must_fail(src, tmp_path / "dst2", match="symlink")


def test_hf_symlinked_shard_file_is_refused(tmp_path: Path, outside: Sentinel, hf_outside: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").symlink_to(hf_outside / "model.safetensors")
    convert_must_fail(src, tmp_path / "dst", match="symlink")


@pytest.mark.parametrize("kind", SPECIALS)
@pytest.mark.parametrize("name", ["model.safetensors.index.json", "model-00001-of-00003.safetensors"])
def test_hf_special_files_are_refused(tmp_path: Path, kind: str, name: str) -> None:
    src = sharded_source(tmp_path)
    (src / name).unlink()
    make_special(src / name, kind)
    convert_must_fail(src, tmp_path / "dst", match="symlink" if kind == "devzero_link" else "not a regular file")


def test_a_fifo_named_as_the_source_itself_is_refused(tmp_path: Path) -> None:
    for name in ("model.safetensors", "model.pt", "model.safetensors.index.json"):
        make_special(tmp_path / name, "fifo")
        convert_must_fail(tmp_path / name, tmp_path / f"dst-{name}", match="FIFO")


def test_hf_sparse_index_and_header_are_refused_unread(tmp_path: Path) -> None:
    src = sharded_source(tmp_path)
    sparse(src / "model.safetensors.index.json", 8 * GiB, b"{")
    convert_must_fail(src, tmp_path / "dst", match="bytes")
    single = tmp_path / "single"
    single.mkdir()
    sparse(single / "model.safetensors", 8 * GiB, (1 << 40).to_bytes(8, "little"))  # claims a 1 TiB header
    convert_must_fail(single, tmp_path / "dst2", match="header")


@pytest.mark.parametrize(
    "index",
    [
        b'{"weight_map": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"weight_map": {"t0": "model-00001-of-00003.safetensors"}, "metadata": {"total_size": ' + b"9" * 400 + b"}}",
        b'{"weight_map": {"t0": "model-00001-of-00003.safetensors"}, "metadata": {"total_size": NaN}}',
        b'{"weight_map": {"t0": "a.safetensors", "t0": "b.safetensors"}}',
        b'{"weight_map": ["model-00001-of-00003.safetensors"]}',
        b'{"weight_map": {"t0": 5}}',
        b'{"weight_map": {"t0": "model-00001-of-00003.safetensors"}, "metadata": ["x"]}',
        b"[]",
        b"\xff",
    ],
)
def test_hf_hostile_index_json(tmp_path: Path, index: bytes) -> None:
    src = sharded_source(tmp_path)
    (src / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(CheckpointError):
        import_hf(str(src), str(tmp_path / "dst"))
    convert_must_fail(src, tmp_path / "dst2", match="index")


@pytest.mark.parametrize("metadata", ['["a"]', '{"a": 1}', '{"a": {"b": "c"}}', "5"])
def test_hf_header_metadata_of_the_wrong_type(tmp_path: Path, metadata: str) -> None:
    header = f'{{"__metadata__": {metadata}, "t": {{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}}}'
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    src = tmp_path / "model.safetensors"
    src.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8)
    with pytest.raises(CheckpointError):
        import_hf(str(src), str(tmp_path / "dst"))
    convert_must_fail(src, tmp_path / "dst2", match="metadata")


def test_pt_symlink_and_special_files_are_refused(tmp_path: Path, outside: Sentinel) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"outside": torch.frombuffer(bytearray(MARKER), dtype=torch.uint8)}, outside.top / "model.pt")
    outside.before = snapshot(outside.top)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").symlink_to(outside.top / "model.pt")
    convert_must_fail(src, tmp_path / "dst", match="symlink")
    (src / "model.pt").unlink()
    make_special(src / "model.pt", "fifo")
    convert_must_fail(src, tmp_path / "dst2", match="FIFO")


def test_dcp_symlinked_files_are_refused(tmp_path: Path, outside: Sentinel) -> None:
    pytest.importorskip("torch")
    dcp_outside = outside.top / "dcp"
    assert run_cli("convert", str(outside.ckpt), str(dcp_outside), "--to", "dcp").exit_code == 0
    outside.before = snapshot(outside.top)
    src = tmp_path / "dcp"
    small_checkpoint(tmp_path / "small")
    assert run_cli("convert", str(tmp_path / "small"), str(src), "--to", "dcp").exit_code == 0
    for name in sorted(os.listdir(src)):
        original = (src / name).read_bytes()
        (src / name).unlink()
        (src / name).symlink_to(dcp_outside / name if (dcp_outside / name).exists() else outside.top / "secret.txt")
        convert_must_fail(src, tmp_path / f"dst-{name}", match="symlink")
        (src / name).unlink()
        make_special(src / name, "fifo")
        convert_must_fail(src, tmp_path / f"dst-fifo-{name}", match="FIFO")
        (src / name).unlink()
        (src / name).write_bytes(original)
    assert run_cli("convert", str(src), str(tmp_path / "ok"), "--to", "ckptfmt").exit_code == 0


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_exports_refuse_a_destination_holding_symlinks(tmp_path: Path, outside: Sentinel, to: str) -> None:
    if to == "dcp":
        pytest.importorskip("torch")
    small_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / ("model.safetensors" if to == "hf" else "__0_0.distcp")).symlink_to(outside.top / "secret.txt")
    for extra in ((), ("--overwrite",)):
        result = run_cli("convert", str(tmp_path / "src"), str(dst), "--to", to, *extra)
        assert_clean_failure(result)
        assert "symlink" in result.stderr


# ---------------------------------------------------------------- the trainer's manager over a hostile run directory


@pytest.mark.parametrize("bad", ["fifo", "deep", "wrong-type"])
def test_manager_lists_restores_and_keeps_saving_over_unreadable_pointers(tmp_path: Path, bad: str) -> None:
    """latest.json is a hint: restore looks at the checkpoints; an unreadable pins.json suspends retention
    (its pins are unknown) without failing the save."""
    torch = pytest.importorskip("torch")
    from ckptfmt.torch import CheckpointManager, ResumableSampler

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    with CheckpointManager(run, keep_last=None) as mgr:
        for step in (2, 4):
            mgr.save(step, model=model, optimizer=opt, sampler=ResumableSampler(8, seed=0), config={})
    for name in ("latest.json", "pins.json"):
        (run / name).unlink(missing_ok=True)
        if bad == "fifo":
            make_special(run / name, "fifo")
        else:
            (run / name).write_bytes(b"[" * 5000 + b"]" * 5000 if bad == "deep" else b'{"pinned": 7, "name": 7}')
    mgr = CheckpointManager(run, keep_last=1)
    assert no_hang(lambda: mgr.restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(8, seed=0))) == 4
    no_hang(lambda: mgr.save(6, model=model, optimizer=opt, sampler=ResumableSampler(8, seed=0), config={}))
    mgr.close()
    assert {e.name for e in RunDirectory(run).entries()} == {checkpoint_name(s) for s in (2, 4, 6)}  # none deleted
    assert RunDirectory(run).latest() == RunDirectory(run).read_latest()  # the save rewrote the pointer
