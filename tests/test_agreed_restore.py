"""The restore across nodes facing a lying or buggy rank (spec/memory.md MEM-11, MEM-12; red-team 3: 01, 02, 07, 11).

Ranks are threads (:class:`ThreadCollective`, also the peer channel); a node is its own memory directory. A
leader's completeness summaries are hostile input: what does not parse fails every rank at once, naming the rank;
what parses but does not check out against the manifest it names is left out; a holder that claims what it does
not hold makes every rank pass over the checkpoint together; nothing is read or written outside a node's own memory
directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rank_threads import run_threads

import ckptfmt
from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import CheckpointError, CollectiveError, DigestMismatchError, MalformedMessageError
from ckptfmt.manifest import checkpoint_id
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier.agreed import AgreedRestore, Fetch, MemoryOption
from ckptfmt.tier.binding import SlotBinding, normalize_run_url, run_identity
from ckptfmt.tier.holdings import Holding, node_holdings, rank_of_file
from ckptfmt.tier.nodes import NodeMap
from ckptfmt.tier.ring import MemoryTier
from ckptfmt.writer import CheckpointWriter

# A long timeout: a rank left waiting would hang the test past it, so every outcome asserted below is reached by
# the coordinator's broadcast, never by a timeout (a timeout's message says "within").
TIMEOUT = 120.0
JOIN_TIMEOUT = TIMEOUT * 4  # a rank still running this long after its turn to be joined has hung
ROWS = 4


def tiers_of(tmp: Path, names: Sequence[str]) -> dict[str, MemoryTier]:
    tiers = {n: MemoryTier(tmp / n, str(tmp / "run")) for n in names}
    for tier in tiers.values():
        tier.ensure()
    return tiers


def snapshot(tiers: dict[str, MemoryTier], nodes: tuple[str, ...], *, step: int, slot: int = 0) -> str:
    """One spread snapshot: rank r writes rows of value ``100 r + step`` into its node's slot ``slot``."""
    run = str(next(iter(tiers.values())).memory_dir.parent / "run")
    group = ThreadCollective.group(len(nodes), timeout=TIMEOUT)
    nmap = NodeMap(nodes=nodes)
    binding = SlotBinding(
        run_id=run_identity(run),
        run_dir=normalize_run_url(run),
        node=nodes[0],
        world_size=len(nodes),
        step=step,
        nodes=nodes,
    )

    def write(rank: int) -> str:
        writer = CheckpointWriter(
            SlotStore(tiers[nodes[rank]].writable_slot(slot)),
            profile="weights",
            overwrite=True,
            collective=group[rank],
            metadata=binding.to_metadata(),
            store_of_rank=nmap.store_of_rank(),
        )
        rows = np.full((ROWS, 8), rank * 100 + step, dtype=np.float32)
        writer.write_tensor("weights", "w", rows, global_shape=(ROWS * len(nodes), 8), offsets=(ROWS * rank, 0))
        return writer.commit()

    ids = run_threads(len(nodes), write, JOIN_TIMEOUT)
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == 1, ids
    return str(ids[0])


class Tampering(ThreadCollective):
    """Rank ``rank`` of ``inner``'s group, whose first gather (its completeness summaries) goes through ``alter``:
    what a buggy or lying process would put on the wire. ``alter`` returns the value to send (framed as the value
    was) or the raw bytes. ``every``: every gather goes through it (it tells them apart by their shape)."""

    def __init__(self, inner: ThreadCollective, alter: Callable[[Any], object], *, every: bool = False) -> None:
        super().__init__(inner.rank, inner._shared)
        self.alter: Callable[[Any], object] | None = alter
        self.every = every

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        if self.alter is not None:
            doc = json.loads(data)
            framed = isinstance(doc, dict) and set(doc) == {"ok"}  # as ckptfmt.decide frames a rank's part
            altered = self.alter(doc["ok"] if framed else doc)
            data = (
                altered if isinstance(altered, bytes) else json.dumps({"ok": altered} if framed else altered).encode()
            )
            if not self.every:
                self.alter = None
        return super().gather(data, dst=dst, max_size=max_size)


