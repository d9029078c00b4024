"""ckptfmt as torchft's CheckpointTransport (ckptfmt.torch.ft_transport), in one process: no lighthouse, no workers.

A heal moves a checked checkpoint between two transports over HTTP on the loopback: any state dict torchft hands
it (its own multi-recovery scenario included), and the training state, from the sender's memory tier or from a
snapshot of its live state. What a peer sends is hostile input: a lying sender (a damaged file, an offer of another
step, an oversized message, a stream cut short) is refused naming it, and nothing of what it sent stays behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import threading
import unittest
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

import torch
from torch import nn
from torchft.checkpointing.transport_test import run_multi_recovery_test  # type: ignore[import-untyped]

from ckptfmt.errors import (
    CheckpointError,
    ContextError,
    HealRefusedError,
    MessageTooLargeError,
    UsageError,
)
from ckptfmt.manifest_parse import parse_manifest
from ckptfmt.paths import MANIFEST_NAME
from ckptfmt.storage.local import LocalStore
from ckptfmt.tier import wire
from ckptfmt.tier.heal_server import OFFER_BYTES, TAG
from ckptfmt.tier.stream_channel import StreamChannel
from ckptfmt.torch import CheckpointManager, MemoryOptions, ReplicaBatches, TrainingState, state_tree
from ckptfmt.torch.ft_transport import CkptfmtTransport, Healed
from ckptfmt.writer import CheckpointWriter

SHORT = timedelta(seconds=5)
MakeTransport = Callable[..., CkptfmtTransport]


@pytest.fixture
def make_transport() -> Iterator[MakeTransport]:
    """Transports on the loopback with short timeouts, every one shut down at the end of the test."""
    made: list[CkptfmtTransport] = []

    def make(**kwargs: Any) -> CkptfmtTransport:
        kwargs.setdefault("host", "127.0.0.1")
        kwargs.setdefault("timeout", SHORT)
        transport = CkptfmtTransport(**kwargs)
        made.append(transport)
        return transport

    yield make
    shut_down_all(made)


def shut_down_all(transports: list[CkptfmtTransport]) -> None:
    """Each shutdown waits for its server's poll interval: all at once."""
    threads = [threading.Thread(target=t.shutdown) for t in transports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def leftovers(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


def assert_same_tree(got: object, want: object, where: str = "root") -> None:
    """Equal values of the same types all the way down (a mapping comes back a dict); tensors of the same dtype,
    shape and values."""
    expected = dict if isinstance(want, dict) else type(want)
    assert type(got) is expected, f"{where}: {type(got).__name__} is not {expected.__name__}"
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict)
        assert list(got) == list(want), where  # the keys, their types (int stays int) and their order
        for key, value in want.items():
            assert_same_tree(got[key], value, f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple)
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_tree(a, b, f"{where}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    else:
        assert got == want, where


# ---------------------------------------------------------------- 1. torchft's own scenario


def test_torchft_multi_recovery_scenario_passes(make_transport: MakeTransport, tmp_path: Path) -> None:
    import torch.distributed as dist

    def init(rank: int, world_size: int) -> CkptfmtTransport:
        return make_transport(staging_dir=tmp_path / f"stage-{rank}")

    for rank in range(3):
        (tmp_path / f"stage-{rank}").mkdir()
    try:
        run_multi_recovery_test(unittest.TestCase(), init, torch.device("cpu"))
    finally:
        if dist.is_initialized():  # it destroys the group itself when it passes
            dist.destroy_process_group()
    for rank in range(3):  # it shut every transport down: nothing received or offered is left
        assert leftovers(tmp_path / f"stage-{rank}") == []


# ---------------------------------------------------------------- 2. state dicts of any shape


def generic_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    matrix = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "user": {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),  # int keys, a tuple of betas, None values
            "bf16": torch.randn(5, dtype=torch.bfloat16),
            "int64": torch.tensor([-(2**40), 0, 2**62], dtype=torch.int64),
            "strided": matrix.t()[::2],  # not contiguous
            "scalar": torch.tensor(3.5),
            "plain": {
                "none": None,
                "yes": True,
                "no": False,
                "name": "run-7",
                "inf": math.inf,
                "minf": -math.inf,
                "nan": math.nan,
            },
            "nested": [[1, [2.5, "x"]], (3, [None, torch.ones(2, dtype=torch.int32)])],
            7: "an int key",
        },
        "torchft": {"step": 12, "batches_committed": 48},
    }


