"""A peer's message is hostile input: every receive of the wire and of a replica round is bounded before anything is
allocated for it (red-team 3, finding 04), and a spread persist parses each rank's report through ckptfmt.decide.

A channel here announces lengths without sending the bytes (:class:`Announcing`): a receiver that would accept an
oversized length is caught before it allocates, in this process too. One test runs two real gloo ranks.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from process_ranks import launch
from rank_threads import run_ranks

from ckptfmt.collective import ThreadCollective, refuse_length
from ckptfmt.errors import CheckpointError, CollectiveError, MalformedMessageError, MessageTooLargeError
from ckptfmt.manifest import MAX_MANIFEST_BYTES, checkpoint_id
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.run import RunDirectory, checkpoint_name
from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier.nodes import NodeMap
from ckptfmt.tier.persist import persist_spread
from ckptfmt.tier.replica import ACK_BYTES, Replicator
from ckptfmt.tier.ring import MemoryTier
from ckptfmt.tier.wire import (
    HEADER_BYTES,
    HEADER_BYTES_PER_PATH,
    MAX_HEADER_BYTES,
    PIECE_BYTES,
    header_bound,
    receive_files,
)
from ckptfmt.writer import CheckpointWriter

TIMEOUT = 120.0  # long: every outcome below is reached by a refusal or a broadcast, never by a timeout


class Announcing:
    """A :class:`~ckptfmt.collective.PeerChannel` whose peer is rank 1 and says what ``script`` holds, in turn: bytes
    are sent as they are; an int is a length announced and never followed by its bytes, which a receiver must
    refuse from its length alone (one that accepts it would go on to allocate it: AssertionError)."""

    rank = 0

    def __init__(self, script: list[bytes | int]) -> None:
        self.script = list(script)
        self.bounds: list[int | None] = []
        self.sent: list[bytes] = []

    def send(self, data: bytes, *, dst: int, tag: int) -> None:
        self.sent.append(data)

    def recv(self, *, src: int, tag: int, max_size: int | None = None) -> bytes:
        self.bounds.append(max_size)
        item = self.script.pop(0)
        if isinstance(item, int):
            refuse_length(item, max_size, src=src, what=f"a message (tag {tag})")
            raise AssertionError(f"a length of {item:,} bytes was accepted (bound {max_size})")
        return item


def snapshot(tmp: Path) -> tuple[SlotStore, bytes, list[str]]:
    """A committed checkpoint of two tensors: its store, manifest and files."""
    store = SlotStore(tmp / "source")
    writer = CheckpointWriter(store, profile="weights")
    writer.write_tensor("weights", "w", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.commit()
    manifest = store.read("manifest.json")
    return store, manifest, [f.path for f in parse_manifest(manifest).files]


def header(manifest: bytes, paths: list[str]) -> bytes:
    return json.dumps({"checkpoint_id": checkpoint_id(manifest), "paths": paths}, sort_keys=True).encode()


# ---------------------------------------------------------------- the wire's bounds


def test_the_header_bound_is_64_kib_plus_4_kib_a_path_and_at_most_64_mib() -> None:
    assert header_bound(0) == HEADER_BYTES == 64 << 10
    assert header_bound(3) == (64 << 10) + 3 * HEADER_BYTES_PER_PATH == (64 << 10) + (12 << 10)
    assert header_bound(None) == header_bound(10**9) == MAX_HEADER_BYTES == 64 << 20


def test_a_192_mib_header_is_refused_from_its_length_naming_the_sender(tmp_path: Path) -> None:
    channel = Announcing([192 << 20])
    with pytest.raises(MessageTooLargeError, match="a transfer header: rank 1 announced") as caught:
        receive_files(channel, src=1, tag=5, destination=SlotStore(tmp_path / "dest"))
    assert f"{192 << 20:,}" in str(caught.value)
    assert channel.bounds == [MAX_HEADER_BYTES]  # nothing said how many paths to expect


def test_a_header_is_bounded_by_the_paths_the_receiver_expects(tmp_path: Path) -> None:
    channel = Announcing([header_bound(2) + 1])
    with pytest.raises(MessageTooLargeError, match="a transfer header: rank 1"):
        receive_files(channel, src=1, tag=5, destination=SlotStore(tmp_path / "dest"), max_paths=2)
    assert channel.bounds == [(64 << 10) + (8 << 10)]


def test_a_header_naming_more_paths_than_expected_is_refused(tmp_path: Path) -> None:
    _, manifest, files = snapshot(tmp_path)
    channel = Announcing([header(manifest, files), manifest])
    with pytest.raises(MalformedMessageError, match=f"rank 1 announced {len(files)} files; at most 1"):
        receive_files(channel, src=1, tag=5, destination=SlotStore(tmp_path / "dest"), max_paths=1)
    assert SlotStore(tmp_path / "dest").list() == {}


@pytest.mark.parametrize("bad", [{"paths": [1], "checkpoint_id": "x"}, {"paths": ["a"]}, ["paths"]])
def test_a_malformed_header_is_refused_naming_the_sender(tmp_path: Path, bad: object) -> None:
    _, manifest, _ = snapshot(tmp_path)
    channel = Announcing([json.dumps(bad).encode(), manifest])
    with pytest.raises(MalformedMessageError, match="rank 1 sent a malformed transfer header"):
        receive_files(channel, src=1, tag=5, destination=SlotStore(tmp_path / "dest"))


def test_a_manifest_longer_than_a_manifest_may_be_is_refused_from_its_length(tmp_path: Path) -> None:
    _, manifest, files = snapshot(tmp_path)
    channel = Announcing([header(manifest, files), MAX_MANIFEST_BYTES + 1])
    with pytest.raises(MessageTooLargeError, match="a manifest: rank 1 announced"):
        receive_files(channel, src=1, tag=5, destination=SlotStore(tmp_path / "dest"))
    assert channel.bounds[1] == MAX_MANIFEST_BYTES


def test_a_piece_longer_than_a_piece_and_its_head_is_refused_from_its_length(tmp_path: Path) -> None:
    _, manifest, files = snapshot(tmp_path)
    channel = Announcing([header(manifest, files[:1]), manifest, PIECE_BYTES + 9 + 1])
    dest = SlotStore(tmp_path / "dest")
    with pytest.raises(MessageTooLargeError, match="a piece: rank 1 announced") as caught:
        receive_files(channel, src=1, tag=5, destination=dest)
    assert caught.value.path == files[0] and channel.bounds[2] == PIECE_BYTES + 9
    assert not any(p == files[0] for p in dest.list())


def test_an_honest_transfer_fits_the_bounds_it_is_given(tmp_path: Path) -> None:
    source, manifest, files = snapshot(tmp_path)
    group = ThreadCollective.group(2, timeout=TIMEOUT)
    from ckptfmt.tier.wire import send_files

    dest = SlotStore(tmp_path / "dest")
    out: list[Any] = [None, None]

    def sender() -> None:
        out[0] = send_files(group[0], dst=1, tag=3, source=source, manifest_bytes=manifest, paths=files)

    t = threading.Thread(target=sender)
    t.start()
    out[1] = receive_files(group[1], src=0, tag=3, destination=dest, max_paths=len(files))
    t.join()
    assert out[1].checkpoint_id == checkpoint_id(manifest) and sorted(f.path for f in out[1].files) == sorted(files)


@pytest.mark.parametrize("cut", [0, 5, 127])
def test_a_piece_cut_short_is_damage_and_the_receiver_waits_for_no_more_than_was_sent(tmp_path: Path, cut: int) -> None:
    """A damaged sender's piece shorter than the manifest says (found by tests/hostile/peer_campaign.py): the
    receiver counted its bytes, waited for a piece that never comes and waited out its timeout; the pieces are of a
    known length, so a short one is damage, and the receiver reads exactly the messages that were sent."""
    source, manifest, files = snapshot(tmp_path)
    data_file = next(p for p in files if p.endswith(".safetensors"))
    piece = source.read(data_file)
    head = b"\x00" + bytes(8)  # status OK and some hash: the length is what is wrong
    channel = Announcing([header(manifest, [data_file]), manifest, head + piece[:cut]])
    with pytest.raises(CheckpointError, match=r"has \d+ bytes, not \d+") as caught:
        receive_files(channel, src=1, tag=3, destination=SlotStore(tmp_path / "dest"), max_paths=1)
    assert caught.value.path == data_file and not channel.script  # every message read, none awaited
    assert not (tmp_path / "dest" / data_file).exists()


# ---------------------------------------------------------------- a replica round's receives


def replicator(tmp: Path, channel: Announcing) -> Replicator:
    """Rank 0 of nodes A and B: its partner, and its one source, is rank 1."""
    tier = MemoryTier(tmp / "shm", str(tmp / "run"))
    tier.ensure()
    return Replicator(tier, channel, NodeMap(nodes=("A", "B")), 0)


def test_a_replica_sender_refuses_an_oversized_have_list_and_ack(tmp_path: Path) -> None:
    source, manifest, files = snapshot(tmp_path)
    channel = Announcing([192 << 20])
    with pytest.raises(MessageTooLargeError, match="a have-list: rank 1 announced"):
        replicator(tmp_path, channel)._send(3, 1, source.url, manifest, files)
    assert channel.bounds == [header_bound(len(files))]

    channel = Announcing([b"[]", ACK_BYTES + 1])
    with pytest.raises(MessageTooLargeError, match="an ack: rank 1 announced"):
        replicator(tmp_path, channel)._send(3, 1, source.url, manifest, files)
    assert channel.bounds == [header_bound(len(files)), ACK_BYTES]


def test_a_replica_sender_refuses_a_malformed_have_list(tmp_path: Path) -> None:
    source, manifest, files = snapshot(tmp_path)
    with pytest.raises(MalformedMessageError, match="rank 1 sent a malformed have-list"):
        replicator(tmp_path, Announcing([b'{"a": 1}']))._send(3, 1, source.url, manifest, files)
    with pytest.raises(MalformedMessageError, match="a have-list from rank 1"):
        replicator(tmp_path, Announcing([b"[" * 10_000]))._send(3, 1, source.url, manifest, files)


def test_a_replica_receiver_bounds_the_header_by_the_round_s_manifest(tmp_path: Path) -> None:
    _, manifest, files = snapshot(tmp_path)
    channel = Announcing([header_bound(len(files)) + 1])
    with pytest.raises(MessageTooLargeError, match="a transfer header: rank 1 announced"):
        replicator(tmp_path, channel)._receive(3, 1, 0, manifest, ())
    assert channel.bounds == [header_bound(len(files))]
    assert json.loads(channel.sent[0]) == []  # its have-list; then an ack saying why
    assert json.loads(channel.sent[1])["ok"] is False


# ---------------------------------------------------------------- two gloo ranks

WORKER = """
import json, os, resource, sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ckptfmt.storage.slot import SlotStore
from ckptfmt.tier.wire import receive_files
from ckptfmt.torch.collective import TorchCollective

