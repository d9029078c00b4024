"""A save over several stores reports through each store's leader (issue 42; spec/commit.md COM-24).

Ranks are threads on two nodes of four ranks each, every node its own memory slot. Each rank sends its records to
its node's leader; the leader checks its store's files and sends one part for its store to rank 0. Rank 0 takes in
one part per store carrying records (the others' contributions are empty), a part that speaks for another store is
refused naming its sender, and a store lacking a file fails the save before any store commits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rank_threads import run_threads

from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import CheckpointError, MalformedMessageError, MissingFileError, UsageError
from ckptfmt.storage.local import IN_PLACE_MARKER
from ckptfmt.storage.slot import SlotStore
from ckptfmt.store_reports import read_store_parts
from ckptfmt.writer import CheckpointWriter

NODES = (0, 0, 0, 0, 1, 1, 1, 1)  # the store of each rank
TIMEOUT = 20.0
ROWS = 4


class Recording(ThreadCollective):
    """A rank of a thread group that keeps the length of every part a gather delivers to it; ``swap`` replaces
    its own contribution to the first gather after the lock round (the reports' round)."""

    def __init__(self, inner: ThreadCollective, swap: bytes | None = None) -> None:
        super().__init__(inner.rank, inner._shared)
        self.parts: list[list[int]] = []
        self.swap = swap
        self.gathers = 0

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        self.gathers += 1
        if self.swap is not None and self.gathers == 2:
            data = self.swap
        got = super().gather(data, dst=dst, max_size=max_size)
        if got is not None:
            self.parts.append([len(p) for p in got])
        return got


def save(tmp: Path, group: list[ThreadCollective], *, before_commit: dict[int, object] | None = None) -> list[object]:
    """Every rank writes two tensors' rows into its node's slot and commits; each rank's id or exception."""
    slots = [tmp / f"node{n}" for n in NODES]

    def body(rank: int) -> object:
        slots[rank].mkdir(exist_ok=True)
        writer = CheckpointWriter(
            SlotStore(str(slots[rank])),
            profile="weights",
            overwrite=True,
            collective=group[rank],
            store_of_rank=NODES,
            target_file_size=1,  # every tensor its own file
        )
        for i in range(2):
            rows = np.full((ROWS, 8), rank * 10 + i, dtype=np.float32)
            writer.write_tensor("weights", f"w{i}", rows, global_shape=(ROWS * 8, 8), offsets=(ROWS * rank, 0))
        writer.flush()
        hook = (before_commit or {}).get(rank)
        if callable(hook):
            hook(slots[rank])
        return writer.commit()

    return run_threads(len(NODES), body, 3 * TIMEOUT)


def test_rank_0_takes_in_one_part_per_store_and_every_store_commits_the_same_manifest(tmp_path: Path) -> None:
    group = [Recording(c) for c in ThreadCollective.group(len(NODES), timeout=TIMEOUT)]
    ids = save(tmp_path, list(group))
    assert len(set(ids)) == 1 and isinstance(ids[0], str), ids
    manifests = {(tmp_path / f"node{n}" / "manifest.json").read_bytes() for n in (0, 1)}
    assert len(manifests) == 1
    reports = group[0].parts[1]  # the second gather: lock round, then the reports
    leaders = {0, 4}
    assert all(size > 500 for r, size in enumerate(reports) if r in leaders), reports
    assert all(size <= 16 for r, size in enumerate(reports) if r not in leaders), reports  # nothing but "ok: null"


def test_a_leader_that_speaks_for_another_store_is_refused_naming_it_and_nothing_commits(tmp_path: Path) -> None:
    group = list(ThreadCollective.group(len(NODES), timeout=TIMEOUT))
    group[4] = Recording(group[4], swap=b'{"ok":{"reports":{"0":{"result":"{}"},"4":{"result":"{}"}}}}')
    out = save(tmp_path, group)
    for exc in out:
        assert isinstance(exc, CheckpointError) and "rank 4" in str(exc) and "within" not in str(exc), out
    for n in (0, 1):
        assert not (tmp_path / f"node{n}" / "manifest.json").exists()


def test_a_store_missing_a_file_fails_the_save_before_any_store_commits(tmp_path: Path) -> None:
    def lose_a_file(slot: Path) -> None:
        (next(p for p in sorted(slot.rglob("*.safetensors")) if "r00006" in p.name)).unlink()

    group = list(ThreadCollective.group(len(NODES), timeout=TIMEOUT))
    out = save(tmp_path, group, before_commit={6: lose_a_file})
    for exc in out:
        assert isinstance(exc, MissingFileError) and exc.requirement == "COM-21", out
        assert "rank 6" in str(exc)
    for n in (0, 1):
        # neither store holds a manifest: node 0's leader never wrote one, as the merge never happened
        assert not (tmp_path / f"node{n}" / "manifest.json").exists()
        assert not (tmp_path / f"node{n}" / ".ckptfmt-lock").exists()


def test_a_rank_that_fails_fails_every_rank_and_leaves_no_manifest(tmp_path: Path) -> None:
    group = list(ThreadCollective.group(len(NODES), timeout=TIMEOUT))

    def body(rank: int) -> object:
        slot = tmp_path / f"node{NODES[rank]}"
        slot.mkdir(exist_ok=True)
        writer = CheckpointWriter(
            SlotStore(str(slot)), profile="weights", overwrite=True, collective=group[rank], store_of_rank=NODES
        )
        writer.write_tensor("weights", "w", np.zeros((ROWS, 8), np.float32), global_shape=(ROWS * 8, 8),
                            offsets=(ROWS * rank, 0))  # fmt: skip
        if rank == 5:
            writer.abort()  # a rank that does not lead fails before it reports
            return None
        return writer.commit()

    out = run_threads(len(NODES), body, 3 * TIMEOUT)
    for rank, exc in enumerate(out):
        if rank != 5:
            assert isinstance(exc, CheckpointError) and "within" not in str(exc), out
    for n in (0, 1):
        slot = tmp_path / f"node{n}"
        assert not (slot / "manifest.json").exists()
        left = [p for p in slot.rglob("*") if p.is_file() and p.name != IN_PLACE_MARKER]  # the slot's own marker
        assert left == []  # every rank deleted its own files, each leader its lock


@pytest.mark.parametrize(
    ("parts", "blamed"),
    [
        ([{"reports": {"0": 1, "1": 2}}, None, {"reports": {"2": 3}}], None),  # sound
        ([{"reports": {"0": 1}}, None, {"reports": {"2": 3}}], "rank 0"),  # leaves its rank 1 out
        ([{"reports": {"0": 1, "1": 2, "2": 3}}, None, {"reports": {"2": 3}}], "rank 0"),  # speaks for rank 2
        ([{"reports": {"0": 1, "1": 2}}, {"reports": {"1": 2}}, {"reports": {"2": 3}}], "rank 1"),  # not a leader
        ([{"reports": {"0": 1, "1": 2}}, None, [3]], "rank 2"),  # not an object
        ([{"reports": {"0": 1, "1": 2}, "x": 1}, None, {"reports": {"2": 3}}], "rank 0"),  # a member too many
        ([{"reports": {"0": 1, "01": 2}}, None, {"reports": {"2": 3}}], "rank 0"),  # a rank spelt twice
    ],
)
def test_the_coordinator_reads_store_parts_as_hostile_input(parts: list[object], blamed: str | None) -> None:
    stores = (0, 0, 1)
    if blamed is None:
        assert read_store_parts(parts, stores) == [1, 2, 3]
        return
    with pytest.raises(MalformedMessageError, match=blamed):
        read_store_parts(parts, stores)


def test_a_save_over_several_stores_needs_a_peer_channel(tmp_path: Path) -> None:
    class GatherOnly:
        rank, world_size = 0, 2

        def broadcast(self, data: bytes | None, *, src: int) -> bytes:
            raise AssertionError("not reached")

        def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
            raise AssertionError("not reached")

    with pytest.raises(UsageError, match="PeerChannel"):
        CheckpointWriter(SlotStore(str(tmp_path)), profile="weights", collective=GatherOnly(), store_of_rank=(0, 1))
