"""``ckpt rescue`` of a snapshot spread over nodes: the slot and the peer copies beside it read as one checkpoint,
verified whole and persisted; a checkpoint this node holds only in part is ``partial``; a destination that is a
symlink is ``refused`` (spec/memory.md; red-team report 3, finding 10 and its observations). The overlay the
rescue reads through prefers the copy of the manifest's size and falls back to another copy of a bad file.

Single-node rescues (one slot holds a whole checkpoint) are in tests/test_memory_tier.py and, after a SIGKILL,
tests/test_memory_processes.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckptfmt.cli import cli
from click.testing import CliRunner
from rank_threads import run_threads

import ckptfmt
from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import MissingFileError
from ckptfmt.run import RunDirectory
from ckptfmt.storage import LocalStore
from ckptfmt.storage.overlay import OverlayStore
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier import rescue
from ckptfmt.tier.binding import SlotBinding, normalize_run_url, run_identity
from ckptfmt.tier.nodes import NodeMap
from ckptfmt.tier.replica import Replicator, peer_dir
from ckptfmt.tier.ring import MemoryTier
from ckptfmt.writer import CheckpointWriter

NODES = ("A", "B")
STEP = 4
THEIRS = "weights/r00001-00000.safetensors"  # rank 1's file: written on node B
JOIN_TIMEOUT = 60.0  # a rank still running this long after its turn to be joined has hung


def spread_snapshot(tmp: Path, run_url: str) -> tuple[MemoryTier, MemoryTier]:
    """Ranks 0 (node A) and 1 (node B) write one spread snapshot at ``STEP``: one manifest, each node's slot 0
    holding its rank's rows only, each node its own memory directory."""
    tiers = {n: MemoryTier(tmp / n, run_url) for n in NODES}
    for tier in tiers.values():
        tier.ensure()
    group = ThreadCollective.group(len(NODES))
    nmap = NodeMap(nodes=NODES)
    binding = SlotBinding(
        run_id=run_identity(run_url),
        run_dir=normalize_run_url(run_url),
        node=NODES[0],
        world_size=len(NODES),
        step=STEP,
        nodes=NODES,
    )

    def write(rank: int) -> str:
        writer = CheckpointWriter(
            SlotStore(tiers[NODES[rank]].writable_slot(0)),
            profile="weights",
            overwrite=True,
            collective=group[rank],
            metadata=binding.to_metadata(),
            store_of_rank=nmap.store_of_rank(),
        )
        rows = np.full((4, 8), rank * 100 + STEP, dtype=np.float32)
        writer.write_tensor("weights", "w", rows, global_shape=(8, 8), offsets=(4 * rank, 0))
        return writer.commit()

    ids = run_threads(len(NODES), write, JOIN_TIMEOUT)
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == 1, ids
    return tiers["A"], tiers["B"]


def replicate(a: MemoryTier, b: MemoryTier) -> None:
    """One replica round: each rank's file of slot 0 copied to its partner on the other node."""
    group = ThreadCollective.group(len(NODES), timeout=10)
    nmap = NodeMap(nodes=NODES)

    def run(rank: int) -> Any:
        tier = (a, b)[rank]
        slot = tier.slot_path(0)
        mine = [p for p in SlotStore(slot).list() if p.startswith(f"weights/r{rank:05d}")]
        rep = Replicator(tier, group[rank], nmap, rank)
        rep.start(0, step=STEP, slot_path=slot, manifest_bytes=SlotStore(slot).read("manifest.json"), files=mine)
        result = rep.wait()
        rep.close()
        return result

    results = run_threads(len(NODES), run, JOIN_TIMEOUT)
    assert all(r is not None and r.committed for r in results), results


