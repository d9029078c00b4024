"""Replicas and the restore across nodes, without torch: node maps, the wire, holdings and the plan (spec/memory.md).

Ranks are threads (:class:`ThreadCollective`, which is also a :class:`PeerChannel`); a node is a directory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rank_threads import run_threads

import ckptfmt
from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import CheckpointError, CollectiveError, DigestMismatchError, ManifestError
from ckptfmt.manifest import checkpoint_id
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier.agreed import AgreedRestore
from ckptfmt.tier.binding import SlotBinding, normalize_run_url, run_identity
from ckptfmt.tier.holdings import Holding, complete, node_holdings
from ckptfmt.tier.nodes import NodeMap
from ckptfmt.tier.replica import Replicator, peer_dir
from ckptfmt.tier.ring import MemoryTier
from ckptfmt.tier.summary import choose, rank_groups, summarize, to_ranges
from ckptfmt.tier.wire import PIECE_BYTES, receive_files, send_files
from ckptfmt.writer import CheckpointWriter

RUN = "/tmp/ckptfmt-replica-test-run"
JOIN_TIMEOUT = 60.0  # a rank still running this long after its turn to be joined has hung


# ---------------------------------------------------------------- node maps


@pytest.mark.parametrize(
    "nodes",
    [("A", "A", "B", "B"), ("B", "A", "B", "A"), ("A", "B", "C"), ("A", "A", "A", "B"), ("X", "Y", "Y", "Y", "Z")],
)
def test_a_replica_is_never_on_its_original_node_and_receivers_are_spread(nodes: tuple[str, ...]) -> None:
    m = NodeMap(nodes=nodes)
    partners = m.partners()
    assert set(partners) == set(range(len(nodes)))
    for src, dsts in partners.items():
        assert len(dsts) == 1 and nodes[src] != nodes[dsts[0]]
    # no rank receives more than its node's share: ceil(senders / receivers) of the sending node
    for node in m.names:
        for rank in m.ranks_of(node):
            assert len(m.sources_of(rank)) <= max(len(m.ranks_of(n)) for n in m.names)


def test_one_node_has_no_partners_and_stores_by_node() -> None:
    assert NodeMap(nodes=("A", "A")).partners() == {}
    assert NodeMap(nodes=("B", "A", "B")).store_of_rank() == (0, 1, 0)
    assert NodeMap(nodes=("B", "A", "B")).leader("B") == 0


# ---------------------------------------------------------------- a spread snapshot


def spread_snapshot(tmp: Path, nodes: tuple[str, ...], step: int = 7, slot: int = 0) -> tuple[MemoryTier, ...]:
    """Every rank writes its rows of one tensor into its node's slot; one manifest, committed on each node."""
    names = tuple(dict.fromkeys(nodes))
    tiers = {n: MemoryTier(tmp / n, RUN) for n in names}
    for tier in tiers.values():
        tier.ensure()
    group = ThreadCollective.group(len(nodes))
    nmap = NodeMap(nodes=nodes)
    binding = SlotBinding(
        run_id=run_identity(RUN),
        run_dir=normalize_run_url(RUN),
        node=nodes[0],
        world_size=len(nodes),
        step=step,
        nodes=nodes,
    )

    def write(rank: int) -> str:
        store = SlotStore(tiers[nodes[rank]].writable_slot(slot))
        writer = CheckpointWriter(
            store,
            profile="weights",
            overwrite=True,
            collective=group[rank],
            metadata=binding.to_metadata(),
            store_of_rank=nmap.store_of_rank(),
        )
        rows = np.full((4, 8), rank * 100 + step, dtype=np.float32)
        writer.write_tensor("weights", "w", rows, global_shape=(4 * len(nodes), 8), offsets=(4 * rank, 0))
        return writer.commit()

    ids = run_threads(len(nodes), write, JOIN_TIMEOUT)
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == 1, ids
    return tuple(tiers[n] for n in names)