TAG, DONE, HUGE = 7, 8, 192 << 20
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
collective = TorchCollective()
if rank == 1:
    # the hostile rank: a 192 MiB "header" (a JSON string) on the tag rank 0 receives a transfer on
    header = torch.full((HUGE,), ord("a"), dtype=torch.uint8)
    header[0] = header[-1] = ord('"')
    dist.send(torch.tensor([HUGE], dtype=torch.int64), dst=0, tag=TAG)
    pending = dist.isend(header, dst=0, tag=TAG)  # never received by a receiver that refuses it
    dist.recv(torch.zeros(1, dtype=torch.int64), src=0, tag=DONE)
    print("rank 1 told", flush=True)
else:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        receive_files(collective, src=1, tag=TAG, destination=SlotStore(sys.argv[1]))
        outcome = "accepted"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"outcome": outcome, "grew_mib": grew / 1024}), flush=True)
    dist.send(torch.ones(1, dtype=torch.int64), dst=1, tag=DONE)
# a send rank 0 never received is still pending on rank 1: leave without tearing the group down
os._exit(0)
"""


@pytest.mark.slow  # two processes
def test_a_192_mib_header_from_a_gloo_peer_is_refused_without_allocating_it(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = launch(script, [str(tmp_path / "dest")], 2, timeout=180)
    said = json.loads(results[0].stdout.strip().splitlines()[-1])
    assert said["outcome"].startswith("MessageTooLargeError: a transfer header: rank 1 announced"), said
    assert said["grew_mib"] < 32, said  # was 578 MiB: the header received whole, then decoded


# ---------------------------------------------------------------- a spread persist's reports


def spread(tmp: Path) -> tuple[list[str], list[list[str]]]:
    """One checkpoint written by two ranks on nodes A and B (each its own slot); its slot paths and files, by rank."""
    from ckptfmt.tier.binding import SlotBinding, normalize_run_url, run_identity

    run = str(tmp / "run")
    nodes = ("A", "B")
    tiers = [MemoryTier(tmp / n, run) for n in nodes]
    group = ThreadCollective.group(2, timeout=TIMEOUT)
    binding = SlotBinding(
        run_id=run_identity(run), run_dir=normalize_run_url(run), node="A", world_size=2, step=3, nodes=nodes
    )

    def write(rank: int) -> tuple[str, list[str]]:
        tiers[rank].ensure()
        slot = tiers[rank].writable_slot(0)
        writer = CheckpointWriter(
            SlotStore(slot),
            profile="weights",
            overwrite=True,
            collective=group[rank],
            metadata=binding.to_metadata(),
            store_of_rank=(0, 1),
        )
        writer.write_tensor("weights", "w", np.full((4, 8), rank, dtype=np.float32), global_shape=(8, 8),
                            offsets=(4 * rank, 0))  # fmt: skip
        writer.commit()
        return slot, sorted(p for p in SlotStore(slot).list() if p not in ("manifest.json", ".ckptfmt-lock"))

    out = run_ranks(2, lambda rank, _: write(rank), TIMEOUT, group)
    return [o[0] for o in out], [o[1] for o in out]


class Garbles:
    """Rank ``rank``'s collective: its ``nth`` gather sends ``payload`` instead of what it was given."""

    def __init__(self, inner: ThreadCollective, nth: int, payload: bytes) -> None:
        self.inner, self.nth, self.payload, self.gathers = inner, nth, payload, 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def broadcast(self, data: bytes | None, *, src: int) -> bytes:
        return self.inner.broadcast(data, src=src)

    def gather(self, data: bytes, *, dst: int, max_size: int | None = None) -> list[bytes] | None:
        self.gathers += 1
        return self.inner.gather(self.payload if self.gathers == self.nth else data, dst=dst, max_size=max_size)


