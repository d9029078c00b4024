"""Injected fsync (EIO), write (ENOSPC) and S3 request failures at every point of a save (issue 9).

Each failing save raises a library error and commits nothing; ``ckpt gc`` leaves the run directory
clean; a retry commits a whole checkpoint or fails with nothing committed. Points where the library
is known not to hold yet are strict xfails, named after the defect (see each reason).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crash import faults, full

# One attempt: an endpoint that is down fails fast (the default five back off for seconds per trial; the
# published run, scripts/reliability.py, uses two, so a failure once is retried away there).
S3_OPTIONS = {"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}


def _runs(tmp_path: Path) -> Callable[[], str]:
    counter = itertools.count()
    return lambda: str(tmp_path / f"run{next(counter)}")


def _s3_runs(moto_server: Any) -> Callable[[], str]:
    bucket = moto_server.create_bucket()
    counter = itertools.count()
    return lambda: f"s3://{bucket}/run{next(counter)}"


def _held(figures: faults.FaultFigures) -> None:
    assert not figures.wrong, "\n".join(figures.wrong[:20])
    assert figures.injected > 0
    assert figures.injected == figures.failed_cleanly + figures.absorbed


def test_fsync_eio_at_every_point_fails_cleanly(tmp_path: Path) -> None:
    new_run = _runs(tmp_path)
    total = faults.count("fsync", new_run())
    # 2: the lock's directory fsync, total: the manifest's (known defects, below)
    figures = faults.local_faults(new_run, "fsync", points=[n for n in range(1, total + 1) if n not in (2, total)])
    _held(figures)
    assert figures.failed_cleanly == figures.injected and figures.cleaned > 0 and figures.retried_whole > 0


def test_enospc_at_every_write_fails_cleanly(tmp_path: Path) -> None:
    figures = faults.local_faults(_runs(tmp_path), "write")
    _held(figures)
    assert figures.failed_cleanly == figures.injected and figures.retried_whole == figures.injected // 2


# Defect D3, found by this harness and fixed: when the directory fsync after the manifest's link fails, commit()
# aborts and deletes the data  files but leaves the linked manifest: a checkpoint that opens and does not verify
# (writer.py commit/abort)",
def test_fsync_failure_after_the_manifest_link_leaves_no_broken_commit(tmp_path: Path) -> None:
    new_run = _runs(tmp_path)
    _held(faults.local_faults(new_run, "fsync", points=[faults.count("fsync", new_run())]))


# Defect D4, found by this harness and fixed: a failure in CheckpointWriter.__init__ after the lock is linked (here
# its directory fsync)  leaves the lock of a live process, neither removed nor abandoned: gc keeps it, this
# process's retries are locked",
def test_fsync_failure_after_the_lock_link_leaves_nothing_gc_cannot_clean(tmp_path: Path) -> None:
    _held(faults.local_faults(_runs(tmp_path), "fsync", points=[2]))


def _s3_points(total: int, ci: list[int]) -> list[int]:
    return [n for n in range(1, total + 1) if n not in (2, 3, total)] if full() else ci


def test_s3_request_failing_once_is_retried_or_fails_cleanly(moto_server: Any) -> None:
    new_run = _s3_runs(moto_server)
    total = faults.count("http", new_run(), S3_OPTIONS)
    figures = faults.s3_faults(new_run, persistent=False, points=_s3_points(total, [total // 2]), options=S3_OPTIONS)
    _held(figures)


def test_s3_endpoint_down_from_any_request_fails_cleanly(moto_server: Any) -> None:
    new_run = _s3_runs(moto_server)
    total = faults.count("http", new_run(), S3_OPTIONS)
    figures = faults.s3_faults(new_run, persistent=True, points=_s3_points(total, [1, total // 2]), options=S3_OPTIONS)
    _held(figures)
    assert figures.failed_cleanly > 0


# Defect D5, found by this harness and fixed: the lock's removal after the manifest is written is outside
# commit()'s error handling:  when it fails the save raises StorageError although the checkpoint is committed
# (writer.py commit)",
def test_s3_failure_after_the_manifest_is_written_does_not_report_failure(moto_server: Any) -> None:
    new_run = _s3_runs(moto_server)
    total = faults.count("http", new_run(), S3_OPTIONS)
    _held(faults.s3_faults(new_run, persistent=True, points=[total], options=S3_OPTIONS, retries=(False,)))