def agreed_restores(
    tiers: dict[str, MemoryTier],
    nodes: tuple[str, ...],
    alter: dict[int, Callable[[Any], object]] | None = None,
    *,
    every: bool = False,
) -> list[AgreedRestore]:
    group = ThreadCollective.group(len(nodes), timeout=TIMEOUT)
    handles: list[ThreadCollective] = [
        Tampering(c, alter[c.rank], every=every) if alter and c.rank in alter else c for c in group
    ]
    run = str(next(iter(tiers.values())).memory_dir.parent / "run")
    return [
        AgreedRestore(
            tiers[nodes[rank]],
            collective=handles[rank],
            channel=handles[rank],
            nodes=NodeMap(nodes=nodes),
            node=nodes[rank],
            run_id=run_identity(run),
            run_dir=run,
            rank=rank,
        )
        for rank in range(len(nodes))
    ]


def read_all_rows(agreed: AgreedRestore, option: MemoryOption, world: int) -> list[float]:
    """Every rank's rows of the option's checkpoint, as this rank reads them (each chunk's digest checked)."""
    manifest = parse_manifest(option.manifest_bytes)
    fetched = agreed.fetch(option, {f.path for f in manifest.files})
    ckpt = ckptfmt.reader.Checkpoint(fetched.store, manifest, option.manifest_bytes)
    return [float(ckpt.read_slice("weights", "w", (ROWS * r, 0), (ROWS, 8))[0, 0]) for r in range(world)]


def only_b_holds(tmp: Path, step: int = 5, slot: int = 0) -> tuple[dict[str, MemoryTier], str]:
    """Nodes A and B; only B's memory holds a committed snapshot (both ranks of its writer were on B)."""
    tiers = tiers_of(tmp, ("A", "B"))
    ckpt_id = snapshot({"B": tiers["B"]}, ("B", "B"), step=step, slot=slot)
    return tiers, ckpt_id


def everything_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ---------------------------------------------------------------- the records are parsed strictly


def good_holding() -> dict[str, Any]:
    return {
        "node": "B",
        "path": "/m/run-x/slot-0",
        "kind": "slot",
        "checkpoint_id": "sha256:" + "ab" * 32,
        "step": 5,
        "files": {"weights/r00000-00000.safetensors": 12},
    }


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda h: h.pop("path"), "path"),
        (lambda h: h.update(files=["weights/r00000-00000.safetensors"]), "files"),
        (lambda h: h.update(files={"weights/x": -1}), "weights/x"),
        (lambda h: h.update(files={"weights/x": True}), "weights/x"),
        (lambda h: h.update(step="1e9"), "step"),
        (lambda h: h.update(step=1.5), "step"),
        (lambda h: h.update(step=-1), "step"),
        (lambda h: h.update(kind="other"), "kind"),
        (lambda h: h.update(node=3), "node"),
        (lambda h: h.update(checkpoint_id="sha256:../../../../escaped-by-peer"), "escaped-by-peer"),
        (lambda h: h.update(checkpoint_id="sha256:" + "AB" * 32), "sha256:ABAB"),
        (lambda h: h.update(extra=1), "extra"),
    ],
)
def test_a_malformed_holding_is_refused_naming_the_member_and_the_rank(
    change: Callable[[dict[str, Any]], object], named: str
) -> None:
    assert Holding.from_dict(good_holding(), rank=3) == Holding.from_dict(Holding.from_dict(good_holding()).to_dict())
    doc = good_holding()
    change(doc)
    with pytest.raises(MalformedMessageError, match="rank 3") as caught:
        Holding.from_dict(doc, rank=3)
    assert named in str(caught.value)
    with pytest.raises(MalformedMessageError):
        Holding.from_dict("slot-0", rank=3)


def test_the_rank_of_a_file_is_read_from_the_writer_s_names() -> None:
    assert rank_of_file("weights/r00012-00003.safetensors") == 12
    assert rank_of_file("optimizer/context.r00004.msgpack") == 4
    assert rank_of_file("provenance/context.msgpack") == 0
    assert rank_of_file("weights/notes.txt") is None