def test_a_spread_snapshot_has_one_manifest_on_every_node_and_each_node_only_its_ranks_files(tmp_path: Path) -> None:
    a, b = spread_snapshot(tmp_path, ("A", "A", "B", "B"))
    ma, mb = (Path(t.slot_path(0), "manifest.json").read_bytes() for t in (a, b))
    assert ma == mb
    assert sorted(os.listdir(Path(a.slot_path(0), "weights"))) == [
        "r00000-00000.safetensors",
        "r00001-00000.safetensors",
    ]
    assert sorted(os.listdir(Path(b.slot_path(0), "weights"))) == [
        "r00002-00000.safetensors",
        "r00003-00000.safetensors",
    ]
    binding = SlotBinding.from_metadata(parse_manifest(ma).metadata)
    assert binding.nodes == ("A", "A", "B", "B")
    # alone, a node's slot is refused by a reader: never half-loaded
    report = ckptfmt.verify(a.slot_path(0))
    assert not report.ok and any("r00002" in str(p) for p in report.problems)


def test_a_binding_with_a_malformed_node_list_is_refused() -> None:
    meta = SlotBinding(run_id="r", run_dir="/x", node="A", world_size=2, step=1, nodes=("A", "B")).to_metadata()
    for bad in ('["A"]', "A,B", '["A", ""]', "[1, 2]"):
        with pytest.raises(ManifestError, match="nodes"):
            SlotBinding.from_metadata({**meta, "ckptfmt.memory.nodes": bad})


# ---------------------------------------------------------------- the wire


def transfer(tmp: Path, tamper: Callable[[bytes], bytes] | None = None, paths: list[str] | None = None) -> Any:
    (a,) = spread_snapshot(tmp, ("A",))
    source = SlotStore(a.slot_path(0))
    manifest = source.read("manifest.json")
    files = paths if paths is not None else [f.path for f in parse_manifest(manifest).files]
    group = ThreadCollective.group(2, timeout=1)

    class Tampering:
        rank = 0

        def send(self, data: bytes, *, dst: int, tag: int) -> None:
            group[0].send(tamper(data) if tamper is not None else data, dst=dst, tag=tag)

        def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
            return group[0].recv(src=src, tag=tag, max_size=max_size)

    dest = SlotStore(tmp / "dest")

    def side(rank: int) -> Any:
        if rank == 0:
            return send_files(Tampering(), dst=1, tag=3, source=source, manifest_bytes=manifest, paths=files)
        return receive_files(group[1], src=0, tag=3, destination=dest)

    return run_threads(2, side, JOIN_TIMEOUT), dest, manifest


def test_files_arrive_whole_and_verified(tmp_path: Path) -> None:
    (sent, received), dest, manifest = transfer(tmp_path)
    assert received.checkpoint_id == checkpoint_id(manifest) and sent == received.nbytes > 0
    for record in received.files:
        assert dest.read(record.path) == SlotStore(MemoryTier(tmp_path / "A", RUN).slot_path(0)).read(record.path)


def test_a_damaged_piece_is_caught_and_its_file_never_published(tmp_path: Path) -> None:
    def flip(data: bytes) -> bytes:
        if len(data) > 100 and data[0] == 0:  # a piece (status byte 0), not the header or the manifest
            return data[:-1] + bytes([data[-1] ^ 1])
        return data

    (_, received), dest, _ = transfer(tmp_path, flip)
    assert isinstance(received, DigestMismatchError) and "arrived damaged" in str(received)
    assert not any(p.endswith(".safetensors") for p in dest.list())


def test_a_manifest_that_does_not_hash_to_the_announced_id_is_refused(tmp_path: Path) -> None:
    def swap(data: bytes) -> bytes:
        return data.replace(b'"profile":"weights"', b'"profile":"weights" ') if data.startswith(b"{") else data

    (_, received), dest, _ = transfer(tmp_path, swap)
    assert isinstance(received, DigestMismatchError) and "hashes to" in str(received)
    assert dest.list() == {}


def test_a_path_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    def lie(data: bytes) -> bytes:
        return data.replace(b"weights/r00000-00000.safetensors", b"../../etc/passwd") if b'"paths"' in data else data

    (_, received), dest, _ = transfer(tmp_path, lie)
    assert isinstance(received, CollectiveError) and "does not list" in str(received)
    assert dest.list() == {}


