"""The commit of a DCP save through ckptfmt (ckptfmt.dcp.StorageWriter): a crash at each point of ``finish`` leaves
the checkpoint whole or nothing that gc does not remove; the lock of a save that failed outside the writer is given
back; state kept as opaque pickle bytes only when both sides opt in; and interop with DCP's own format both ways.
(A rank failing or killed mid-save on 2 gloo ranks: tests/test_dcp_ranks.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_helpers import run_cli
from crash import killing
from test_dcp_storage import same, state
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ckptfmt import open_checkpoint
from ckptfmt.dcp import StorageReader, StorageWriter
from ckptfmt.errors import CheckpointLockedError, UsageError
from ckptfmt.run import RunDirectory

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable"),
]


class KilledInFinish(StorageWriter):
    """A writer whose ``finish`` is traced: SIGKILLed just before its ``kill_at``-th os call (None: counted)."""

    def __init__(self, url: Path, kill_at: int | None, *, overwrite: bool) -> None:
        super().__init__(url, overwrite=overwrite)
        self.counter = killing.Counter(kill_at)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with killing.traced_os(self.counter):
            super().finish(metadata, results)


def _save_in_child(url: Path, kill_at: int | None, *, overwrite: bool, calls: Path | None = None) -> killing.ChildExit:
    saved = state(2)  # here: torch's intra-op thread pool, once used in the parent, hangs a forked child that computes

    def work() -> None:
        writer = KilledInFinish(url, kill_at, overwrite=overwrite)
        dcp.save(saved, storage_writer=writer)
        if calls is not None:
            calls.write_text(str(writer.counter.calls))

    return killing.reap(killing.fork(work))


def _leftovers(run: Path) -> list[str]:
    directory = RunDirectory(str(run))
    directory.gc(keep_last=None)
    return [p for p in directory.store.list() if p != "latest.json"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
def test_a_crash_at_each_point_of_finish_leaves_the_checkpoint_whole_or_nothing_gc_leaves(
    tmp_path: Path, overwrite: bool
) -> None:
    counted = tmp_path / "count" / "ck"
    calls_file = tmp_path / "calls"
    if overwrite:
        dcp.save(state(0), storage_writer=StorageWriter(counted))
    assert _save_in_child(counted, None, overwrite=overwrite, calls=calls_file).finished
    calls = int(calls_file.read_text())
    assert calls >= 3  # a manifest written, fsynced and renamed into place at least
    outcomes: dict[str, int] = {"whole": 0, "nothing": 0}
    for kill_at in range(1, calls + 2):  # one past the last call: the save finishes
        run = tmp_path / f"kill-{kill_at}"
        url = run / "ck"
        if overwrite:
            dcp.save(state(0), storage_writer=StorageWriter(url))
        exit_ = _save_in_child(url, kill_at, overwrite=overwrite)
        assert exit_.killed == (kill_at <= calls), kill_at
        if (url / "manifest.json").exists():
            with open_checkpoint(str(url)) as ckpt:
                ckpt.verify()
            target = state(1)
            dcp.load(target, storage_reader=StorageReader(url))
            assert same(target, state(2)), f"killed at call {kill_at}: a committed checkpoint of other state"
            outcomes["whole"] += 1
        else:
            assert not exit_.finished, "the save returned, but nothing is committed"
            assert _leftovers(run) == [], f"killed at call {kill_at}: gc left files behind"
            outcomes["nothing"] += 1
    assert outcomes["whole"] >= 1 and outcomes["nothing"] >= 1, outcomes


def test_reset_gives_back_the_lock_of_a_save_that_failed_before_finish(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import SavePlan

    writer = StorageWriter(tmp_path / "ck")
    writer.set_up_storage_writer(True)
    writer.prepare_global_plan([SavePlan([])])  # the lock taken; then DCP failed elsewhere, finish never ran
    with pytest.raises(CheckpointException) as caught:  # another writer meets the lock
        dcp.save(state(0), storage_writer=StorageWriter(tmp_path / "ck"))
    ((error, _),) = caught.value.failures.values()
    assert isinstance(error, CheckpointLockedError)
    dcp.save(state(0), storage_writer=writer)  # the same writer's next save: reset gave its lock back
    target = state(1)
    dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    assert same(target, state(0))


class Opaque:
    """State that only pickle carries."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


