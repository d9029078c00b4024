"""What rank 0 takes in during a restore across nodes (issue 42): per-node completeness summaries, not file lists.

Ranks are threads on two nodes, each its own memory directory; every byte that reaches rank 0 through a gather is
counted. With 2 or 20 files per writer rank, rank 0 takes in the same bytes: the summaries name ranges of writer
ranks, the needs ranges of writer ranks, and the manifest (the one record that lists files) is read from rank 0's
own node's memory, never sent to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from rank_threads import run_threads

from ckptfmt.collective import ThreadCollective
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier.agreed import AgreedRestore
from ckptfmt.tier.binding import SlotBinding, normalize_run_url, run_identity
from ckptfmt.tier.nodes import NodeMap
from ckptfmt.tier.ring import MemoryTier
from ckptfmt.tier.summary import OTHER, to_ranges
from ckptfmt.writer import CheckpointWriter
from tests.test_agreed_restore import JOIN_TIMEOUT, ROWS, TIMEOUT, tiers_of

NODES = ("A", "A", "B", "B")


class Counting(ThreadCollective):
    """A rank of a thread group that counts the bytes each gather delivers to it (as its destination)."""

    def __init__(self, inner: ThreadCollective) -> None:
        super().__init__(inner.rank, inner._shared)
        self.inbound = 0

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        got = super().gather(data, dst=dst, max_size=max_size)
        if got is not None:
            self.inbound += sum(len(part) for part in got)
        return got


def many_files_snapshot(tmp: Path, files: int) -> str:
    """A spread snapshot at step 3 where each rank writes ``files`` tensors, each its own file."""
    tiers = tiers_of(tmp, ("A", "B"))
    run = str(tmp / "run")
    group = ThreadCollective.group(len(NODES), timeout=TIMEOUT)
    binding = SlotBinding(
        run_id=run_identity(run), run_dir=normalize_run_url(run), node="A", world_size=4, step=3, nodes=NODES
    )

    def write(rank: int) -> str:
        writer = CheckpointWriter(
            SlotStore(tiers[NODES[rank]].writable_slot(0)),
            profile="weights",
            overwrite=True,
            collective=group[rank],
            metadata=binding.to_metadata(),
            store_of_rank=NodeMap(nodes=NODES).store_of_rank(),
            target_file_size=1,  # every tensor its own file
        )
        for i in range(files):
            rows = np.full((ROWS, 8), rank * 100 + i, dtype=np.float32)
            writer.write_tensor("weights", f"w{i}", rows, global_shape=(ROWS * 4, 8), offsets=(ROWS * rank, 0))
        return writer.commit()

    ids = run_threads(4, write, JOIN_TIMEOUT)
    assert len(set(ids)) == 1 and isinstance(ids[0], str), ids
    return str(ids[0])


def restore_inbound(tmp: Path, files: int) -> tuple[int, int, list[Any]]:
    """Rank 0's inbound bytes through the restore's gathers (options, then a fetch of every file), the number of
    data files per rank, and what each rank read of tensor ``w0``."""
    many_files_snapshot(tmp, files)
    tiers = {n: t for n, t in tiers_of(tmp, ("A", "B")).items()}
    group = [Counting(c) for c in ThreadCollective.group(4, timeout=TIMEOUT)]
    run = str(tmp / "run")

    def body(rank: int) -> Any:
        agreed = AgreedRestore(
            tiers[NODES[rank]],
            collective=group[rank],
            channel=group[rank],
            nodes=NodeMap(nodes=NODES),
            node=NODES[rank],
            run_id=run_identity(run),
            run_dir=run,
            rank=rank,
        )
        (option,) = agreed.options()
        manifest = parse_manifest(option.manifest_bytes)
        other = (rank + 2) % 4  # each rank reads the rows another node's rank wrote
        wanted = {f.path for f in manifest.files if f"r{other:05d}-" in f.path}
        fetched = agreed.fetch(option, wanted)
        from ckptfmt.reader import Checkpoint

        ckpt = Checkpoint(fetched.store, manifest, option.manifest_bytes)
        return float(ckpt.read_slice("weights", "w0", (ROWS * other, 0), (ROWS, 8))[0, 0]), len(wanted)

    out = run_threads(4, body, JOIN_TIMEOUT)
    return group[0].inbound, out[0][1], out


def test_rank_0_takes_in_the_same_bytes_whatever_the_files_per_rank(tmp_path: Path) -> None:
    few, few_files, got_few = restore_inbound(tmp_path / "few", 2)
    many, many_files, got_many = restore_inbound(tmp_path / "many", 20)
    assert (few_files, many_files) == (2, 20)
    assert [g[0] for g in got_few] == [g[0] for g in got_many] == [200.0, 300.0, 0.0, 100.0]
    print(f"rank 0 inbound: {few} bytes with 2 files per rank, {many} with 20")
    assert few == many, (few, many)


def test_at_1024_nodes_of_8_ranks_rank_0_takes_in_less_than_a_megabyte() -> None:
    """The coordinator's part of the exchanges, at 1,024 nodes of 8 ranks (each node holding its own ranks' files and
    a replica of the next node's; node 0 back empty): the summaries, each rank's needs, the manifests' round, framed
    as ckptfmt.decide frames them. The manifest, which lists every file, is the one record not counted: rank 0 reads
    it from its own node's memory, or takes in one copy of it from one holder (here, asked of node 1's leader)."""
    nodes, per = 1024, 8
    world = nodes * per
    names = tuple(f"n{i:04d}" for i in range(nodes) for _ in range(per))
    ckpt_id = "sha256:" + "ab" * 32
    agreed = AgreedRestore(
        MemoryTier("/nonexistent", "/tmp/run"),  # never read: the coordinator's own node holds nothing here
        collective=None,
        channel=None,
        nodes=NodeMap(nodes=names),
        node=names[0],
        run_id="x",
        run_dir="/tmp/run",
        rank=0,
    )
    summaries: list[object] = []
    for rank in range(world):
        node = rank // per
        if rank % per:
            summaries.append(None)  # only a node's leader speaks for it
            continue
        held = to_ranges(
            [*range(node * per, node * per + per), *range((node + 1) % nodes * per, ((node + 1) % nodes + 1) * per)]
        )
        summary = {"checkpoint_id": ckpt_id, "step": 7, "writers": [[OTHER, world]], "held": [list(r) for r in held]}
        if node == 1:
            summary["held"] = [[OTHER, 0], *summary["held"]]  # type: ignore[list-item]
        summaries.append({"summaries": [summary] if node else []})
    choice = agreed._choose(summaries)
    assert choice["chosen"] == [[7, ckpt_id]] and choice["ask"] == {ckpt_id: per}  # type: ignore[index]
    needs = [[[r, r + 1]] for r in range(world)]  # each rank reads its own rows
    manifests_round = [{} for _ in range(world)]
    inbound = sum(len(_framed(v)) for round_ in (summaries, needs, manifests_round) for v in round_)
    print(f"rank 0 inbound at {world} ranks: {inbound:,} bytes")
    assert inbound < 1 << 20


def _framed(value: object) -> bytes:
    return json.dumps({"ok": value}, sort_keys=True, separators=(",", ":")).encode()