def test_a_transfer_cut_half_way_leaves_nothing_usable(tmp_path: Path) -> None:
    cut = {"pieces": 0}

    def die(data: bytes) -> bytes:
        if data[:1] == b"\x00" and len(data) > 100:
            cut["pieces"] += 1
            raise CollectiveError("sender killed")  # the sender's process is gone mid-file
        return data

    (sent, received), dest, _ = transfer(tmp_path, die)
    assert isinstance(sent, CollectiveError) and isinstance(received, CollectiveError)  # the receiver times out
    assert not any(p.endswith(".safetensors") for p in dest.list()) and "manifest.json" not in dest.list()


def test_a_large_file_travels_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptfmt.tier.wire as wire

    monkeypatch.setattr(wire, "PIECE_BYTES", 64)
    (_, received), _, _ = transfer(tmp_path)
    assert received.nbytes > 64 and PIECE_BYTES > 64


# ---------------------------------------------------------------- replicas, holdings, the agreed restore


def replicate(tiers: tuple[MemoryTier, ...], nodes: tuple[str, ...], round_no: int = 0) -> list[Any]:
    group = ThreadCollective.group(len(nodes), timeout=10)
    nmap = NodeMap(nodes=nodes)
    by_node = {t.memory_dir.name: t for t in tiers}

    def run(rank: int) -> Any:
        tier = by_node[nodes[rank]]
        slot = tier.slot_path(0)
        manifest = SlotStore(slot).read("manifest.json")
        mine = [p for p in SlotStore(slot).list() if p.startswith(f"weights/r{rank:05d}")]
        rep = Replicator(tier, group[rank], nmap, rank)
        rep.start(round_no, step=7, slot_path=slot, manifest_bytes=manifest, files=mine)
        result = rep.wait()
        rep.close()
        return result

    return run_threads(len(nodes), run, JOIN_TIMEOUT)


def test_replicas_land_on_the_partner_node_and_complete_the_checkpoint_there(tmp_path: Path) -> None:
    nodes = ("A", "A", "B", "B")
    a, b = spread_snapshot(tmp_path, nodes)
    results = replicate((a, b), nodes)
    assert all(r is not None and not isinstance(r, BaseException) for r in results), results
    assert Path(peer_dir(a, 2, 0), "weights", "r00002-00000.safetensors").exists()
    assert Path(peer_dir(b, 0, 0), "weights", "r00000-00000.safetensors").exists()
    # node B lost: A alone holds every file of the checkpoint
    held, manifests = node_holdings(a, node="A", run_id=run_identity(RUN), run_dir=RUN, slot_count=2)
    assert [(h.kind, h.step) for h in held] == [("slot", 7), ("peer", 7), ("peer", 7)]
    assert [s for s, _ in complete(held, manifests)] == [7]
    # without the copies, it does not
    assert complete([h for h in held if h.kind == "slot"], manifests) == []


def test_the_plan_fetches_each_writer_rank_once_per_node_from_a_holder_spreading_senders_and_receivers() -> None:
    """A holds rank 0 and 1's files in its slot and every rank's in a copy, B nothing: B's ranks receive every writer
    rank's files once, sent by A's ranks in turn and received by B's in turn; a rank that needs only its own rows
    fetches only that writer rank's files."""
    nodes = NodeMap(nodes=("A", "A", "B", "B"))
    manifest_doc = written_manifest(4)
    cid = checkpoint_id(manifest_doc)
    manifest = parse_manifest(manifest_doc)
    files = {f.path: f.size for f in manifest.files}
    on_a = {p: s for p, s in files.items() if "r00002" not in p and "r00003" not in p}
    held = [
        Holding(node="A", path="/a/slot-0", kind="slot", checkpoint_id=cid, step=1, files=on_a),
        Holding(node="A", path="/a/peer", kind="peer", checkpoint_id=cid, step=1, files=dict(files)),
        Holding(node="B", path="/b/slot-0", kind="slot", checkpoint_id=cid, step=1, files={}),
    ]
    assert complete(held, {cid: manifest_doc}) == [(1, cid)]
    groups = {cid: rank_groups(manifest_doc)}
    summaries = {n: summarize([h for h in held if h.node == n], groups) for n in nodes.names}
    assert choose(summaries) == [(1, cid)]
    agreed = AgreedRestore(
        MemoryTier("/nonexistent", RUN),
        collective=None,
        channel=None,
        nodes=nodes,
        node="B",
        run_id="x",
        run_dir=RUN,
        rank=2,
    )
    agreed._held = {cid: {n: c.held for n, cs in summaries.items() for c in cs}}
    everything = {n: to_ranges(range(4)) for n in nodes.names}
    fetches = agreed._plan(cid, everything)
    assert sorted(f.writer for f in fetches) == [0, 1, 2, 3]  # B lacks every writer rank, A none: each sent once
    assert {f.dst for f in fetches} == {2, 3} and {f.src for f in fetches} == {0, 1}
    only = agreed._plan(cid, {"A": (), "B": to_ranges([2])})
    assert [f.writer for f in only] == [2]
    # held nowhere complete: no checkpoint to choose
    assert complete(held[:1], {cid: manifest_doc}) == []
    assert choose({"A": summarize(held[:1], groups)}) == []


