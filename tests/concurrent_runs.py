"""Run a module's independent subprocess runs a few at a time, for module-scoped fixtures.

Most of a trainer subprocess is single-threaded start-up (``import torch`` and, on the first optimizer step,
``torch._dynamo``: about 4 s of one core each), so runs that do not depend on each other finish sooner side by
side. A job may depend on others (a resume needs the run it resumes); it starts as soon as they are done.

Each job's result, or the exception it raised, is kept: ``jobs[name]`` returns the one or raises the other,
so a failed run fails the tests that use it and no others.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any


def default_workers() -> int:
    """As many runs at once as there are cores (at least 2, at most 4: each run holds a few hundred MiB)."""
    return min(4, max(2, os.cpu_count() or 2))


class DependencyFailed(Exception):
    """A job did not run because a job it depends on failed."""


class Jobs:
    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._jobs: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {}
        self._results: dict[str, Any] = {}
        self._errors: dict[str, BaseException] = {}

    def add(self, name: str, fn: Callable[..., Any], *after: str) -> None:
        """Run ``fn(*results of after)`` once every job named in ``after`` has succeeded; jobs start in the
        order they were added, so add the longest chains first."""
        missing = [dep for dep in after if dep not in self._jobs]
        assert name not in self._jobs and not missing, (name, missing)
        self._jobs[name] = (fn, after)

    def run(self) -> Jobs:
        """Run every job; returns when all have finished (or could not start)."""
        pending = dict(self._jobs)
        running: dict[Future[Any], str] = {}
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            while pending or running:
                for name, (fn, after) in list(pending.items()):
                    failed = [dep for dep in after if dep in self._errors]
                    if failed:
                        del pending[name]
                        error = DependencyFailed(f"{name} did not run: {', '.join(failed)} failed")
                        error.__cause__ = self._errors[failed[0]]
                        self._errors[name] = error
                    elif all(dep in self._results for dep in after) and len(running) < self.workers:
                        del pending[name]
                        running[pool.submit(fn, *(self._results[dep] for dep in after))] = name
                if not running:
                    continue  # only jobs whose dependencies failed were left: the loop drops them
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    name = running.pop(future)
                    error = future.exception()
                    if error is None:
                        self._results[name] = future.result()
                    else:
                        self._errors[name] = error
        return self

    def __getitem__(self, name: str) -> Any:
        if name in self._errors:
            raise self._errors[name]
        return self._results[name]
