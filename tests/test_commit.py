"""The multi-rank commit when the exchange fails or a rank's report cannot be trusted (spec/commit.md COM-19..21).

Ranks run as threads over a ThreadCollective; a rank "dies" by abandoning the group, which makes every
other rank's pending collective fail at once, as a dead process makes gloo fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_multirank import BOUNDS, FULL, run_ranks

import ckptfmt
from ckptfmt import CollectiveError, ThreadCollective
from ckptfmt.errors import CheckpointError, DigestMismatchError, MissingFileError
from ckptfmt.paths import LOCK_NAME


class Wrapped:
    """A rank's collective passing everything to ``inner``; the subclasses below change one thing."""

    def __init__(self, inner: ThreadCollective) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        return self.inner.gather(data, dst=dst, max_size=max_size)

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        return self.inner.broadcast(data, src=src)


class DiesAfterCommit(Wrapped):
    """Rank 0's collective: it dies right after the manifest is durable, before telling anyone the outcome."""

    def __init__(self, inner: ThreadCollective) -> None:
        super().__init__(inner)
        self.broadcasts = 0

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        self.broadcasts += 1
        if self.broadcasts == 2:  # the first is the lock's outcome, the second the commit's
            self.inner.abandon()
            raise CollectiveError("rank 0 died after the commit")
        return self.inner.broadcast(data, src=src)


def _write(root: Path, rank: int, collective: object) -> str:
    w = ckptfmt.open_writer(root, profile="weights", collective=collective)  # type: ignore[arg-type]
    lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
    w.write_tensor("weights", "emb", FULL[lo:hi], global_shape=FULL.shape, offsets=(lo, 0))
    return w.commit()


def test_a_rank_that_loses_the_coordinator_after_reporting_deletes_nothing(tmp_path: Path) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        return _write(tmp_path, rank, DiesAfterCommit(collective) if rank == 0 else collective)

    results = run_ranks(4, body, timeout=5.0)
    assert all(isinstance(results[r], CollectiveError) for r in (1, 2, 3)), results
    # The manifest was durable before rank 0 "died": the checkpoint is committed, and whole.
    report = ckptfmt.verify(tmp_path)
    assert report.ok, [str(p) for p in report.problems]
    np.testing.assert_array_equal(ckptfmt.open(tmp_path).read_tensor("weights", "emb"), FULL)
    assert results[0] == ckptfmt.open(tmp_path).id  # the coordinator's own save succeeded (COM-20)


def test_a_coordinator_whose_gather_fails_releases_its_lock_and_files(tmp_path: Path) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        w = ckptfmt.open_writer(tmp_path, profile="weights", collective=collective)
        lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
        w.write_tensor("weights", "emb", FULL[lo:hi], global_shape=FULL.shape, offsets=(lo, 0))
        if rank == 1:
            collective.abandon()  # dies before the gather
            return "gone"
        return w.commit()

    results = run_ranks(2, body, timeout=5.0)  # rows 0-6 of 10: the save could not have committed anyway
    assert isinstance(results[0], CollectiveError)
    assert not (tmp_path / LOCK_NAME).exists()
    assert not any(p.name.startswith("r00000") for p in tmp_path.rglob("*.safetensors"))  # rank 0's own files
    # the same live process may save there again at once (before the fix: CheckpointLockedError)
    with ckptfmt.open_writer(tmp_path, profile="weights", overwrite=True) as w:
        w.write_tensor("weights", "emb", FULL)
    assert ckptfmt.verify(tmp_path).ok


class SendsInstead(Wrapped):
    """A rank's collective that sends ``payload`` in place of its report (a buggy or hostile rank)."""

    def __init__(self, inner: ThreadCollective, payload: bytes) -> None:
        super().__init__(inner)
        self.payload = payload

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        return self.inner.gather(self.payload, dst=dst, max_size=max_size)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff not json",
        b"[1, 2]",
        b'{"ok": {}}',  # success without its records
        b'{"ok": {"result": 7}}',
        b'{"ok": {"result": "{\\"rank\\": 1}"}}',
        b'{"error": [1, 2]}',
        b'{"ok": {"result": "{\\"rank\\":0,\\"files\\":[],\\"chunks\\":[],\\"contexts\\":{},\\"tensor_fields\\":[]}"}}',
    ],
    ids=[
        "not-json",
        "not-an-object",
        "no-result",
        "result-not-text",
        "result-malformed",
        "error-malformed",
        "other-rank",
    ],
)
def test_a_malformed_report_fails_the_save_on_every_rank_with_a_library_error(tmp_path: Path, payload: bytes) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        return _write(tmp_path, rank, SendsInstead(collective, payload) if rank == 1 else collective)

    results = run_ranks(4, body, timeout=5.0)
    assert all(isinstance(r, CheckpointError) for r in results), results  # nobody hangs, nothing raw escapes
    assert "rank 1" in str(results[0])
    assert not (tmp_path / "manifest.json").exists() and not (tmp_path / LOCK_NAME).exists()


def test_ranks_that_do_not_share_storage_commit_nothing(tmp_path: Path) -> None:
    """Each rank writes its own directory (a per-node disk): every rank's write succeeds, the commit must not."""

    def body(rank: int, collective: ThreadCollective) -> str:
        return _write(tmp_path / f"node-{rank}", rank, collective)

    results = run_ranks(4, body, timeout=5.0)
    assert all(isinstance(r, MissingFileError) for r in results), results
    assert "same storage" in str(results[0]) and results[0].requirement == "COM-21"  # type: ignore[union-attr]
    assert not (tmp_path / "node-0" / "manifest.json").exists()


class LiesAboutADigest(SendsInstead):
    """A rank whose report claims another digest for its first file (its bytes are on disk as written)."""

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        status = json.loads(data)
        result = json.loads(status["ok"]["result"])
        algorithm = result["files"][0]["digest"].partition(":")[0]
        result["files"][0]["digest"] = f"{algorithm}:" + "0" * len(result["files"][0]["digest"].partition(":")[2])
        status["ok"]["result"] = json.dumps(result)
        return self.inner.gather(json.dumps(status).encode(), dst=dst, max_size=max_size)


def test_a_rank_reporting_a_false_digest_is_caught_at_commit(tmp_path: Path) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        return _write(tmp_path, rank, LiesAboutADigest(collective, b"") if rank == 2 else collective)

    results = run_ranks(4, body, timeout=5.0)
    assert all(isinstance(r, DigestMismatchError) for r in results), results
    assert "rank 2 reported" in str(results[0])
    assert not (tmp_path / "manifest.json").exists()
