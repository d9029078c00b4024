"""Provenance of a training run: the code's git commit and dirty flag, software versions, host."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata

from ._version import __version__


def git_state(cwd: str | None = None) -> dict[str, object] | None:
    """``{"commit", "dirty"}`` of the git repository around ``cwd``, or None when there is none (never raises).

    Looked up once per directory per process: the code a process runs is what it imported when it started,
    and two ``git`` processes are a cost every save and every load's comparison would otherwise pay.
    """
    found = _git_state(os.path.realpath(cwd or os.getcwd()))
    return None if found is None else dict(found)


@functools.lru_cache(maxsize=16)
def _git_state(cwd: str) -> tuple[tuple[str, object], ...] | None:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if len(commit) not in (40, 64):
        return None
    return (("commit", commit), ("dirty", bool(status.strip())))


def versions(*packages: str) -> dict[str, str]:
    return dict(_versions(packages))


@functools.lru_cache(maxsize=8)
def _versions(packages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    # Installed versions do not change under a running process; reading package metadata searches sys.path on
    # every call, which a memory snapshot every step would pay every step.
    out = {"python": platform.python_version(), "ckptfmt": __version__}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return tuple(out.items())


def default_provenance() -> dict[str, object]:
    """What the writer puts in every ``provenance`` context, under the caller's own keys: the writer, the time of
    writing (UTC, microseconds) and the host."""
    return {
        "writer": {"name": "ckptfmt", "version": __version__},
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "host": socket.gethostname(),
    }


def capture(
    *,
    step: int | None = None,
    parent: str | None = None,
    cwd: str | None = None,
    code: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The caller-side provenance; the writer adds ``writer`` and ``created_at``.

    ``code`` is the code state when the caller already knows it (a checkpoint manager looks it up
    once, when training starts; an empty map means "no repository"); None looks it up now.
    """
    out: dict[str, object] = {"host": socket.gethostname(), "versions": versions("numpy", "torch")}
    if code is None:
        code = git_state(cwd)
    if code:
        out["code"] = dict(code)
    if step is not None:
        out["step"] = step
    if parent is not None:
        out["parent"] = parent
    return out