def test_state_dicts_of_any_shape_round_trip_exactly(make_transport: MakeTransport, tmp_path: Path) -> None:
    sent = generic_state()
    assert not sent["user"]["strided"].is_contiguous()
    sender = make_transport(staging_dir=tmp_path)
    receiver = make_transport(staging_dir=tmp_path)
    sender.send_checkpoint([1], 12, sent, SHORT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 12, SHORT)
    assert_same_tree(got, sent)
    assert receiver._made == set()  # the received checkpoint was freed once read
    sender.disallow_checkpoint()
    assert leftovers(tmp_path) == []


def test_a_leaf_or_key_that_needs_pickle_is_refused_where_it_is(make_transport: MakeTransport, tmp_path: Path) -> None:
    sender = make_transport(staging_dir=tmp_path)
    for leaf in (object(), {1, 2}, bytearray(b"bytes"), 1 + 2j):
        state = {"user": {"default": {"weights": torch.zeros(2), "extra": [0, leaf]}}, "torchft": {"step": 1}}
        with pytest.raises(UsageError, match="neither a tensor nor a plain value") as info:
            sender.send_checkpoint([1], 1, state, SHORT)
        assert info.value.field == "user/default/extra/1"
    with pytest.raises(UsageError, match="str and int keys only") as info:
        sender.send_checkpoint([1], 1, {"user": {"lrs": {0.5: 1}}, "torchft": {}}, SHORT)
    assert info.value.field == "user/lrs"
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------- 3. the step asked for


