"""SIGKILL a writer at every kill point and at random moments, on local disk and S3 (issue 9).

After each kill, ``ckptfmt.open`` refuses or returns a checkpoint that verifies and holds exactly what
was written; a save whose call returned is whole; gc removes a dead writer's remains; resuming picks
the newest good checkpoint. CI runs a sample; ``CKPTFMT_RELIABILITY=full`` (or scripts/reliability.py)
runs the published sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from crash import consistency, size
from crash.consistency import Figures, Target


def _local(tmp_path: Path) -> Target:
    return Target(url=lambda i: str(tmp_path / f"run{i}"))


def _s3(moto_server: Any) -> Target:
    bucket = moto_server.create_bucket()
    return Target(url=lambda i: f"s3://{bucket}/run{i}", http=True)


def _spread(total: int, count: int) -> list[int]:
    """``count`` kill points spread evenly over calls 1..total+1 (the last: nothing killed)."""
    if count >= total + 1:
        return list(range(1, total + 2))
    return sorted({1 + round(i * total / (count - 1)) for i in range(count)})


def _held(figures: Figures, *, expect_trials: int | None = None) -> None:
    assert not figures.wrong, "\n".join(figures.wrong[:20])
    assert figures.trials == figures.refused + figures.whole
    if expect_trials is not None:
        assert figures.trials == expect_trials


def test_kill_points_of_a_local_save(tmp_path: Path) -> None:
    from crash import killing

    calls = killing.count_calls(consistency._single_work(str(tmp_path / "count"), None))
    assert len(calls) > 100  # lock, ~15 files of write/fsync/rename each, directory syncs, manifest
    points = _spread(len(calls), size(40, len(calls) + 1))  # full size: every call is a kill point
    figures = consistency.kill_points(_local(tmp_path), points=points)
    _held(figures, expect_trials=len(points))
    assert figures.refused > 0 and figures.whole > 0


def test_random_kills_of_a_local_save(tmp_path: Path) -> None:
    trials = size(40, 1000)
    figures = consistency.random_kills(_local(tmp_path), trials, seed=1)
    _held(figures, expect_trials=trials)
    assert figures.killed > 0


def _run_points(tmp_path: Path) -> list[int]:
    from crash import killing

    progress = killing.Progress()
    calls = killing.count_calls(consistency._run_work(str(tmp_path / "count"), None, progress))
    progress.collect()
    return _spread(len(calls), size(8, len(calls) + 1))


def test_kill_points_of_a_run_directory_resume_from_newest_good(tmp_path: Path) -> None:
    points = _run_points(tmp_path)
    figures = consistency.kill_points(_local(tmp_path), workload="run", points=points)
    _held(figures, expect_trials=len(points))
    assert figures.whole > 0


def test_random_kills_of_a_run_directory(tmp_path: Path) -> None:
    trials = size(5, 300)
    _held(consistency.random_kills(_local(tmp_path), trials, workload="run", seed=2), expect_trials=trials)


def test_kill_points_of_an_s3_save(moto_server: Any) -> None:
    target = _s3(moto_server)
    from crash import killing

    calls = killing.count_calls(consistency._single_work(target.url(-3), None), http=True)
    assert len(calls) > 5  # one request per data file and context blob at least
    points = _spread(len(calls), size(3, len(calls) + 1))
    figures = consistency.kill_points(target, points=points)
    _held(figures, expect_trials=len(points))
    assert figures.refused > 0 and figures.whole > 0


def test_random_kills_of_an_s3_save(moto_server: Any) -> None:
    trials = size(2, 50)
    _held(consistency.random_kills(_s3(moto_server), trials, seed=3), expect_trials=trials)


def test_checkpoint_manager_restores_newest_good_after_random_kills(tmp_path: Path) -> None:
    from crash import manager

    url: Callable[[int], str] = lambda i: str(tmp_path / f"mgr{i}")  # noqa: E731
    trials = size(3, 200)
    figures = manager.random_kills(url, trials, seed=5)
    _held(figures, expect_trials=trials)


def test_negative_control_a_writer_publishing_the_manifest_first_is_caught(tmp_path: Path) -> None:
    """The oracle can fail: copying a finished checkpoint manifest-first, killed midway, is loadable but wrong."""
    import shutil

    from crash import killing, payload

    source = tmp_path / "source"
    payload.write(str(source), 1)
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())
    files.sort(key=lambda p: p.name != "manifest.json")  # the manifest first: the bug

    def copy_manifest_first(dest: Path) -> Callable[[], None]:
        def work() -> None:
            for rel in files:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / rel, dest / rel)
                killing.Counter.tick(counter, "copy")

        return work

    wrong = 0
    for n in range(2, len(files) + 1):
        counter = killing.Counter(kill_at=n)
        dest = tmp_path / f"copy{n}"
        exit_ = killing.reap(killing.fork(copy_manifest_first(dest)))
        assert exit_.killed
        wrong += payload.judge(str(dest), 1).outcome == "wrong"
    # killed after copying n files: for n < len(files), the manifest is there and a file is missing
    assert wrong == len(files) - 2
