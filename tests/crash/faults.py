"""Injected failures: fsync reporting EIO, write reporting ENOSPC (local), S3 requests failing.

For each injection point N (the Nth call of the kind, counted over one save), a save into a run
directory is made to fail there, and then:

- the save raised a library error (a CheckpointError), and nothing is committed;
- gc (``ckpt gc`` on the run directory) leaves the run directory clean;
- a retry of the same save (no gc first, ``overwrite=True`` as CheckpointManager does) either commits
  a checkpoint that verifies and holds exactly what was written, or raises a library error and leaves
  nothing committed: never a false success.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from click.testing import CliRunner

import ckptfmt
from ckptfmt.run import checkpoint_name

from . import payload

NAME = checkpoint_name(1)


@dataclass(slots=True)
class FaultFigures:
    name: str
    injected: int = 0  # saves made to fail
    failed_cleanly: int = 0  # raised a library error, nothing committed
    absorbed: int = 0  # the fault was retried away inside the library and the save is whole
    cleaned: int = 0  # gc left the run directory clean
    retried_whole: int = 0
    retried_refused: int = 0
    wrong: list[str] = field(default_factory=list)


class Injector:
    """Raises ``make_error()`` at the Nth call (and every later one if ``persistent``), counting calls."""

    def __init__(self, at: int | None, make_error: Callable[[], BaseException], persistent: bool = False) -> None:
        self.at = at
        self.make_error = make_error
        self.persistent = persistent
        self._count = itertools.count(1)
        self.calls = 0
        self.fired = 0

    def tick(self) -> None:
        n = next(self._count)
        self.calls = n
        if self.at is not None and (n == self.at or (self.persistent and n > self.at)):
            self.fired += 1
            raise self.make_error()


@contextmanager
def failing_os(name: str, injector: Injector) -> Iterator[Injector]:
    import os

    real = getattr(os, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        injector.tick()
        return real(*args, **kwargs)

    setattr(os, name, failing)
    try:
        yield injector
    finally:
        setattr(os, name, real)


@contextmanager
def failing_http(injector: Injector) -> Iterator[Injector]:
    from aiobotocore.endpoint import AioEndpoint  # type: ignore[import-untyped]

    real = AioEndpoint._send

    async def failing(self: Any, request: Any) -> Any:
        injector.tick()
        return await real(self, request)

    AioEndpoint._send = failing
    try:
        yield injector
    finally:
        AioEndpoint._send = real


def eio() -> OSError:
    return OSError(errno.EIO, "injected: input/output error")


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "injected: no space left on device")


def connection_error() -> Exception:
    from botocore.exceptions import EndpointConnectionError  # type: ignore[import-untyped]

    error: Exception = EndpointConnectionError(endpoint_url="http://127.0.0.1 (injected)")
    return error


def gc_cli(run_url: str, options: Mapping[str, Any] | None = None) -> None:
    """``ckpt gc RUN`` in this process (a failed writer's lock names this live process: only its own
    gc may know it abandoned it)."""
    from ckptfmt.cli import cli

    if not _left(run_url, options):
        return  # nothing to collect (and on S3 an empty prefix is "not a directory" to ckpt gc)
    result = CliRunner().invoke(cli, ["gc", run_url, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def _left(run_url: str, options: Mapping[str, Any] | None) -> list[str]:
    store = ckptfmt.open_store(run_url, options)
    left = [p for p in store.list() if p != "latest.json"]
    return left + [f"pending upload {p}" for p, _ in store.pending_uploads()]


def trial(
    run_url: str,
    fault: Callable[[], Any],
    figures: FaultFigures,
    label: str,
    options: Mapping[str, Any] | None = None,
    *,
    retry: bool,
) -> None:
    """One save made to fail by ``fault()`` (a context manager), then gc or a retry, judged."""
    url = f"{run_url}/{NAME}"
    figures.injected += 1
    raised: BaseException | None = None
    with fault() as injector:
        try:
            payload.write(url, 1, storage_options=options, overwrite=True)
        except BaseException as exc:
            raised = exc
    if injector.fired == 0:
        figures.injected -= 1  # this save made fewer calls than the point asked for: no fault
        return
    verdict = payload.judge(url, 1, storage_options=options)
    if raised is None:
        if verdict.outcome == "whole":
            figures.absorbed += 1
        else:
            figures.wrong.append(
                f"{label}: the save returned but the checkpoint is {verdict.outcome}: {verdict.detail}"
            )
            return
    elif not isinstance(raised, ckptfmt.CheckpointError):
        figures.wrong.append(f"{label}: raised {type(raised).__name__}: {raised} (not a library error)")
        return
    elif verdict.outcome != "refused":
        figures.wrong.append(f"{label}: the save raised {raised.code} but the checkpoint is {verdict.outcome}")
        return
    else:
        figures.failed_cleanly += 1
    if not retry:
        gc_cli(run_url, options)
        left = _left(run_url, options)
        if raised is not None and left:
            figures.wrong.append(f"{label}: gc left {left}")
        else:
            figures.cleaned += 1
        return
    try:
        payload.write(url, 1, storage_options=options, overwrite=True)
    except ckptfmt.CheckpointError as exc:
        again = payload.judge(url, 1, storage_options=options)
        if again.outcome == "refused":
            figures.retried_refused += 1
        else:
            figures.wrong.append(f"{label}: the retry raised {exc.code} but the checkpoint is {again.outcome}")
        return
    again = payload.judge(url, 1, storage_options=options)
    if again.outcome == "whole":
        figures.retried_whole += 1
    else:
        figures.wrong.append(f"{label}: the retry returned but the checkpoint is {again.outcome}: {again.detail}")


def count(kind: str, run_url: str, options: Mapping[str, Any] | None = None) -> int:
    """How many calls of ``kind`` ("fsync", "write" or "http") one save makes."""
    injector = Injector(None, eio)
    with failing_http(injector) if kind == "http" else failing_os(kind, injector):
        payload.write(f"{run_url}/{NAME}", 1, storage_options=options)
    return injector.calls


def local_faults(new_run: Callable[[], str], kind: str, *, points: list[int] | None = None) -> FaultFigures:
    """Fail the Nth ``kind`` call ("fsync": EIO, "write": ENOSPC) of a local save, for every N (or ``points``)."""
    make = eio if kind == "fsync" else enospc
    figures = FaultFigures(f"{'EIO from fsync' if kind == 'fsync' else 'ENOSPC from write'} (local)")
    total = count(kind, new_run())
    for n in points if points is not None else range(1, total + 1):
        for retry in (False, True):
            label = f"{kind} #{n}/{total} fails ({'retry' if retry else 'gc'})"
            trial(new_run(), lambda n=n: failing_os(kind, Injector(n, make)), figures, label, retry=retry)  # type: ignore[misc]
    return figures


def s3_faults(
    new_run: Callable[[], str],
    *,
    persistent: bool,
    points: list[int] | None = None,
    options: Mapping[str, Any] | None,
    retries: tuple[bool, ...] = (False, True),
) -> FaultFigures:
    """Fail the Nth HTTP request of an S3 save (and, if ``persistent``, every later one: the endpoint is down)."""
    figures = FaultFigures(f"S3 requests failing {'from the Nth on' if persistent else 'once'}")
    total = count("http", new_run(), options)
    for n in points if points is not None else range(1, total + 1):
        for retry in retries:
            label = f"request #{n}/{total} fails{' and all after' if persistent else ''} ({'retry' if retry else 'gc'})"
            trial(
                new_run(),
                lambda n=n: failing_http(Injector(n, connection_error, persistent)),  # type: ignore[misc]
                figures,
                label,
                options,
                retry=retry,
            )
    return figures