# ---------------------------------------------------------------- 01: ids name directories; each is checked


def test_an_honest_restore_gathers_a_node_s_files_from_the_only_holder(tmp_path: Path) -> None:
    tiers, ckpt_id = only_b_holds(tmp_path)
    restores = agreed_restores(tiers, ("A", "B"))

    def body(rank: int) -> Any:
        options = restores[rank].options()
        return [(o.step, o.checkpoint_id) for o in options], read_all_rows(restores[rank], options[0], 2)

    assert run_threads(2, body, JOIN_TIMEOUT) == [([(5, ckpt_id)], [5.0, 105.0])] * 2


def test_a_checkpoint_id_that_is_no_sha256_fails_every_rank_at_once_and_nothing_is_written(tmp_path: Path) -> None:
    """Finding 01: B's leader files its slot under ``sha256:../../../../escaped-by-peer``."""
    tiers, ckpt_id = only_b_holds(tmp_path)
    bad = "sha256:../../../../escaped-by-peer"

    def rename(report: Any) -> object:
        assert report["summaries"][0]["checkpoint_id"] == ckpt_id
        report["summaries"][0]["checkpoint_id"] = bad
        return report

    before = everything_under(tmp_path)
    restores = agreed_restores(tiers, ("A", "B"), {1: rename})
    out = run_threads(2, lambda rank: read_all_rows(restores[rank], restores[rank].options()[0], 2), JOIN_TIMEOUT)
    for exc in out:
        assert isinstance(exc, MalformedMessageError), out
        assert "rank 1" in str(exc) and "is not a checkpoint id" in str(exc) and "within" not in str(exc)
    assert everything_under(tmp_path) == before


def test_an_option_whose_id_is_no_sha256_is_refused_before_a_directory_is_made(tmp_path: Path) -> None:
    tiers, _ = only_b_holds(tmp_path)
    manifest = Path(tiers["B"].slot_path(0), "manifest.json").read_bytes()
    agreed = agreed_restores({"B": tiers["B"]}, ("B",))[0]
    agreed.collective = agreed.channel = None
    before = everything_under(tmp_path)
    for bad in ("sha256:../../../../escaped-by-peer", "sha256:" + "0" * 64):
        with pytest.raises(CheckpointError, match=r"is not a checkpoint id|hashes to"):
            agreed.fetch(MemoryOption(step=5, checkpoint_id=bad, manifest_bytes=manifest), {"weights/x"})
    assert everything_under(tmp_path) == before


def test_a_manifest_that_does_not_hash_to_its_id_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """B's leader files its summary under a forged id, and sends its manifest under that id when asked for it."""
    tiers, _ = only_b_holds(tmp_path)
    forged = "sha256:" + "0" * 64
    manifest = Path(tiers["B"].slot_path(0), "manifest.json").read_text()

    def refile(value: Any) -> object:
        if isinstance(value, dict) and "summaries" in value:
            value["summaries"][0]["checkpoint_id"] = forged
            return value
        return {forged: manifest} if isinstance(value, dict) else value  # asked for the forged id's manifest

    restores = agreed_restores(tiers, ("A", "B"), {1: refile}, every=True)
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        out = run_threads(2, lambda rank: restores[rank].options(), JOIN_TIMEOUT)
    assert out == [[], []]
    assert any("rank 1 sent a manifest for " + forged in r.getMessage() for r in caplog.records)
    assert any("passed over: no manifest that hashes to its id came" in r.getMessage() for r in caplog.records)