@pytest.mark.parametrize(
    "payload",
    [b"\xff not json", b'{"ok": {"written": 5}}', b'{"ok": [7]}', b"[" * 100_000, b'{"ok": "x", "error": {}}'],
)
def test_a_malformed_persist_report_fails_every_rank_at_once_naming_the_rank(tmp_path: Path, payload: bytes) -> None:
    slots, files = spread(tmp_path)
    run = RunDirectory(str(tmp_path / "run"))
    group = ThreadCollective.group(2, timeout=TIMEOUT)
    collectives = [group[0], Garbles(group[1], 2, payload)]  # its second gather: the files it copied

    out = run_ranks(
        2,
        lambda rank, _: persist_spread(slots[rank], run, collective=collectives[rank], files=files[rank]),
        TIMEOUT,
        group,
    )
    for exc in out:
        assert isinstance(exc, CollectiveError), out
        assert "rank 1" in str(exc) and "the persist of step 3" in str(exc), out
        assert "within" not in str(exc)  # not a timeout
    durable = tmp_path / "run" / checkpoint_name(3)
    left = [os.path.join(d, f) for d, _, names in os.walk(durable) for f in names]
    assert left == []  # no manifest, no file copied, the lock let go


def test_a_spread_persist_commits_when_every_report_is_sound(tmp_path: Path) -> None:
    slots, files = spread(tmp_path)
    run = RunDirectory(str(tmp_path / "run"))
    out = run_ranks(2, lambda rank, c: persist_spread(slots[rank], run, collective=c, files=files[rank]), TIMEOUT)
    assert all(not isinstance(o, BaseException) and o.status == "persisted" for o in out), out
    assert (tmp_path / "run" / checkpoint_name(3) / "manifest.json").exists()


def test_a_rank_whose_slot_cannot_be_read_fails_every_rank_at_once(tmp_path: Path) -> None:
    slots, files = spread(tmp_path)
    (Path(slots[1]) / "manifest.json").unlink()  # node B's slot lost its manifest (before: rank 0 waited forever)
    run = RunDirectory(str(tmp_path / "run"))
    out = run_ranks(2, lambda rank, c: persist_spread(slots[rank], run, collective=c, files=files[rank]), TIMEOUT)
    for exc in out:
        assert isinstance(exc, CheckpointError) and "rank 1" in str(exc) and "within" not in str(exc), out
    assert not (tmp_path / "run" / checkpoint_name(3) / "manifest.json").exists()
