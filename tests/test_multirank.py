"""Several ranks writing one checkpoint through the library API (ranks as threads, ThreadCollective)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rank_threads import run_ranks
from safetensors.numpy import load_file

import ckptfmt
from ckptfmt import CollectiveError, ThreadCollective
from ckptfmt.errors import CheckpointError, CheckpointLockedError, ChunkLayoutError
from ckptfmt.paths import LOCK_NAME

FULL = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
BOUNDS = [0, 3, 6, 8, 10]  # uneven row shards


def write_rank(root: Path | str, rank: int, collective: ThreadCollective) -> str:
    with ckptfmt.open_writer(root, profile="weights", collective=collective, target_file_size=64) as w:
        lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
        w.write_tensor("weights", "emb", FULL[lo:hi], global_shape=FULL.shape, offsets=(lo, 0))
        if rank == 1:  # a replicated tensor written once, by a rank other than the coordinator
            w.write_tensor("weights", "bias", np.ones(6, np.float32))
        w.write_context("data", {"epoch": 0, "global_sample_offset": 0}) if rank == 2 else None
    assert w.checkpoint_id is not None
    return w.checkpoint_id


def test_four_ranks_commit_one_checkpoint(store_url: str) -> None:
    """Every rank talks to the store itself (on S3, the moto endpoint): no shared file system needed."""
    results = run_ranks(4, lambda r, c: write_rank(store_url, r, c))
    assert len(set(results)) == 1 and isinstance(results[0], str)  # the same id on every rank
    ckpt = ckptfmt.open(store_url)
    assert ckpt.id == results[0]
    assert np.array_equal(ckpt.read_tensor("weights", "emb"), FULL)
    assert np.array_equal(ckpt.read_tensor("weights", "bias"), np.ones(6, np.float32))
    assert ckpt.read_context("data")["epoch"] == 0
    paths = {f.path for f in ckpt.manifest.files}
    assert {p.split("/")[1][:6] for p in paths if p.endswith(".safetensors")} == {
        "r00000",
        "r00001",
        "r00002",
        "r00003",
    }
    assert "data/context.r00002.msgpack" in paths
    assert ckpt.verify().ok
    assert LOCK_NAME not in ckpt.store.list()


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_failing_rank_aborts_every_rank_with_the_same_error(tmp_path: Path) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        with ckptfmt.open_writer(tmp_path, profile="weights", collective=collective) as w:
            lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
            w.write_tensor("weights", "emb", FULL[lo:hi], global_shape=FULL.shape, offsets=(lo, 0))
            if rank == 3:
                raise ChunkLayoutError("rank 3 could not shard", tensor="emb")
        return "committed"

    results = run_ranks(4, body)
    assert all(isinstance(r, CheckpointError) for r in results)
    assert {type(r) for r in results[:3]} == {ChunkLayoutError}
    assert all("rank 3 could not shard" in str(r) for r in results)
    assert _leftovers(tmp_path) == []


def test_chunks_that_do_not_tile_across_ranks_are_refused_everywhere(tmp_path: Path) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        with ckptfmt.open_writer(tmp_path, profile="weights", collective=collective) as w:
            if rank != 2:  # rank 2's rows are missing: a gap only the coordinator can see
                lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
                w.write_tensor("weights", "emb", FULL[lo:hi], global_shape=FULL.shape, offsets=(lo, 0))
            else:
                w.write_tensors("weights", {})
        return "committed"

    results = run_ranks(4, body)
    assert all(isinstance(r, ChunkLayoutError) and "gap" in str(r) for r in results)
    assert _leftovers(tmp_path) == []
    with pytest.raises(ckptfmt.CheckpointNotFoundError):
        ckptfmt.open(tmp_path)


def test_a_vanished_rank_makes_the_others_fail_not_hang(tmp_path: Path) -> None:
    def body(rank: int, collective: ThreadCollective) -> str:
        w = ckptfmt.open_writer(tmp_path, profile="weights", collective=collective)
        lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
        w.write_tensor("weights", "emb", FULL[lo:hi], global_shape=FULL.shape, offsets=(lo, 0))
        if rank == 1:
            collective.abandon()  # as if the process died: it never reaches the commit
            return "gone"
        return w.commit()

    results = run_ranks(4, body, timeout=5.0)
    assert results[1] == "gone"
    assert all(isinstance(results[r], CollectiveError) for r in (0, 2, 3))
    with pytest.raises(CheckpointError):  # nothing committed: incomplete (rank 1's file) or empty
        ckptfmt.open(tmp_path)


def test_a_lock_held_elsewhere_refuses_every_rank(tmp_path: Path) -> None:
    holder = ckptfmt.open_writer(tmp_path, profile="weights")
    try:
        results = run_ranks(3, lambda r, c: ckptfmt.open_writer(tmp_path, profile="weights", collective=c))
        assert all(isinstance(r, CheckpointLockedError) for r in results)
    finally:
        holder.abort()


def _peak_rss_mib(args: list[str]) -> float:
    """Peak resident memory of one ``ckpt`` subprocess (its own, measured by the kernel: ru_maxrss)."""
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    ckpt = str(Path(sys.executable).with_name("ckpt"))
    out = subprocess.run([sys.executable, "-c", code, ckpt, *args], check=True, capture_output=True, text=True)
    return int(out.stdout.strip()) / 1024


def test_export_of_a_four_rank_checkpoint_streams_tensor_by_tensor(tmp_path: Path) -> None:
    """Consolidation for export never holds the model: peak memory grows with the largest tensor, not the total."""
    rows, cols, count = 1024, 2048, 12  # 12 tensors of 8 MiB, each sharded over 4 ranks: 96 MiB in all
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.w": rng.standard_normal((rows, cols), dtype=np.float32) for i in range(count)}
    src = tmp_path / "src"

    def body(rank: int, collective: ThreadCollective) -> str:
        with ckptfmt.open_writer(src, profile="weights", collective=collective) as w:
            lo, hi = rank * rows // 4, (rank + 1) * rows // 4
            for name, full in tensors.items():
                w.write_tensor("weights", name, full[lo:hi], global_shape=full.shape, offsets=(lo, 0))
        return "ok"

    assert run_ranks(4, body) == ["ok"] * 4
    baseline = _peak_rss_mib(["inspect", str(src)])
    export = _peak_rss_mib(["convert", str(src), str(tmp_path / "hf"), "--to", "hf"])
    total_mib = count * rows * cols * 4 / 2**20
    print(f"[export RSS] baseline {baseline:.0f} MiB, export {export:.0f} MiB, checkpoint {total_mib:.0f} MiB")
    assert export - baseline < 3 * 8 + 16  # a tensor, its chunk buffers and the write slice; not 96 MiB
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(np.array_equal(exported[n], t) for n, t in tensors.items())