def written_manifest(ranks: int) -> bytes:
    """The manifest of a checkpoint ``ranks`` ranks wrote (each one row of a tensor), as a writer commits it."""
    import tempfile

    root = tempfile.mkdtemp()
    group = ThreadCollective.group(ranks)

    def write(rank: int) -> None:
        with CheckpointWriter(SlotStore(root), profile="weights", collective=group[rank]) as w:
            w.write_tensor("weights", "w", np.zeros((1, 1), np.float32), global_shape=(ranks, 1), offsets=(rank, 0))

    run_threads(ranks, write, JOIN_TIMEOUT)
    return Path(root, "manifest.json").read_bytes()


def test_the_agreed_restore_gathers_what_a_node_lacks_and_falls_back_together_when_a_copy_is_bad(
    tmp_path: Path,
) -> None:
    """Node B comes back empty: its ranks get A's files over the channel. Then a byte flipped in the only holder
    of a file some rank needs: every rank passes over that checkpoint (the error is the same everywhere)."""
    nodes = ("A", "A", "B", "B")
    a, b = spread_snapshot(tmp_path, nodes)
    replicate((a, b), nodes)
    import shutil

    shutil.rmtree(b.root)
    b.ensure()
    group = ThreadCollective.group(4, timeout=10)
    nmap = NodeMap(nodes=nodes)

    def restore(rank: int) -> Any:
        tier = a if nodes[rank] == "A" else b
        agreed = AgreedRestore(
            tier,
            collective=group[rank],
            channel=group[rank],
            nodes=nmap,
            node=nodes[rank],
            run_id=run_identity(RUN),
            run_dir=RUN,
            rank=rank,
        )
        options = agreed.options()
        option = options[0]
        needed = {f"weights/r{rank:05d}-00000.safetensors"}
        fetched = agreed.fetch(option, needed)
        ckpt = ckptfmt.reader.Checkpoint(fetched.store, parse_manifest(option.manifest_bytes), option.manifest_bytes)
        rows = ckpt.read_slice("weights", "w", (4 * rank, 0), (4, 8))
        return option.step, float(rows[0, 0]), fetched.sources(), fetched.bytes_moved

    got = run_threads(4, restore, JOIN_TIMEOUT)
    assert [g[1] for g in got] == [7.0, 107.0, 207.0, 307.0], got
    assert got[2][2]["weights/r00002-00000.safetensors"].startswith("peer:rank ")
    assert got[0][2]["weights/r00000-00000.safetensors"] == "memory"
    assert got[0][3] == got[2][3] > 0

    # A's copy of rank 2's file is the only one left: damage it, and every rank's fetch fails alike
    damaged = Path(peer_dir(a, 2, 0), "weights", "r00002-00000.safetensors")
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x20
    damaged.write_bytes(bytes(data))
    for fetched_dir in b.root.glob("fetched-*"):
        shutil.rmtree(fetched_dir)
    outcomes = run_threads(4, restore, JOIN_TIMEOUT)
    assert all(isinstance(o, CheckpointError) for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1 and "r00002" in str(outcomes[0])


def test_a_rank_failing_before_the_merge_commits_nothing_in_any_store_and_leaves_no_lock(tmp_path: Path) -> None:
    nodes = ("A", "A", "B", "B")
    group = ThreadCollective.group(4, timeout=10)
    nmap = NodeMap(nodes=nodes)
    roots = {n: tmp_path / n for n in ("A", "B")}

    def write(rank: int) -> str:
        writer = CheckpointWriter(
            SlotStore(roots[nodes[rank]]),
            profile="weights",
            collective=group[rank],
            store_of_rank=nmap.store_of_rank(),
        )
        writer.write_tensor("weights", "w", np.ones((1, 2), np.float32), global_shape=(4, 2), offsets=(rank, 0))
        if rank == 3:
            writer.abort()  # this rank fails after writing its file: every rank's save fails
            raise CollectiveError("rank 3 gave up")
        return writer.commit()

    outcomes = run_threads(4, write, JOIN_TIMEOUT)
    assert all(isinstance(o, CheckpointError) for o in outcomes), outcomes
    for root in roots.values():
        left = SlotStore(root).list() if root.exists() else {}
        assert "manifest.json" not in left and ".writer-lock" not in left, left
        assert not any(p.endswith(".safetensors") for p in left), left


def test_a_slow_partner_makes_every_rank_skip_a_replica_never_stall_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks on two nodes (threads); rank 1 receives nothing until step 7. The snapshots keep their pace: a
    round still running when the next snapshot commits is skipped by both ranks alike, and the copies that are
    made are whole."""
    import torch

    import ckptfmt.torch.memory as memory
    from ckptfmt.run import RunDirectory
    from ckptfmt.torch import ResumableSampler, api

    here = threading.local()
    monkeypatch.setattr(memory, "node_key", lambda: here.node)
    group = ThreadCollective.group(2, timeout=30)
    partner_free = threading.Event()  # set at step 7: until then every round is still running

    class Slow:
        def __init__(self, inner: ThreadCollective) -> None:
            self.inner = inner
            self.rank = inner.rank

        def send(self, data: bytes, *, dst: int, tag: int) -> None:
            self.inner.send(data, dst=dst, tag=tag)

        def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
            if self.rank == 1:
                assert partner_free.wait(60), "hang guard: a snapshot waited for a copy that could not progress"
            return self.inner.recv(src=src, tag=tag, max_size=max_size)

    def rank_main(rank: int) -> Any:
        here.node = "AB"[rank]
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = ResumableSampler(64, seed=1, rank=rank, world_size=2)
        tier = memory.MemorySnapshots(
            RunDirectory(str(tmp_path / "run")),
            memory_dir=tmp_path / "shm" / "AB"[rank],
            slots=2,
            collective=group[rank],
            replicate=True,
            channel=Slow(group[rank]),
        )
        for step in range(1, 8):
            if step == 7:  # at last the partner has time: the round of step 7 starts, and nothing rewrites its slot
                partner_free.set()
                tier.wait_replica()
            model(torch.ones(2, 64)).sum().backward()
            opt.step()
            sampler.advance(2)
            snap = api.capture(step=step, model=model, optimizer=opt, config={"a": 1}, sampler=sampler, defer=True)
            tier.snapshot(snap, opt, persist=False)
            tier.wait_snapshot()  # before step 7, done while the partner receives nothing: no step waits for a copy
        tier.wait_replica()
        assert tier.replicator is not None
        result = (tier.replicator.rounds, tier.replicator.skipped, tier.replicator.failures)
        tier.close(persist=False)
        return result

    results = run_threads(2, rank_main, JOIN_TIMEOUT)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert None not in results, "a rank still runs: its snapshots waited for copies the partner could not take"
    (rounds0, skipped0, failures0), (rounds1, skipped1, failures1) = results
    assert rounds0 == rounds1 and skipped0 == skipped1 >= 1, results  # both ranks skipped the same snapshots
    # a round whose slot a newer snapshot rewrote is dropped (not a failure): an older copy stays
    assert rounds0 + skipped0 == 7 and failures0 == failures1 == [], results
    copies = sorted((tmp_path / "shm" / "A").glob("run-*/peer-00001-*/manifest.json"))
    assert copies, "no copy of rank 1's files was committed on node A"