def fingerprint(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def invoke_rescue(memory_dir: Path, run_dir: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["rescue", str(memory_dir), str(run_dir), "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.stdout)


# ---------------------------------------------------------------- the red team's steps (finding 10)


def test_rescue_persists_a_spread_snapshot_from_the_slot_and_the_peer_copy_beside_it(tmp_path: Path) -> None:
    """Node B and the job are gone; A's memory holds slot 0 (rank 0's file) and a committed peer copy of rank 1's
    file: together the whole checkpoint. It was reported corrupt (missing_file) and nothing was persisted."""
    run_dir = tmp_path / "run"
    a, b = spread_snapshot(tmp_path, str(run_dir))
    replicate(a, b)
    copy = peer_dir(a, 1, 0)
    assert Path(copy, THEIRS).is_file() and not Path(a.slot_path(0), THEIRS).exists()
    snapshot_id = ckptfmt.tier.read_slot(a.slot_path(0)).checkpoint_id
    before = fingerprint(a.memory_dir)

    code, doc = invoke_rescue(a.memory_dir, run_dir)

    assert code == 0, doc
    assert doc["ok"] is True
    [outcome] = doc["slots"]
    assert outcome["status"] == "persisted" and outcome["missing"] == []
    assert outcome["copies"] == [copy]
    assert outcome["persisted"]["step"] == STEP and outcome["persisted"]["checkpoint_id"] == snapshot_id
    durable = run_dir / f"step-{STEP:09d}"
    with ckptfmt.open(durable) as ckpt:
        assert ckpt.id == snapshot_id and ckpt.verify().ok
        rows = np.asarray(ckpt.read_tensor("weights", "w"))
    assert rows[:4].tolist() == [[float(STEP)] * 8] * 4 and rows[4:].tolist() == [[100.0 + STEP] * 8] * 4
    assert RunDirectory(run_dir).latest()["step"] == STEP  # type: ignore[index]
    assert fingerprint(a.memory_dir) == before  # nothing in memory changed
    # a second rescue finds it there
    code, again = invoke_rescue(a.memory_dir, run_dir)
    assert code == 0 and [s["status"] for s in again["slots"]] == ["already durable"]


def test_a_slot_lacking_another_nodes_files_is_partial_not_corrupt(tmp_path: Path) -> None:
    """No replica reached A: its slot holds rank 0's file only. Nothing is wrong with it; it is not whole here."""
    run_dir = tmp_path / "run"
    a, _ = spread_snapshot(tmp_path, str(run_dir))

    code, doc = invoke_rescue(a.memory_dir, run_dir)

    assert code == 1
    assert doc["ok"] is False
    [outcome] = doc["slots"]
    assert outcome["status"] == "partial", outcome
    assert outcome["missing"] == [THEIRS] and THEIRS in outcome["detail"]
    assert outcome["persisted"] is None and outcome["copies"] == []
    assert not (run_dir / f"step-{STEP:09d}").exists()
    human = CliRunner().invoke(cli, ["rescue", str(a.memory_dir), str(run_dir)])
    assert human.exit_code == 1 and human.stdout.startswith("partial ") and "corrupt" not in human.stdout


def test_a_symlinked_step_directory_is_refused_and_nothing_is_written_through_it(tmp_path: Path) -> None:
    """``run/step-N`` planted as a link to a directory elsewhere: the good slot is ``refused``, not ``corrupt``."""
    run_dir = tmp_path / "run"
    a, b = spread_snapshot(tmp_path, str(run_dir))
    replicate(a, b)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir.mkdir()
    (run_dir / f"step-{STEP:09d}").symlink_to(elsewhere, target_is_directory=True)

    code, doc = invoke_rescue(a.memory_dir, run_dir)

    assert code == 1
    assert doc["ok"] is False
    [outcome] = doc["slots"]
    assert outcome["status"] == "refused", outcome
    assert "symlink" in outcome["detail"] and outcome["persisted"] is None
    assert list(elsewhere.iterdir()) == []
    assert RunDirectory(run_dir).latest() is None


def test_a_stale_file_in_the_slot_does_not_hide_a_good_peer_copy(tmp_path: Path) -> None:
    """A's slot kept a file of rank 1's from an earlier placement (finding 11): the manifest's size, other bytes.
    The peer copy of it is good: rescue reads it from there and persists the checkpoint."""
    run_dir = tmp_path / "run"
    a, b = spread_snapshot(tmp_path, str(run_dir))
    replicate(a, b)
    good = Path(peer_dir(a, 1, 0), THEIRS).read_bytes()
    stale = bytearray(good)
    stale[-3] ^= 0x40
    Path(a.slot_path(0), THEIRS).write_bytes(bytes(stale))

    [outcome] = rescue(a.memory_dir, str(run_dir))

    assert outcome.status == "persisted", outcome
    assert outcome.copies == (peer_dir(a, 1, 0),)
    durable = run_dir / f"step-{STEP:09d}"
    assert (durable / THEIRS).read_bytes() == good
    assert ckptfmt.verify(str(durable)).ok


def test_a_bad_file_no_other_directory_holds_is_corrupt(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    a, b = spread_snapshot(tmp_path, str(run_dir))
    replicate(a, b)
    damaged = Path(peer_dir(a, 1, 0), THEIRS)
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x40
    damaged.write_bytes(bytes(data))

    [outcome] = rescue(a.memory_dir, str(run_dir))

    assert outcome.status == "corrupt" and "digest_mismatch" in (outcome.detail or ""), outcome
    assert not (run_dir / f"step-{STEP:09d}").exists()


def test_a_peer_copy_of_another_checkpoint_is_not_used(tmp_path: Path) -> None:
    """Only copies with the slot's checkpoint id join it: a copy of another run's (or step's) files is no part."""
    run_dir = tmp_path / "run"
    a, b = spread_snapshot(tmp_path, str(run_dir))
    replicate(a, b)
    foreign = Path(peer_dir(a, 1, 0))
    manifest = json.loads((foreign / "manifest.json").read_bytes())
    manifest["metadata"]["note"] = "another checkpoint"
    (foreign / "manifest.json").write_bytes(json.dumps(manifest).encode())

    [outcome] = rescue(a.memory_dir, str(run_dir))

    assert outcome.status == "partial" and outcome.missing == (THEIRS,), outcome


# ---------------------------------------------------------------- the overlay: which copy answers


def put(root: Path, path: str, data: bytes) -> LocalStore:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_bytes(data)
    return LocalStore(root)


def test_the_copy_of_the_expected_size_answers_before_an_earlier_layer_of_another_size(tmp_path: Path) -> None:
    a = put(tmp_path / "a", "f", b"stale, longer")
    b = put(tmp_path / "b", "f", b"right")
    put(tmp_path / "a", "g", b"only a")
    plain = OverlayStore([("a", a), ("b", b)])
    assert plain.read("f") == b"stale, longer" and plain.list() == {"f": 13, "g": 6}  # layer order, unchanged
    sized = OverlayStore([("a", a), ("b", b)], sizes={"f": 5, "g": 6})
    assert sized.list() == {"f": 5, "g": 6} and sized.size("f") == 5
    assert sized.read("f") == b"right" and sized.sources["f"] == "b"
    assert sized.holders("f") == ["b", "a"]
    # no copy of the expected size: layer order, and the reader's size check says what is wrong
    assert OverlayStore([("a", a), ("b", b)], sizes={"f": 99}).read("f") == b"stale, longer"


def test_fall_back_moves_a_path_to_the_next_copy_and_says_when_none_is_left(tmp_path: Path) -> None:
    a = put(tmp_path / "a", "f", b"rotted")
    b = put(tmp_path / "b", "f", b"good!!")
    overlay = OverlayStore([("a", a), ("b", b)], sizes={"f": 6})
    assert overlay.read("f") == b"rotted"
    assert overlay.fall_back("f") == "b"
    assert overlay.read("f") == b"good!!" and overlay.sources["f"] == "b"
    assert overlay.fall_back("f") is None  # the last copy keeps answering
    assert overlay.read("f") == b"good!!"
    assert overlay.fall_back("absent") is None
    with pytest.raises(MissingFileError):
        overlay.read("absent")
    assert os.fspath(overlay.url) == a.url