def test_opaque_state_is_kept_only_when_the_writer_opts_in_and_loaded_only_when_the_reader_does_and_allows_it(
    tmp_path: Path,
) -> None:
    saved: dict[str, Any] = {"w": torch.arange(4.0), "thing": Opaque(7), "plain": {"step": 3}}
    dcp.save(saved, storage_writer=StorageWriter(tmp_path / "ck", pickled_objects=True))
    assert run_cli("verify", str(tmp_path / "ck")).exit_code == 0
    target: dict[str, Any] = {"w": torch.zeros(4), "thing": Opaque(0), "plain": {"step": 0}}
    with pytest.raises(CheckpointException) as caught:  # by default: refused, before anything changed
        dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))
    ((error, _),) = caught.value.failures.values()
    assert isinstance(error, UsageError) and error.tensor == "thing" and "pickle" in error.message
    assert torch.equal(target["w"], torch.zeros(4)) and target["thing"] == Opaque(0)
    with pytest.raises(CheckpointException) as caught:  # opted in, but Opaque is not allowed for restricted loading
        dcp.load(target, storage_reader=StorageReader(tmp_path / "ck", pickled_objects=True))
    ((error, _),) = caught.value.failures.values()
    assert isinstance(error, UsageError) and error.tensor == "thing" and "weights_only" in error.message
    assert torch.equal(target["w"], torch.zeros(4)) and target["thing"] == Opaque(0)
    with torch.serialization.safe_globals([Opaque]):
        dcp.load(target, storage_reader=StorageReader(tmp_path / "ck", pickled_objects=True))
    assert torch.equal(target["w"], saved["w"]) and target["thing"] == Opaque(7) and target["plain"] == {"step": 3}
    # the plain values stay plain: only the opted-in item is pickle bytes
    with open_checkpoint(str(tmp_path / "ck")) as ckpt:
        doc = ckpt.read_context("objects")
    assert doc["pickled"] == ["thing"]


def _tuples_as_lists(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_tuples_as_lists(v) for v in value]
    if isinstance(value, list):
        return [_tuples_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _tuples_as_lists(v) for k, v in value.items()}
    return value


def test_one_state_saved_by_both_writers_loads_bit_identical_through_every_reader_path(tmp_path: Path) -> None:
    saved = state(0)
    dcp.save(saved, storage_writer=StorageWriter(tmp_path / "ours"))
    dcp.save(saved, storage_writer=FileSystemWriter(str(tmp_path / "theirs")))
    # DCP's directory into ckptfmt (ckpt convert), and ckptfmt's checkpoint into a DCP directory
    for src, dst, to in (("theirs", "theirs-as-ckptfmt", "ckptfmt"), ("ours", "ours-as-dcp", "dcp")):
        run = run_cli("convert", str(tmp_path / src), str(tmp_path / dst), "--to", to)
        assert run.exit_code == 0, run.stdout + run.stderr
    readers = {
        "ours by ckptfmt": StorageReader(tmp_path / "ours"),
        "theirs by DCP": FileSystemReader(str(tmp_path / "theirs")),
        "theirs converted, by ckptfmt": StorageReader(tmp_path / "theirs-as-ckptfmt"),
    }
    for name, reader in readers.items():
        target = state(1)
        dcp.load(target, storage_reader=reader)
        # ckpt convert keeps DCP's non-tensor items as msgpack, which has no tuple (Adam's betas come back a list)
        expected = _tuples_as_lists(saved) if "converted" in name else saved
        assert same(target, expected), name
    # ckpt convert --to dcp exports one tensor field (weights): the model's tensors, bit for bit through DCP's reader
    model = {"model": state(1)["model"]}
    dcp.load(model, storage_reader=FileSystemReader(str(tmp_path / "ours-as-dcp")))
    assert same(model, {"model": saved["model"]})
