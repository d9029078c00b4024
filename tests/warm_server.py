"""Commands that another program starts (torchrun and its workers), forked from a warm interpreter.

``tests/warm_ranks.py`` forks the ranks a test starts itself. Under torchrun the test does not start the workers:
torchrun's agent does, with ``subprocess.Popen``, and a cold worker of this venv pays about 5 CPU-seconds of
imports before its first line (``import torch``, then ``torch._dynamo`` from an optimizer's constructor); the
node-loss test starts 18 of them and 6 agents. Here a command is a *launcher*: a stdlib-only interpreter
(``python -S``, about 20 ms) that hands its arguments, environment, working directory, umask and standard streams
to a :class:`WarmServer`, which imported torch once and forks. The fork runs the script (or ``-m`` module) as
``__main__``, as ``python script`` would, and shuts down as an interpreter does (non-daemon threads joined, atexit
handlers run).

The launcher stands in for the process in every way its starter can see:

- it forwards every signal it is sent (torchrun's SIGTERM to a worker's process group reaches the launcher), and
  the server passes it to the fork's whole group (the fork leads a session of its own), as ``killpg`` would have;
- it exits as the fork exited: the same status, or killed by the same signal, so torchrun sees a rank that
  SIGKILLed itself as ``-9`` and restarts it;
- when the launcher is SIGKILLed (it cannot forward that), the server sees its connection close and SIGKILLs the
  fork's group, stopped or not.

What a warm start does not vary is the interpreter's own start: every fork of one server shares its imports and
its string-hash seed. A test that compares two runs bit for bit starts them from two servers (two seeds).

Run as a script this file is the launcher: ``python -S warm_server.py SOCKET (SCRIPT | -m MODULE) [ARGS...]``.
It imports nothing outside the standard library at the top, so the launcher stays cheap.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, NoReturn

PRELOAD = [  # what the warm forks' scripts import (examples/train.py, torchrun); tests/warm_ranks.py's too
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
    "ckptfmt.torch",
]
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
_HEADER = struct.Struct("!Q")
_LOST = 255  # the launcher's exit status when the server went away without a status


class WarmServer:
    """A server process that imported ``PRELOAD`` and forks a launcher's command on request."""

    def __init__(self, preload: list[str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="warm-server-")
        self.socket = os.path.join(self._dir.name, "socket")
        args = [sys.executable, __file__, "--serve", self.socket, *(PRELOAD if preload is None else preload)]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # a fork sets its own (_child)
        self._process = subprocess.Popen(args, stdout=subprocess.PIPE, env=env, start_new_session=True)
        assert self._process.stdout is not None
        ready = self._process.stdout.readline()
        if ready != b"ready\n":
            self._process.kill()
            raise RuntimeError(f"the warm server did not start (exit {self._process.wait()})")

    def command(self, *argv: str) -> list[str]:
        """The command line that runs ``argv`` (``script args`` or ``-m module args``) forked from this server."""
        return [sys.executable, "-S", __file__, self.socket, *argv]

    def torchrun(self, options: list[str], script: str | os.PathLike[str], *args: str) -> list[str]:
        """``torchrun OPTIONS SCRIPT ARGS``: the agent and every worker it starts forked from this server (the
        workers through launchers, which torchrun runs as a program of their own with ``--no-python``)."""
        return self.command("-m", "torch.distributed.run", *options, "--no-python", *self.command(str(script), *args))

    def close(self) -> None:
        """Stop the server; it SIGKILLs the group of every command still running (``_serve``)."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:  # a hang guard: it exits at once on SIGTERM
                self._process.kill()
                self._process.wait()
        self._dir.cleanup()

    def __enter__(self) -> WarmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[str, WarmServer] = {}
_SHARED_LOCK = threading.Lock()  # the tests start runs from threads (concurrent_runs.Jobs)


def shared(name: str = "default") -> WarmServer:
    """One server per ``name`` for the whole pytest process (the slow tests run in one), started on first use
    and stopped at the session's end (tests/conftest.py), or at exit. Two names are two servers: two string-hash
    seeds."""
    with _SHARED_LOCK:
        if name not in _SHARED:
            if not _SHARED:
                atexit.register(close_shared)
            _SHARED[name] = WarmServer()
        return _SHARED[name]


def close_shared() -> None:
    """Stop every shared server (a later ``shared`` starts a new one)."""
    with _SHARED_LOCK:
        while _SHARED:
            _SHARED.popitem()[1].close()


# ---------------------------------------------------------------- the server


def _serve(path: str, preload: list[str]) -> None:
    import importlib

    # a mask inherited from whatever started the server (a thread of pytest's, say) would reach every fork: a
    # forwarded SIGTERM left pending in a command that never sees it
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    defaults = {sig: signal.getsignal(sig) for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)}
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select through the wakeup fd

    def stop(*_: Any) -> NoReturn:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    request, fds = _receive(conn)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        for fd in (listener.fileno(), wake_r, wake_w, conn.fileno(), *_filenos(children)):
                            os.close(fd)
                        _child(request, fds, defaults)
                    for fd in fds:
                        os.close(fd)
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                elif key.fileobj is wake_r:
                    os.read(wake_r, 4096)
                else:
                    _forward(key.fileobj, key.data, selector)  # type: ignore[arg-type]
            _reap(children, selector)
    finally:
        for pid in children:
            _killpg(pid, signal.SIGKILL)


def _filenos(children: dict[int, socket.socket]) -> list[int]:
    return [conn.fileno() for conn in children.values() if conn.fileno() >= 0]


def _forward(conn: socket.socket, pid: int, selector: selectors.BaseSelector) -> None:
    """What a launcher sends once its command runs: signals to pass to the command's group. Its connection closed
    (it was SIGKILLed, which it cannot forward), the group is SIGKILLed: stopped or not, nothing is left behind."""
    try:
        data = conn.recv(256)
    except OSError:
        data = b""
    if not data:
        selector.unregister(conn)
        _killpg(pid, signal.SIGKILL)
        return
    for line in data.decode().split("\n"):  # "signal N" lines; a few bytes each, never split by a 256-byte recv
        kind, _, value = line.partition(" ")
        if kind == "signal":
            _killpg(pid, int(value))


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass  # already gone


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            selector.unregister(conn)
        except KeyError:
            pass  # unregistered when its launcher went away
        code = os.waitstatus_to_exitcode(status)
        try:
            conn.sendall(f"signal {-code}\n".encode() if code < 0 else f"exit {code}\n".encode())
        except OSError:
            pass  # the launcher is gone
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the launcher went away mid-request")
        body += chunk
    return json.loads(body), fds


def _child(request: dict[str, Any], fds: list[int], defaults: dict[Any, Any]) -> NoReturn:
    """The command, in the fork: the launcher's process state, then the script as ``__main__``."""
    import io
    import runpy
    import traceback

    os.setsid()  # the leader of its own group: a forwarded signal reaches what it starts, as killpg would have
    signal.set_wakeup_fd(-1)
    for sig, handler in defaults.items():
        signal.signal(sig, handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    # the launcher's streams, unbuffered as torchrun's ``python -u`` workers are: a SIGKILL loses no line
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:  # read from the environment when torch was imported, in the server
        sys.modules["torch"].set_num_threads(int(threads))
    argv: list[str] = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # an interpreter's shutdown: wait for non-daemon threads, then the atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------- the launcher


def _launch(path: str, argv: list[str]) -> NoReturn:
    # held from the start until the handlers are in: a signal sent the moment the command runs is passed on, not
    # taken by the launcher's default action; then unblocked, even if the launcher's starter had them blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask}).encode()
    streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
    socket.send_fds(conn, [_HEADER.pack(len(body))], streams)
    conn.sendall(body)

    def forward(signum: int, _: Any) -> None:
        conn.sendall(f"signal {signum}\n".encode())

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    status = b""
    while not status.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            os._exit(_LOST)
        status += chunk
    kind, _, value = status.decode().strip().partition(" ")
    if kind == "signal":  # die of it, as the command did
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
        os._exit(128 + int(value))
    os._exit(int(value))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        try:
            _serve(sys.argv[2], sys.argv[3:])
        except SystemExit as exc:  # SIGTERM (close): every command's group is SIGKILLed by now
            sys.stdout.flush()
            os._exit(_exit_code(exc))  # not the 2 s an interpreter that imported torch takes to finalize
    else:
        _launch(sys.argv[1], sys.argv[2:])