def test_a_sender_s_manifest_of_another_checkpoint_is_refused_and_nothing_is_published(tmp_path: Path) -> None:
    """The receiver checks the manifest against the option it asked for, not against what its sender announces."""
    tiers, _ = only_b_holds(tmp_path, step=5, slot=0)
    snapshot({"B": tiers["B"]}, ("B", "B"), step=6, slot=1)
    restores = agreed_restores(tiers, ("A", "B"))
    real_move = AgreedRestore._move

    def body(rank: int) -> Any:
        options = restores[rank].options()
        assert [o.step for o in options] == [6, 5]
        if rank == 1:  # B sends step 6's manifest (and files) where step 5's were planned

            def lying_move(
                self: AgreedRestore, index: int, fetch: Fetch, option: Any, files: Any, fetch_dir: str
            ) -> None:
                real_move(self, index, fetch, options[0], files, fetch_dir)

            restores[1]._move = lying_move.__get__(restores[1])  # type: ignore[method-assign]
        return read_all_rows(restores[rank], options[1], 2)

    out = run_threads(2, body, JOIN_TIMEOUT)
    for exc in out:
        assert isinstance(exc, DigestMismatchError), out
        assert "rank 1 sent checkpoint" in str(exc)
    fetched = list(tiers["A"].root.glob("fetched-*/**/*.safetensors"))
    assert fetched == []


# ---------------------------------------------------------------- 02: a holding's claims are checked


def test_a_claimed_step_that_its_manifest_does_not_bind_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 02: honest spread snapshots at steps 10 and 20; B's leader reports its step-10 holding as step 30."""
    tiers = tiers_of(tmp_path, ("A", "B"))
    snapshot(tiers, ("A", "B"), step=10, slot=0)
    id20 = snapshot(tiers, ("A", "B"), step=20, slot=1)

    def lie(report: Any) -> object:
        for summary in report["summaries"]:
            if summary["step"] == 10:
                summary["step"] = 30
        return report

    restores = agreed_restores(tiers, ("A", "B"), {1: lie})
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        out = run_threads(2, lambda rank: [(o.step, o.checkpoint_id) for o in restores[rank].options()], JOIN_TIMEOUT)
    assert out == [[(20, id20)]] * 2  # never step 30; step 10 is incomplete without B's summary of it
    assert any(
        "rank 1 (node 'B') claims step 30" in r.getMessage() and "says step 10" in r.getMessage()
        for r in caplog.records
    )


