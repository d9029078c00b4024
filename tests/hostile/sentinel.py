"""A sentinel tree around the checkpoint root and the destination, to prove nothing outside them is touched.

    work/
      sentinel/secret.txt, sentinel/dir/{a.bin, manifest.json}, sentinel/manifest.json   files a tool must not touch
      root.sibling.txt, latest.json, pins.json                                           beside the root
      root/     the input (a checkpoint, a run directory, a converter source, or two checkpoints for diff)
      dest/     where a converter may write

Symlinks planted inside the input point at sentinels (``sentinel-file``, ``sentinel-dir``, ``sentinel-manifest``)
or at ``/dev/zero``. Three checks, after every example:

- **writes and deletes**: every path under ``work/`` outside ``root/`` and ``dest/`` has the same type and content
  as before, and no new path appeared there; paths the case marks *protected* inside the root (a user's files in a
  run directory) are still there, unchanged;
- **reads**: an audit hook (``sys.addaudithook``) sees every ``open``, directory listing, removal, rename and
  mkdir done through Python, resolves the path, and records any that lands in the sentinel area or on a planted
  symlink's target outside (``/dev/zero``). C-level opens (torch's zip reader) are covered by the write check only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from .mutators import Fifo, Socket, Symlink, Tree

# a valid safetensors file (one F32 tensor "w" of shape [2]): what an importer following a symlink out would accept
_SAFETENSORS = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
_SAFETENSORS = (len(_SAFETENSORS) + 6).to_bytes(8, "little") + _SAFETENSORS + b"      " + b"\x00" * 8
SENTINEL_FILES: dict[str, bytes] = {
    "sentinel/dir/model.safetensors": _SAFETENSORS,
    "sentinel/secret.txt": b"a file outside the checkpoint: never read, written or deleted\n",
    "sentinel/dir/a.bin": b"\x00" * 64,
    "sentinel/dir/manifest.json": b'{"format": "not yours"}\n',
    "sentinel/manifest.json": b'{"format": "not yours either"}\n',
    "root.sibling.txt": b"beside the root\n",
    "latest.json": b'{"name": "root", "step": 1}\n',
    "pins.json": b'{"pinned": ["root"]}\n',
}
SYMLINK_TARGETS = {
    "sentinel-file": "sentinel/secret.txt",
    "sentinel-dir": "sentinel/dir",
    "sentinel-manifest": "sentinel/manifest.json",
}
OUTSIDE_TARGETS = {"dev-zero": "/dev/zero"}

AUDITED = frozenset(
    {
        "open",
        "os.listdir",
        "os.scandir",
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.truncate",
        "os.chmod",
        "os.utime",
        "os.symlink",
        "os.link",
        "shutil.rmtree",
        "shutil.copyfile",
        "shutil.move",
    }
)

_state = threading.local()
_active: Sandbox | None = None
_hook_installed = False


def _audit(event: str, args: tuple[object, ...]) -> None:
    box = _active
    if box is None or event not in AUDITED or not args or getattr(_state, "busy", False):
        return
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    _state.busy = True
    try:
        box.note(event, os.fsdecode(path))
        if event in ("os.rename", "os.symlink", "os.link", "shutil.copyfile", "shutil.move") and len(args) > 1:
            dst = args[1]
            if isinstance(dst, (str, bytes, os.PathLike)):
                box.note(event, os.fsdecode(dst))
    finally:
        _state.busy = False


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)  # cannot be removed: it does nothing while no sandbox is watching
        _hook_installed = True


def _fingerprint(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(full)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = "file:" + hashlib.sha256(full.read_bytes()).hexdigest()
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                out[rel] = f"special:{stat.S_IFMT(st.st_mode)}"
    return out


class Sandbox:
    """One work directory with its sentinel tree; ``load`` puts a case in ``root/`` (and ``dest/``)."""

    def __init__(self, work: Path) -> None:
        self.work = work.resolve()
        self.root = self.work / "root"
        self.dest = self.work / "dest"
        self.sentinel = self.work / "sentinel"
        for rel, data in SENTINEL_FILES.items():
            (self.work / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.work / rel).write_bytes(data)
        self.root.mkdir(exist_ok=True)
        self.dest.mkdir(exist_ok=True)
        self._outside = self._fingerprint_outside()
        self.protected: dict[str, bytes] = {}
        self.fifos: list[Path] = []
        self.touched: list[str] = []
        self._forbidden_targets: set[str] = set()
        _install_hook()

    # ---------------------------------------------------------------- cases

    def load(self, tree: Tree, dest: Tree | None = None, protected: dict[str, bytes] | None = None) -> None:
        """Empty root/ and dest/, then write ``tree`` into root/ and ``dest`` into dest/."""
        self.fifos = []
        self._forbidden_targets = set()
        for where, content in ((self.root, tree), (self.dest, dest or {})):
            _clear(where)
            for rel, node in sorted(content.items()):
                self._put(where / rel, node)
        self.protected = dict(protected or {})

    def _put(self, path: Path, node: bytes | Symlink | Fifo | Socket) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            _remove(path)
        if isinstance(node, bytes):
            path.write_bytes(node)
        elif isinstance(node, Symlink):
            if node.target in SYMLINK_TARGETS:
                target = str(self.work / SYMLINK_TARGETS[node.target])
            else:
                target = OUTSIDE_TARGETS.get(node.target, node.target)
            if node.target in OUTSIDE_TARGETS:
                self._forbidden_targets.add(os.path.realpath(target))
            os.symlink(target, path)
        elif isinstance(node, Fifo):
            os.mkfifo(path)
            self.fifos.append(path)
        else:
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.bind(str(path))
            except OSError:  # path too long for a socket address: a FIFO is hostile enough
                os.mkfifo(path)
                self.fifos.append(path)
            finally:
                sock.close()

    # ---------------------------------------------------------------- watching

    def __enter__(self) -> Sandbox:
        global _active
        self.touched = []
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None

    @staticmethod
    @contextlib.contextmanager
    def unwatched() -> Iterator[None]:
        """The harness's own file work inside a running example (a target filling in its input's placeholders):
        not the code under test's, so not audited."""
        busy = getattr(_state, "busy", False)
        _state.busy = True
        try:
            yield
        finally:
            _state.busy = busy

    def note(self, event: str, path: str) -> None:
        real = os.path.realpath(path)
        if real in self._forbidden_targets or self._is_outside(real):
            self.touched.append(f"{event} {real}")

    def _is_outside(self, real: str) -> bool:
        work = str(self.work)
        if real != work and not real.startswith(work + os.sep):
            return False
        for allowed in (str(self.root), str(self.dest)):
            if real == allowed or real.startswith(allowed + os.sep):
                return False
        return real != work  # listing work/ itself (the parent of the root) is how a root is found

    def unblock_fifos(self) -> None:
        """Open each FIFO for writing and close it: a reader blocked in open() sees EOF (the watchdog's last resort)."""
        for fifo in self.fifos:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            os.close(fd)

    def _fingerprint_outside(self) -> dict[str, str]:
        found = _fingerprint(self.work)
        return {k: v for k, v in found.items() if not (k in ("root", "dest") or k.startswith(("root/", "dest/")))}

    def problems(self) -> list[str]:
        """What changed outside root/ and dest/, what was read there, and which protected files were touched."""
        out = [f"touched outside the root: {t}" for t in dict.fromkeys(self.touched)]
        now = self._fingerprint_outside()
        for rel in sorted(set(now) | set(self._outside)):
            before, after = self._outside.get(rel), now.get(rel)
            if before != after:
                what = "created" if before is None else "deleted" if after is None else "changed"
                out.append(f"{what} outside the root: {rel}")
        for rel, data in self.protected.items():
            path = self.root / rel
            if path.is_symlink() or not path.is_file() or path.read_bytes() != data:
                out.append(f"protected file inside the root deleted or changed: {rel}")
        if any(not p.startswith("touched") for p in out):
            self.restore()
        return out

    def restore(self) -> None:
        """Put the sentinel tree back as it was, so one violation does not cascade into every later example."""
        for rel in [r for r in _fingerprint(self.work) if r not in self._outside]:
            full = self.work / rel
            if not (rel in ("root", "dest") or rel.startswith(("root/", "dest/"))) and (
                full.exists() or full.is_symlink()
            ):
                _remove(full)
        for rel, data in SENTINEL_FILES.items():
            full = self.work / rel
            if full.is_symlink() or (full.exists() and not full.is_file()):
                _remove(full)
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_bytes(data)
        self._outside = self._fingerprint_outside()


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _clear(where: Path) -> None:
    if where.is_symlink():
        where.unlink()
    where.mkdir(exist_ok=True)
    for child in list(where.iterdir()):
        _remove(child)