def test_a_step_other_than_the_one_offered_is_refused_naming_it(make_transport: MakeTransport, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    sender = make_transport(staging_dir=tmp_path)
    receiver = make_transport(staging_dir=stage)
    sender.send_checkpoint([1], 2345, {"user": {"t": torch.ones(3)}, "torchft": {"step": 2345}}, SHORT)
    with pytest.raises(HealRefusedError, match="serving step 2345, not step 1234") as info:
        receiver.recv_checkpoint(0, sender.metadata(), 1234, SHORT)
    assert sender.metadata() in str(info.value)
    assert receiver.refusals == [str(info.value)]
    assert receiver._made == set() and leftovers(stage) == []


def test_a_step_never_offered_times_out(make_transport: MakeTransport, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    sender = make_transport(staging_dir=tmp_path, timeout=timedelta(seconds=1))
    receiver = make_transport(staging_dir=stage)
    sender.send_checkpoint([1], 1, {"user": {"t": torch.ones(3)}, "torchft": {"step": 1}}, SHORT)
    # the socket's own reason after the transport's "timed out or refused": not a refused connection
    with pytest.raises(HealRefusedError, match=r"refused\): .*timed out"):
        receiver.recv_checkpoint(0, sender.metadata(), 2, timedelta(milliseconds=50))
    assert receiver._made == set() and leftovers(stage) == []


def test_a_withdrawn_offer_is_not_served(make_transport: MakeTransport, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    sender = make_transport(staging_dir=tmp_path, timeout=timedelta(seconds=0.2))
    receiver = make_transport(staging_dir=stage)
    sender.send_checkpoint([1], 1, {"user": {"t": torch.ones(3)}, "torchft": {"step": 1}}, SHORT)
    sender.disallow_checkpoint()
    assert leftovers(tmp_path) == ["stage"]  # the offer's live snapshot is gone with it
    with pytest.raises(HealRefusedError, match="HTTP 503"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, SHORT)
    assert leftovers(stage) == []


# ---------------------------------------------------------------- 4. a lying sender

Behaviour = Callable[[Callable[[bytes], object]], object]


class Liar:
    """An HTTP server that answers every request with a 200 and whatever ``behave`` writes (no digest check of its
    own, unlike HealServer), and the transport that heals from it. One per module: a server's shutdown waits for
    its poll interval."""

    def __init__(self, stage: Path) -> None:
        self.behave: Behaviour = lambda write: None
        liar = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                with contextlib.suppress(OSError, CheckpointError):  # the receiver may hang up first
                    liar.behave(self.wfile.write)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        self.address = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.stage = stage
        self.receiver = CkptfmtTransport(host="127.0.0.1", timeout=SHORT, staging_dir=stage)

    def heal(self, behave: Behaviour) -> dict[str, Any]:
        self.behave = behave
        return self.receiver.recv_checkpoint(0, self.address, STEP, SHORT)

    def refused(self, behave: Behaviour) -> HealRefusedError:
        """The heal from a sender that behaves so is refused naming it; nothing returned, nothing left behind."""
        got: object = None
        with pytest.raises(HealRefusedError) as info:
            got = self.heal(behave)
        assert got is None
        assert self.address in str(info.value)
        assert self.receiver.refusals[-1] == str(info.value)
        assert self.receiver._made == set() and leftovers(self.stage) == []
        return info.value

    def close(self) -> None:
        self.receiver.shutdown()
        self.http.shutdown()
        self.http.server_close()
        self.thread.join()


@pytest.fixture(scope="module")
def liar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Liar]:
    made = Liar(tmp_path_factory.mktemp("stage"))
    yield made
    made.close()


STEP = 5


def tree_checkpoint(directory: Path, step: int = STEP) -> tuple[LocalStore, bytes, str]:
    """A committed tree checkpoint (as the transport writes one); its store, manifest and the relative path of
    its tensor data file."""
    tensors, root = state_tree.flatten({"user": {"w": torch.arange(4096, dtype=torch.float32)}, "torchft": {}})
    store = LocalStore(str(directory), direct_io=False)
    with CheckpointWriter(store, profile="weights") as writer:
        writer.write_tensors(state_tree.TENSORS, tensors)
        writer.write_context(state_tree.FIELD, {"root": root, "step": step})
    data = [p for p in directory.rglob("*.safetensors")]
    assert len(data) == 1
    return store, store.read(MANIFEST_NAME), data[0].relative_to(directory).as_posix()


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def offer(step: int) -> bytes:
    return json.dumps({"kind": "tree", "source": "live", "step": step}, sort_keys=True).encode()


def transfer(write: Callable[[bytes], object], store: LocalStore, manifest: bytes, offered_step: int) -> None:
    channel = StreamChannel(peer="receiver", write=write)
    channel.send(offer(offered_step), dst=1, tag=TAG)
    paths = [f.path for f in parse_manifest(manifest).files]
    wire.send_files(channel, dst=1, tag=TAG, source=store, manifest_bytes=manifest, paths=paths)


def test_a_file_damaged_after_commit_is_refused_naming_sender_and_file(liar: Liar, tmp_path: Path) -> None:
    store, manifest, data = tree_checkpoint(tmp_path / "ckpt")
    flip_last_byte(tmp_path / "ckpt" / data)
    error = liar.refused(lambda write: transfer(write, store, manifest, STEP))
    assert error.path == data


def test_the_same_checkpoint_undamaged_is_taken(liar: Liar, tmp_path: Path) -> None:
    """The control for the lying sender: its way of sending is not what is refused."""
    store, manifest, _ = tree_checkpoint(tmp_path / "ckpt")
    got = liar.heal(lambda write: transfer(write, store, manifest, STEP))
    assert_same_tree(got, {"user": {"w": torch.arange(4096, dtype=torch.float32)}, "torchft": {}})


def test_an_offer_of_another_step_is_refused(liar: Liar, tmp_path: Path) -> None:
    store, manifest, _ = tree_checkpoint(tmp_path / "ckpt")
    error = liar.refused(lambda write: transfer(write, store, manifest, STEP + 1))
    assert f"not step {STEP}" in str(error)


def test_a_checkpoint_of_another_step_under_an_honest_offer_is_refused(liar: Liar, tmp_path: Path) -> None:
    """The offer says STEP, the checkpoint's own tree context another: the checkpoint is what is believed."""
    store, manifest, _ = tree_checkpoint(tmp_path / "ckpt", step=STEP + 1)
    error = liar.refused(lambda write: transfer(write, store, manifest, STEP))
    assert f"step {STEP + 1}, not {STEP}" in str(error)


def test_an_oversized_offer_is_refused_before_allocation(liar: Liar) -> None:
    def announce(write: Callable[[bytes], object]) -> None:
        # far more than could be allocated or sent: a receiver that believed it would fail some other way
        write(struct.pack("<Q", 1 << 62))
        write(b"x" * 1024)

    error = liar.refused(announce)
    assert isinstance(error.__cause__, MessageTooLargeError)
    assert f"{OFFER_BYTES:,}" in str(error)


def test_an_offer_one_byte_over_its_bound_is_refused(liar: Liar) -> None:
    body = json.dumps({"step": STEP, "kind": "tree", "pad": ""}).encode()
    body = body.replace(b'""', b'"' + b"x" * (OFFER_BYTES + 1 - len(body)) + b'"')
    assert len(body) == OFFER_BYTES + 1
    error = liar.refused(lambda write: (write(struct.pack("<Q", len(body))), write(body)))
    assert isinstance(error.__cause__, MessageTooLargeError)


def test_a_stream_cut_short_mid_file_is_refused(liar: Liar, tmp_path: Path) -> None:
    store, manifest, _ = tree_checkpoint(tmp_path / "ckpt")
    whole = bytearray()
    transfer(whole.extend, store, manifest, STEP)
    error = liar.refused(lambda write: write(bytes(whole[:-1])))  # the last file's last byte never comes
    assert "short" in str(error)


def test_offers_that_do_not_fit_are_refused(liar: Liar, tmp_path: Path) -> None:
    store, manifest, _ = tree_checkpoint(tmp_path / "ckpt")
    paths = [f.path for f in parse_manifest(manifest).files]
    for info in (
        [STEP],
        {"step": str(STEP)},
        {"step": STEP, "kind": "pickle"},
        {"step": STEP, "kind": "training", "key": "default", "torchft": {"step": STEP}},  # this receiver has none
    ):

        def send(write: Callable[[bytes], object], info: object = info) -> None:
            channel = StreamChannel(peer="receiver", write=write)
            channel.send(json.dumps(info).encode(), dst=1, tag=TAG)
            wire.send_files(channel, dst=1, tag=TAG, source=store, manifest_bytes=manifest, paths=paths)

        liar.refused(send)


# ---------------------------------------------------------------- 5-7. the training state


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The model's tensors and the optimizer's state in the optimizer's order of parameters."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(name.encode() + v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Group:
    """One replica group: a model, AdamW, a ReplicaBatches sampler, its manager and its transport."""

    def __init__(self, tmp: Path, name: str, seed: int, memory: bool, make: MakeTransport) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.batches = ReplicaBatches(256, batch_size=4, seed=1)
        self.state = TrainingState(model=self.model, optimizer=self.optimizer, sampler=self.batches, config={"w": 8})
        options = MemoryOptions(every=1, memory_dir=tmp / f"mem-{name}") if memory else None
        self.manager = CheckpointManager(tmp / f"run-{name}", memory=options, preemption_signals=())
        self.stage = tmp / f"stage-{name}"
        self.stage.mkdir()
        self.transport = make(manager=self.manager, state=self.state, staging_dir=None if memory else self.stage)

    def train(self, steps: range, *, snapshot: bool) -> None:
        x = torch.randn(256, 8, generator=torch.Generator().manual_seed(7))
        for step in steps:
            self.model(x[self.batches.indices(0, 1)]).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.batches.commit(1, step=step, replica_rank=0)
            if snapshot:
                self.manager.checkpoint_if_due(step, self.state, every=100)
        self.manager.wait_memory()

    def offer(self, step: int) -> None:
        state = {"user": {"default": self.transport.state_dict()}, "torchft": {"step": step, "batches_committed": step}}
        self.transport.send_checkpoint([1], step, state, SHORT)

    def digest(self) -> tuple[str, object]:
        return state_digest(self.model, self.optimizer), self.batches.state_dict()


MakeGroups = Callable[..., list[Group]]


@pytest.fixture
def make_groups(tmp_path: Path, make_transport: MakeTransport) -> Iterator[MakeGroups]:
    """A sender and a receiver (the receiver's memory tier on), each manager closed at the end of the test."""
    made: list[Group] = []

    def make(*, sender_memory: bool = True) -> list[Group]:
        made.extend(
            [Group(tmp_path, "a", 0, sender_memory, make_transport), Group(tmp_path, "b", 1, True, make_transport)]
        )
        return made

    yield make
    shut_down_all([group.transport for group in made])
    for group in made:
        group.manager.close(persist=False)


def heal(sender: Group, receiver: Group, step: int) -> Healed:
    got = receiver.transport.recv_checkpoint(0, sender.transport.metadata(), step, SHORT)
    assert set(got) == {"user", "torchft"}
    assert got["torchft"] == {"step": step, "batches_committed": step}
    healed = got["user"]["default"]
    assert isinstance(healed, Healed) and healed.step == step
    return healed


def test_training_state_heals_from_the_memory_tier(make_groups: MakeGroups) -> None:
    sender, receiver = make_groups()
    sender.train(range(1, 4), snapshot=True)
    assert sender.digest() != receiver.digest()
    sender.offer(3)
    healed = heal(sender, receiver, 3)
    sender.transport.disallow_checkpoint()
    receiver.transport.load_state_dict(healed)
    assert receiver.digest() == sender.digest()
    report = receiver.manager.last_restore
    assert report is not None and report.tier == "healed" and report.step == 3
    assert report.url == sender.transport.metadata()
    assert any("(memory)" in source for source in report.sources.values())
    assert report.bytes_read > 0
    assert (sender.transport.offers_from_memory, sender.transport.offers_from_live) == (1, 0)
    assert receiver.transport._made == set()  # the staging copy is gone once applied


@pytest.mark.parametrize("memory", [False, True], ids=["memory-off", "snapshot-older"])
def test_training_state_heals_from_a_live_snapshot(make_groups: MakeGroups, memory: bool) -> None:
    sender, receiver = make_groups(sender_memory=memory)
    sender.train(range(1, 3), snapshot=memory)
    sender.train(range(3, 4), snapshot=False)  # step 3 is in no snapshot
    sender.offer(3)
    healed = heal(sender, receiver, 3)
    receiver.transport.load_state_dict(healed)
    sender.transport.disallow_checkpoint()
    assert receiver.digest() == sender.digest()
    report = receiver.manager.last_restore
    assert report is not None and report.tier == "healed"
    assert any("(live)" in source for source in report.sources.values())
    assert (sender.transport.offers_from_memory, sender.transport.offers_from_live) == (0, 1)
    assert leftovers(sender.stage) == []  # the live snapshot went with the offer


def test_a_damaged_memory_snapshot_is_refused_then_healed_from_live(make_groups: MakeGroups) -> None:
    sender, receiver = make_groups()
    sender.train(range(1, 4), snapshot=True)
    memory = sender.manager._memory
    assert memory is not None and memory.newest is not None and memory.newest.step == 3
    slot = Path(memory.tier.slot_path(memory.newest.slot))
    data = sorted(slot.rglob("*.safetensors"))
    assert data
    flip_last_byte(data[0])
    before = receiver.digest()

    sender.offer(3)
    with pytest.raises(HealRefusedError) as info:
        receiver.transport.recv_checkpoint(0, sender.transport.metadata(), 3, SHORT)
    assert sender.transport.metadata() in str(info.value)
    assert info.value.path == data[0].relative_to(slot).as_posix()
    assert receiver.digest() == before
    assert receiver.manager.last_restore is None
    assert len(sender.transport._damaged) == 1
    assert receiver.transport._made == set()

    sender.offer(3)  # torchft's next quorum asks again
    healed = heal(sender, receiver, 3)
    receiver.transport.load_state_dict(healed)
    sender.transport.disallow_checkpoint()
    assert receiver.digest() == sender.digest()
    assert (sender.transport.offers_from_memory, sender.transport.offers_from_live) == (1, 1)
    report = receiver.manager.last_restore
    assert report is not None and any("(live)" in source for source in report.sources.values())


def test_a_training_state_offered_with_other_state_is_refused(make_groups: MakeGroups) -> None:
    sender, _ = make_groups()
    state = {"user": {"default": sender.transport.state_dict(), "other": {"x": 1}}, "torchft": {"step": 1}}
    with pytest.raises(UsageError, match="only state registered"):
        sender.transport.send_checkpoint([1], 1, state, SHORT)


def test_torchft_counters_that_do_not_fit_are_refused(make_groups: MakeGroups) -> None:
    sender, _ = make_groups()
    for ft_state in ({"step": 2}, {"step": -1}, {"step": 1.0}, {"step": True}, "x", {str(i): 1 for i in range(17)}):
        state = {"user": {"default": sender.transport.state_dict()}, "torchft": ft_state}
        with pytest.raises(HealRefusedError, match="torchft's state"):
            sender.transport.send_checkpoint([1], 1, state, SHORT)
    assert sender.transport.offers_from_live == sender.transport.offers_from_memory == 0


# ---------------------------------------------------------------- 8. hostile tree contexts

T = torch.zeros(2)


def deep(levels: int) -> dict[str, object]:
    node: dict[str, object] = {"value": 1}
    for _ in range(levels):
        node = {"list": [node]}
    return node


@pytest.mark.parametrize(
    ("root", "tensors"),
    [
        ({"dict": [["a", {"tensor": "a"}], ["b", {"tensor": "missing"}]]}, {"a": T}),
        ({"list": [{"tensor": "a"}, {"tensor": "a"}]}, {"a": T}),
        ({"dict": [["a", {"tensor": "a"}]]}, {"a": T, "b": T}),
        ({"tensor": 3}, {"a": T}),
        (deep(state_tree.MAX_DEPTH + 1), {}),
        ("root", {}),
        ({"value": 1, "list": []}, {}),
        ({"dict": [["k"]]}, {}),
        ({"dict": [["k", {"value": 1}], ["k", {"value": 2}]]}, {}),
        ({"dict": [[1.5, {"value": 1}]]}, {}),
        ({"dict": {"k": {"value": 1}}}, {}),
        ({"value": [1]}, {}),
        ({"float": "1e999"}, {}),
        ({"pickle": "gASV"}, {}),
        ({"tensor": "a", "dtensor": "a mesh"}, {"a": T}),
    ],
    ids=[
        "tensor-not-in-checkpoint",
        "tensor-named-twice",
        "tensor-not-in-tree",
        "tensor-name-not-a-string",
        "too-deep",
        "not-a-map",
        "two-members",
        "dict-entry-not-a-pair",
        "dict-key-twice",
        "dict-key-a-float",
        "dict-body-a-map",
        "value-a-list",
        "float-not-special",
        "unknown-kind",
        "dtensor-not-a-map",
    ],
)
def test_a_hostile_tree_context_is_refused(root: object, tensors: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ContextError) as info:
        state_tree.unflatten(root, tensors)
    assert info.value.field == "tree"


def test_the_deepest_tree_allowed_is_taken() -> None:
    """The control for "too-deep": the bound is where it says."""
    assert state_tree.unflatten(deep(state_tree.MAX_DEPTH), {}) is not None


# ---------------------------------------------------------------- 9. usage


def test_load_state_dict_takes_only_what_the_transport_received(make_groups: MakeGroups) -> None:
    _, receiver = make_groups()
    values: tuple[object, ...] = ({"model": {}}, None, receiver.transport.state_dict())
    for value in values:
        with pytest.raises(UsageError, match="expected what this transport received"):
            receiver.transport.load_state_dict(value)


def test_a_manager_without_a_state_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", preemption_signals=())
    try:
        with pytest.raises(UsageError, match="both manager= and state="):
            CkptfmtTransport(manager=manager, host="127.0.0.1")
    finally:
        manager.close()


def test_a_transport_without_a_training_state_has_no_state_dict(make_transport: MakeTransport, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="needs a transport made with manager="):
        make_transport(staging_dir=tmp_path).state_dict()


def test_a_peer_without_the_token_is_refused_the_state(tmp_path: Path) -> None:
    timeout = timedelta(seconds=5)
    tree = {"user": {"default": {"w": torch.arange(4.0)}}, "torchft": {"step": 3, "batches_committed": 3}}
    sender = CkptfmtTransport(host="127.0.0.1", timeout=timeout, staging_dir=tmp_path, token="s3cret")
    stranger = CkptfmtTransport(host="127.0.0.1", timeout=timeout, staging_dir=tmp_path)
    friend = CkptfmtTransport(host="127.0.0.1", timeout=timeout, staging_dir=tmp_path, token="s3cret")
    try:
        sender.send_checkpoint([1], 3, tree, timeout)
        with pytest.raises(HealRefusedError, match="403"):
            stranger.recv_checkpoint(0, sender.metadata(), 3, timeout)
        got = friend.recv_checkpoint(0, sender.metadata(), 3, timeout)
        assert torch.equal(got["user"]["default"]["w"], torch.arange(4.0))
    finally:
        for transport in (sender, stranger, friend):
            transport.shutdown()