def test_holders_disagreeing_on_a_checkpoint_the_coordinator_cannot_check_pass_over_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A (the coordinator's node) holds nothing; B and C both hold step 5, and C's leader claims step 30: with no
    manifest at hand to tell which is right, the coordinator passes over it on every rank."""
    tiers = tiers_of(tmp_path, ("A", "B", "C"))
    snapshot({"B": tiers["B"]}, ("B", "B"), step=5)
    shutil.copytree(tiers["B"].slot_path(0), tiers["C"].root / "peer-00000-0")  # C keeps a replica of it

    def lie(report: Any) -> object:
        report["summaries"][0]["step"] = 30
        return report

    restores = agreed_restores(tiers, ("A", "B", "C"), {2: lie})
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        out = run_threads(3, lambda rank: restores[rank].options(), JOIN_TIMEOUT)
    assert out == [[], [], []]
    assert any(
        "disagree" in r.getMessage() and "rank 2 (node 'C') claim step 30" in r.getMessage() for r in caplog.records
    )


def test_a_step_claimed_by_every_holder_is_checked_against_the_manifest_s_binding(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only B holds step 5 and its leader claims step 30: the coordinator asks B for the manifest, which binds 5."""
    tiers, _ = only_b_holds(tmp_path)

    def lie(report: Any) -> object:
        report["summaries"][0]["step"] = 30
        return report

    restores = agreed_restores(tiers, ("A", "B"), {1: lie})
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        out = run_threads(2, lambda rank: restores[rank].options(), JOIN_TIMEOUT)
    assert out == [[], []]
    assert any("claim step 30, its manifest's binding says step 5" in r.getMessage() for r in caplog.records)


def test_a_leader_speaks_only_for_its_own_node(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1, on node A but not its leader, sends a summary of a whole checkpoint: it counts for nobody."""
    tiers = tiers_of(tmp_path, ("A", "B"))
    claim = {"checkpoint_id": "sha256:" + "ab" * 32, "step": 9, "writers": [[0, 3]], "held": [[0, 3]]}
    restores = agreed_restores(tiers, ("A", "A", "B"), {1: lambda _: {"summaries": [claim]}})
    with caplog.at_level(logging.WARNING, logger="ckptfmt"):
        out = run_threads(3, lambda rank: restores[rank].options(), JOIN_TIMEOUT)
    assert out == [[], [], []]
    assert any("rank 1 is not the leader of node 'A'" in r.getMessage() for r in caplog.records)


def test_a_holder_claiming_files_it_lacks_makes_every_rank_pass_over_together(tmp_path: Path) -> None:
    """Only B holds step 5; C's leader claims it too. A's fetch of one writer rank is planned from C, whose rank
    finds no such files in its own memory (a rank reads only its own node's holdings, never a path from a message)
    and refuses at once: every rank raises the same error, none waits out a timeout, nothing is published on A."""
    tiers = tiers_of(tmp_path, ("A", "B", "C"))
    ckpt_id = snapshot({"B": tiers["B"]}, ("B", "B"), step=5)
    claim = {"checkpoint_id": ckpt_id, "step": 5, "writers": [[0, 2]], "held": [[0, 2]]}
    restores = agreed_restores(tiers, ("A", "B", "C"), {2: lambda _: {"summaries": [claim]}})
    out = run_threads(3, lambda rank: read_all_rows(restores[rank], restores[rank].options()[0], 2), JOIN_TIMEOUT)
    assert len({str(e) for e in out}) == 1, out
    for exc in out:
        assert isinstance(exc, CheckpointError), out
        assert "rank 2" in str(exc) and "not sent" in str(exc) and "within" not in str(exc)
    assert list(tiers["A"].root.glob("fetched-*/weights/r00001*")) == []


# ---------------------------------------------------------------- 07: a malformed list fails every rank at once


def nested(report: Any) -> object:
    return b'{"ok":' + b"[" * 200_000 + b"]" * 200_000 + b"}"


def set_in_first(**members: object) -> Callable[[Any], object]:
    def alter(report: Any) -> object:
        report["summaries"][0].update(members)
        return report

    return alter


def without_held(report: Any) -> object:
    del report["summaries"][0]["held"]
    return report


def summaries_as_string(report: Any) -> object:
    report["summaries"] = "slot-0"
    return report


def twice(report: Any) -> object:
    report["summaries"] *= 2
    return report


@pytest.mark.parametrize(
    "alter",
    [
        without_held,
        set_in_first(held=[[2, 1]]),
        set_in_first(writers="0-2"),
        summaries_as_string,
        twice,
        set_in_first(step="1e9"),
        nested,
    ],
    ids=["missing-held", "held-backwards", "writers-string", "summaries-string", "twice", "step-1e9", "200k-brackets"],
)
def test_a_malformed_summary_fails_every_rank_at_once_naming_the_rank(
    tmp_path: Path, alter: Callable[[Any], object]
) -> None:
    """Finding 07: node B's leader sends malformed summaries; every rank raises the same CollectiveError naming rank 1,
    decided by the coordinator (not a timeout), so the manager passes over the memory options together."""
    tiers, _ = only_b_holds(tmp_path)
    restores = agreed_restores(tiers, ("A", "B"), {1: alter})
    out = run_threads(2, lambda rank: restores[rank].options(), JOIN_TIMEOUT)
    assert len({str(e) for e in out}) == 1, out
    for exc in out:
        assert isinstance(exc, CollectiveError) and isinstance(exc, CheckpointError), out
        assert "rank 1" in str(exc) and "within" not in str(exc)


# ---------------------------------------------------------------- 11: a slot's stale files after a placement change


def test_a_spread_slot_rewritten_after_a_placement_change_keeps_only_its_ranks_files(tmp_path: Path) -> None:
    tiers = tiers_of(tmp_path, ("A", "B"))
    snapshot(tiers, ("A", "A", "B", "B"), step=3)
    snapshot(tiers, ("A", "B", "A", "B"), step=4)
    listed = {
        n: sorted(p for p in SlotStore(t.slot_path(0)).list() if p.endswith(".safetensors")) for n, t in tiers.items()
    }
    assert listed == {
        "A": ["weights/r00000-00000.safetensors", "weights/r00002-00000.safetensors"],
        "B": ["weights/r00001-00000.safetensors", "weights/r00003-00000.safetensors"],
    }


def test_stale_files_of_another_node_s_ranks_are_not_held_and_the_restore_reads_the_new_step(tmp_path: Path) -> None:
    """Finding 11: placement (A, A, B, B) at step 3, then (A, B, A, B) at step 4 into the same slot; each node's slot
    also keeps (as a writer that deletes nothing would leave them) the step-3 files of ranks now on the other node,
    at the sizes step 4's manifest lists. The agreed restore reads step 4, whole, on every rank."""
    tiers = tiers_of(tmp_path, ("A", "B"))
    snapshot(tiers, ("A", "A", "B", "B"), step=3)
    stale = {
        "A": {"r00001": Path(tiers["A"].slot_path(0), "weights", "r00001-00000.safetensors").read_bytes()},
        "B": {"r00002": Path(tiers["B"].slot_path(0), "weights", "r00002-00000.safetensors").read_bytes()},
    }
    nodes = ("A", "B", "A", "B")
    snapshot(tiers, nodes, step=4)
    for node, files in stale.items():
        for name, data in files.items():
            Path(tiers[node].slot_path(0), "weights", f"{name}-00000.safetensors").write_bytes(data)

    run = str(tmp_path / "run")
    held = {
        n: node_holdings(t, node=n, run_id=run_identity(run), run_dir=run, slot_count=2)[0][0].files
        for n, t in tiers.items()
    }
    assert sorted(held["A"]) == [
        "provenance/context.msgpack",
        "weights/r00000-00000.safetensors",
        "weights/r00002-00000.safetensors",
    ]
    assert sorted(held["B"]) == ["weights/r00001-00000.safetensors", "weights/r00003-00000.safetensors"]

    restores = agreed_restores(tiers, nodes)

    def body(rank: int) -> Any:
        options = restores[rank].options()
        return options[0].step, read_all_rows(restores[rank], options[0], 4)

    assert run_threads(4, body, JOIN_TIMEOUT) == [(4, [4.0, 104.0, 204.0, 304.0])] * 4


def test_one_rank_alone_decides_the_same_way(tmp_path: Path) -> None:
    tiers = tiers_of(tmp_path, ("A",))
    ckpt_id = snapshot(tiers, ("A", "A"), step=2)
    agreed = agreed_restores(tiers, ("A",))[0]
    agreed.collective = agreed.channel = None
    options = agreed.options()
    assert [(o.step, o.checkpoint_id) for o in options] == [(2, ckpt_id)]
    assert read_all_rows(agreed, options[0], 2) == [2.0, 102.0]
    assert checkpoint_id(options[0].manifest_bytes) == ckpt_id
    assert os.listdir(tiers["A"].root)  # the slots are still there


# ---------------------------------------------------------------- the manager passes over the memory tier together


def test_the_manager_passes_over_the_memory_tier_when_its_holdings_cannot_be_agreed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ckptfmt.torch import CheckpointManager
    from tests.test_memory_tier import build, train

    run, shm = tmp_path / "run", tmp_path / "shm"
    train(run, shm, stop_at=7, replicate=True)  # step 7 in memory, step 5 durable
    monkeypatch.setattr(AgreedRestore, "_summaries", lambda self: {"summaries": "slot-0"})
    t = build()
    mgr = CheckpointManager(run, loader=t.loader, memory_every=1, memory_dir=shm, replicate=True)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptfmt"):
            step = mgr.restore_latest(**t.state())
    finally:
        mgr.close(persist=False)
    assert step == 5 and mgr.last_restore is not None and mgr.last_restore.tier == "durable"
    assert any("skipping the memory tier" in r.getMessage() and "rank 0" in r.getMessage() for r in caplog.records)
