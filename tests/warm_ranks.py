"""Rank processes forked from a warm interpreter instead of started cold: what a test's ranks import, imported once.

A fresh interpreter of this venv pays about 5 CPU-seconds before a rank's first line: ``import torch`` (2.1 s
on the CI machine) and an optimizer's constructor importing ``torch._dynamo`` (2.5 s). A module that starts 20
ranks spent 100 of its 106 CPU-seconds on that, on CI's 2 cores. Here a rank is a child of multiprocessing's
fork server, which imported ``PRELOAD`` once for the whole session: it starts in milliseconds and is still a
process of its own, with its own environment, output files and exit status, and dies by any signal like any
other. What the ranks test is unchanged (each runs its script as ``__main__`` with its own ``argv``).

What a warm start does not vary is the interpreter's own start: every fork shares the server's imports and its
string-hash seed, where cold processes each draw one. The torchrun tests fork theirs through tests/warm_server.py
(torchrun starts those processes, not the test), the reference runs from a second server: another seed. The
story, peer-hang and SIGTERM trainer tests start every process cold.

Measured on the 2-core VM, machine-wide busy CPU-seconds (``/proc/stat``) of a module run alone, cold starts
against warm: ``test_distributed.py`` 125 against 23 (67 s against 19-26 s), ``test_trainer_resume.py`` and
``test_resume_matrix.py`` together 178 against 83 (102 s against 45 s), the Accelerate and Lightning tests of
two processes (``process_ranks.py``) 74 against 29 (54 s against 22 s).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from warm_server import PRELOAD  # one list of what a warm fork has imported, for both kinds

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _main(script: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The rank: its environment and output files, then its script as ``__main__`` (exit status: SystemExit's
    code, 1 for an exception, whose traceback goes to ``err``). The rank leads a process group of its own, which
    what it starts (DataLoader workers) joins: the group is ended with it (:meth:`WarmProcess.wait`)."""
    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):  # the same path twice: stderr goes to stdout's file, interleaved
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    threads = env.get("OMP_NUM_THREADS")
    if threads:  # read from the environment when torch was imported, in the server: set it as a cold start would
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [script, *argv]
    sys.path[0] = str(Path(script).parent)
    runpy.run_path(script, run_name="__main__")


class WarmProcess:
    """The parts of ``subprocess.Popen`` the tests use, for a script run in a warm rank."""

    def __init__(
        self, script: str | os.PathLike[str], argv: list[str], *, env: dict[str, str], stderr_to_stdout: bool = False
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="warm-rank-")  # removed with this object
        self._out = os.path.join(self._dir.name, "stdout")
        self._err = self._out if stderr_to_stdout else os.path.join(self._dir.name, "stderr")
        self.args = [sys.executable, str(script), *argv]
        self._process = _context.Process(target=_main, args=(str(script), list(argv), dict(env), self._out, self._err))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        # What the rank started and left behind dies with it: a trainer killed by a test leaves its DataLoader
        # workers orphaned, still running after the whole test run (seen in CI: scripts/test.sh's leak check).
        _end_group(self.pid)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out = Path(self._out).read_text(errors="replace")
        return out, "" if self._err == self._out else Path(self._err).read_text(errors="replace")

    def output(self) -> str:
        """What the rank has written so far, stdout then stderr (also after it was killed)."""
        parts = [self._out] if self._err == self._out else [self._out, self._err]
        return "".join(Path(p).read_text(errors="replace") for p in parts if os.path.exists(p))

    def kill(self) -> None:
        """SIGKILL the rank and everything in its process group."""
        self._process.kill()
        _end_group(self.pid)


def _end_group(pgid: int | None) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it


def run(
    script: str | os.PathLike[str], argv: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, script, *argv], capture_output=True, text=True, timeout=...)``, run warm."""
    proc = WarmProcess(script, argv, env=dict(os.environ) if env is None else env)
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    assert proc.returncode is not None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
