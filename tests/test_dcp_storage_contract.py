"""What PyTorch's own storage-layer tests check of ``FileSystemWriter``/``FileSystemReader`` and of the fsspec
writer, checked of ``ckptfmt.dcp.StorageWriter``/``StorageReader`` in their place (issue 41), in one process, on
every backend of tests/conftest.py (local, ``memory://``, S3), and the cases that need ranks (ShardedTensors and
DTensors resharded, FSDP2 and overwrite through an fsspec URL) on 2 gloo ranks (``slow``).

The cases, from PyTorch's test/distributed/checkpoint/test_file_system_checkpoint_cpu.py and test_fsspec.py:

- only tensors round trip, with one I/O thread or several (``test_read_write_only_tensor``);
- tensors and a Stateful's state round trip through a stream extension (Rot13, ZStandard), which the reader learns
  from the checkpoint (``test_read_write_tensor_and_blob``): here with ``codec="zstd"``; a blob of raw ``bytes``
  round-trips as opaque bytes (never unpickled), a value that is not plain is refused naming its key;
- plain values round trip (``test_save_load_bytes``);
- a tensor saved in one dtype loads into a template of another as DCP's own reader casts it
  (``test_dtype_mismatch_casting``, its default half);
- an existing checkpoint is refused without ``overwrite`` and replaced with it (fsspec ``test_overwrite``);
- a failed write leaves nothing committed and no file behind, a failed read leaves the checkpoint as it was
  (fsspec ``test_remove_on_fail``);
and what DCP's storage interface asks of every writer and reader: ``checkpoint_id`` given to ``dcp.save``/``load``
(``reset``), ``validate_checkpoint_id``, ``storage_meta``, and a partial load (``allow_partial_load``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from process_ranks import launch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ckptfmt.dcp import StorageReader, StorageWriter
from ckptfmt.errors import CheckpointExistsError, UsageError
from ckptfmt.reader import open_checkpoint
from ckptfmt.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Net(nn.Module):
    """Two linears and an embedding bag: the shapes of PyTorch's test module."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear_1 = nn.Linear(5, 5)
        self.linear_2 = nn.Linear(5, 1)
        self.emb = nn.EmbeddingBag(5, 10)


class Progress:
    """A Stateful whose state is plain values (DCP saves it as a byte item)."""

    def __init__(self, step: int, tag: str) -> None:
        self.state: dict[str, Any] = {"step": step, "tag": tag, "seen": [step, step + 1], "lr": math.inf}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = dict(state_dict)


def tensors(seed: int) -> dict[str, Any]:
    return dict(Net(seed).state_dict())


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys, tensors equal in dtype and bits, Statefuls equal in state, other values equal."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and value.dtype == other.dtype and torch.equal(value, other)):
                return False
        elif isinstance(value, Progress):
            if not (isinstance(other, Progress) and value.state == other.state):
                return False
        elif value != other:
            return False
    return True


def files(url: str) -> dict[str, int]:
    return open_store(url).list()


def only_error(caught: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    ((error, _),) = caught.value.failures.values()
    return error


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("thread_count", [1, 2])
def test_only_tensors_round_trip(store_url: str, thread_count: int) -> None:
    saved = tensors(0)
    dcp.save(saved, storage_writer=StorageWriter(store_url, thread_count=thread_count), no_dist=True)
    target = tensors(1)
    assert not equal(target, saved)
    dcp.load(target, storage_reader=StorageReader(store_url), no_dist=True)
    assert equal(target, saved)


@pytest.mark.parametrize(("local_ranks", "expected"), [("1", 2), ("2", 1), ("8", 1)])
def test_the_default_thread_count_is_this_ranks_share_of_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_ranks: str, expected: int
) -> None:
    from ckptfmt import read_executor, writer

    monkeypatch.setattr(read_executor, "usable_cores", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    seen: list[int] = []
    real = writer.CheckpointWriter.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(kwargs["workers"])
        real(self, *args, **kwargs)

    monkeypatch.setattr(writer.CheckpointWriter, "__init__", spy)
    dcp.save(tensors(0), storage_writer=StorageWriter(tmp_path / "ck"), no_dist=True)
    assert seen == [expected]


@pytest.mark.parametrize("codec", [None, "zstd"])
@pytest.mark.parametrize("thread_count", [1, 3])
def test_tensors_and_a_statefuls_state_round_trip_and_the_reader_learns_the_codec(
    store_url: str, codec: str | None, thread_count: int
) -> None:
    torch.manual_seed(0)
    big = torch.randn(64, 64).to(torch.bfloat16)  # chunks under 4 KiB stay raw whatever the codec
    saved = {**tensors(0), "big": big, "progress": Progress(7, "run0")}
    dcp.save(saved, storage_writer=StorageWriter(store_url, codec=codec, thread_count=thread_count))
    with open_checkpoint(store_url) as ckpt:
        assert {c.codec.name for c in ckpt.tensor("weights", "big").chunks} == {codec or "raw"}
    target = {**tensors(1), "big": torch.zeros_like(big), "progress": Progress(0, "")}
    assert not equal(target, saved)
    dcp.load(target, storage_reader=StorageReader(store_url))  # no codec given: the manifest says
    assert equal(target, saved)


def test_plain_values_round_trip(store_url: str) -> None:
    dcp.save({"bytes0": [1], "bytes1": "string", "step": 3}, storage_writer=StorageWriter(store_url))
    target: dict[str, Any] = {"bytes0": [2], "bytes1": "other", "step": 0}
    dcp.load(target, storage_reader=StorageReader(store_url))
    assert target == {"bytes0": [1], "bytes1": "string", "step": 3}


class Blob:
    """PyTorch's BlobState: a Stateful holding raw bytes."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = dict(state_dict)


def test_a_blob_of_raw_bytes_round_trips_as_opaque_bytes(store_url: str) -> None:
    blob = Blob(b"SomeBlobForTesting\x00\xff")  # torchtitan keeps its data loader's state so: pickled by itself
    dcp.save({**tensors(0), "test_blob": blob}, storage_writer=StorageWriter(store_url))
    target = Blob(b"")
    dcp.load({**tensors(1), "test_blob": target}, storage_reader=StorageReader(store_url))
    assert target.state == {"blob": b"SomeBlobForTesting\x00\xff"}


def test_a_value_that_is_not_plain_is_refused_naming_its_key_and_nothing_is_committed(store_url: str) -> None:
    with pytest.raises(CheckpointException) as caught:
        dcp.save({**tensors(0), "test_blob": Blob(bytearray(b"x"))}, storage_writer=StorageWriter(store_url))  # type: ignore[arg-type]
    error = only_error(caught)
    assert isinstance(error, UsageError) and error.tensor == "test_blob.blob", error
    assert "test_blob.blob" in error.message
    assert files(store_url) == {}


def test_a_tensor_loads_into_a_template_of_another_dtype_as_through_the_file_system_reader(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for saved_dtype, template_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        saved = {"w": torch.rand(4, 3, dtype=saved_dtype)}
        ours, theirs = tmp_path / f"ours-{saved_dtype}", tmp_path / f"theirs-{saved_dtype}"
        dcp.save(saved, storage_writer=StorageWriter(ours))
        dcp.save(saved, storage_writer=FileSystemWriter(str(theirs)))
        a, b = {"w": torch.zeros(4, 3, dtype=template_dtype)}, {"w": torch.zeros(4, 3, dtype=template_dtype)}
        dcp.load(a, storage_reader=StorageReader(ours))
        dcp.load(b, storage_reader=FileSystemReader(str(theirs)))
        assert a["w"].dtype == template_dtype and torch.equal(a["w"], b["w"])
        assert torch.equal(a["w"], saved["w"].to(template_dtype))


# ---------------------------------------------------------------- partial loads


def test_a_state_dict_with_fewer_keys_loads_those_keys_only(store_url: str) -> None:
    saved = {**tensors(0), "progress": Progress(7, "run0")}
    dcp.save(saved, storage_writer=StorageWriter(store_url))
    target = {"linear_2.weight": torch.zeros(1, 5)}
    dcp.load(target, storage_reader=StorageReader(store_url))
    assert torch.equal(target["linear_2.weight"], saved["linear_2.weight"])


def test_a_key_the_checkpoint_lacks_fails_the_load_unless_partial_loads_are_allowed(store_url: str) -> None:
    saved = tensors(0)
    dcp.save(saved, storage_writer=StorageWriter(store_url))
    target = {"linear_1.weight": torch.zeros(5, 5), "extra": torch.full((2,), 9.0)}
    with pytest.raises(CheckpointException, match="extra"):
        dcp.load(target, storage_reader=StorageReader(store_url))
    assert torch.equal(target["linear_1.weight"], torch.zeros(5, 5))  # nothing loaded
    dcp.load(target, storage_reader=StorageReader(store_url), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(target["linear_1.weight"], saved["linear_1.weight"])
    assert torch.equal(target["extra"], torch.full((2,), 9.0))


# ---------------------------------------------------------------- overwrite, failed writes and reads


def test_an_existing_checkpoint_is_refused_without_overwrite_and_replaced_with_it(store_url: str) -> None:
    t1, t2 = {"random": torch.randn(10)}, {"random": torch.randn(10)}
    dcp.save(t1, storage_writer=StorageWriter(store_url))
    before = files(store_url)
    with pytest.raises(CheckpointException) as caught:
        dcp.save(t2, storage_writer=StorageWriter(store_url))
    assert isinstance(only_error(caught), CheckpointExistsError)
    assert files(store_url) == before  # untouched: the first checkpoint is what loads
    target = {"random": torch.zeros(10)}
    dcp.load(target, storage_reader=StorageReader(store_url))
    assert torch.equal(target["random"], t1["random"])

    dcp.save(t2, storage_writer=StorageWriter(store_url, overwrite=True))
    dcp.load(target, storage_reader=StorageReader(store_url))
    assert torch.equal(target["random"], t2["random"])
    with open_checkpoint(store_url) as ckpt:
        assert ckpt.verify().ok
        listed = {f.path for f in ckpt.manifest.files}
    assert set(files(store_url)) == listed | {"manifest.json"}  # no file of the replaced checkpoint is left


def test_a_failed_write_commits_nothing_and_leaves_no_file(store_url: str) -> None:
    state = {**tensors(0), "z_thing": Blob(bytearray(b"x"))}  # not plain: fails after the tensors were written
    with pytest.raises(CheckpointException):
        dcp.save(state, storage_writer=StorageWriter(store_url, thread_count=2))
    assert files(store_url) == {}
    dcp.save(tensors(0), storage_writer=StorageWriter(store_url))  # no lock left behind either


def test_a_failed_overwrite_leaves_no_committed_checkpoint_never_a_mix(store_url: str) -> None:
    dcp.save(tensors(0), storage_writer=StorageWriter(store_url))
    with pytest.raises(CheckpointException):
        dcp.save(
            {**tensors(1), "z_thing": Blob(bytearray(b"x"))},  # type: ignore[arg-type]
            storage_writer=StorageWriter(store_url, overwrite=True),
        )
    assert "manifest.json" not in files(store_url)  # the old one was un-committed first; the new one never was
    with pytest.raises(CheckpointException):
        dcp.load(tensors(2), storage_reader=StorageReader(store_url))
    dcp.save(tensors(1), storage_writer=StorageWriter(store_url))  # not locked, and nothing to overwrite
    target = tensors(2)
    dcp.load(target, storage_reader=StorageReader(store_url))
    assert equal(target, tensors(1))


def test_a_failed_read_leaves_the_checkpoint_as_it_was(store_url: str) -> None:
    dcp.save(tensors(0), storage_writer=StorageWriter(store_url))
    before = {path: open_store(store_url).read(path) for path in files(store_url)}
    wrong = {**tensors(1), "linear_1.weight": torch.zeros(3, 3)}  # a shape the checkpoint does not have
    with pytest.raises(CheckpointException):
        dcp.load(wrong, storage_reader=StorageReader(store_url))
    assert {path: open_store(store_url).read(path) for path in files(store_url)} == before
    target = tensors(1)
    dcp.load(target, storage_reader=StorageReader(store_url))
    assert equal(target, tensors(0))


# ---------------------------------------------------------------- DCP's storage interface


def test_a_checkpoint_id_given_to_save_and_load_replaces_the_url_of_the_writer_and_reader(
    store_url: str, new_url: Callable[[], str]
) -> None:
    first, second = new_url(), new_url()
    writer = StorageWriter(store_url)
    dcp.save(tensors(0), storage_writer=writer, checkpoint_id=first)
    dcp.save(tensors(1), storage_writer=writer, checkpoint_id=second)  # the same writer, reset for each
    assert files(store_url) == {}
    reader = StorageReader(store_url)
    for url, seed in ((first, 0), (second, 1), (first, 0)):
        target = tensors(2)
        dcp.load(target, storage_reader=reader, checkpoint_id=url)  # the same reader, reset for each
        assert equal(target, tensors(seed)), url


def test_a_reused_writer_refuses_to_save_over_its_own_checkpoint_without_overwrite(store_url: str) -> None:
    writer = StorageWriter(store_url)
    dcp.save(tensors(0), storage_writer=writer)
    with pytest.raises(CheckpointException) as caught:
        dcp.save(tensors(1), storage_writer=writer)
    assert isinstance(only_error(caught), CheckpointExistsError)


@pytest.mark.parametrize("cls", [StorageWriter, StorageReader])
def test_validate_checkpoint_id_takes_every_url_the_library_takes(cls: type[Any], tmp_path: Path) -> None:
    for good in (str(tmp_path / "ck"), tmp_path / "ck", "file:///x/ck", "memory://ck", "s3://bucket/ck"):
        assert cls.validate_checkpoint_id(good), good
    assert not cls.validate_checkpoint_id(42)


def test_storage_meta_names_the_checkpoint_and_the_save(store_url: str, new_url: Callable[[], str]) -> None:
    writer = StorageWriter(store_url)
    assert writer.storage_meta() is not None and writer.storage_meta().checkpoint_id == store_url  # type: ignore[union-attr]
    metadata = dcp.save(tensors(0), storage_writer=writer)
    meta = metadata.storage_meta
    assert meta is not None and meta.checkpoint_id == store_url
    assert writer.checkpoint_id == store_url  # DCP's meaning: where it goes
    assert meta.save_id == writer.save_id != ""  # a new one for every save, as DCP's writers make it
    with open_checkpoint(store_url) as ckpt:
        assert writer.committed_id == ckpt.id  # the manifest's id, once finish committed it
    other = new_url()
    again = dcp.save(tensors(1), storage_writer=writer, checkpoint_id=other)
    assert again.storage_meta is not None and again.storage_meta.checkpoint_id == other
    assert again.storage_meta.save_id not in ("", meta.save_id)


def test_a_writer_and_reader_take_a_path_like_url(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    dcp.save(tensors(0), storage_writer=StorageWriter(url))
    target = tensors(1)
    dcp.load(target, storage_reader=StorageReader(os.fspath(url)))
    assert equal(target, tensors(0))


# ---------------------------------------------------------------- on 2 gloo ranks: tests/dcp_contract_worker.py

WORKER = Path(__file__).with_name("dcp_contract_worker.py")
SPECS_2D = ("rows2", "rows4", "uneven5", "uneven2", "cols2")
SPECS_1D = ("rows2", "rows4", "first8", "first10")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bool]]:
    out = tmp_path_factory.mktemp("dcp-contract")
    launch(WORKER, [str(out)], 2, timeout=300)
    return json.loads((out / "results.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_sharded_tensor_round_trips_with_one_io_thread_or_two(results: dict[str, dict[str, bool]]) -> None:
    assert results["shard_round_trip"] == {"threads1": True, "threads2": True}


@pytest.mark.slow
def test_a_sharded_tensor_loads_into_every_other_sharding_row_wise_to_column_wise_included(
    results: dict[str, dict[str, bool]],
) -> None:
    expected = {f"{a}->{b}": True for a in SPECS_2D for b in SPECS_2D if a != b}
    assert results["reshard"] == expected


@pytest.mark.slow
def test_a_sharded_tensor_loads_into_a_plain_tensor_and_a_plain_one_into_a_sharded_one(
    results: dict[str, dict[str, bool]],
) -> None:
    assert results["switch"] == {f"{a}->{b}": True for a in SPECS_1D for b in SPECS_1D}


@pytest.mark.slow
def test_a_dtensor_sharded_on_rows_loads_sharded_on_columns_and_replicated(
    results: dict[str, dict[str, bool]],
) -> None:
    assert results["dtensor"] == {"shard1": True, "replicate": True}


@pytest.mark.slow
def test_plain_values_saved_on_two_ranks_come_back_on_both(results: dict[str, dict[str, bool]]) -> None:
    assert results["plain_values"] == {"every_rank": True}


@pytest.mark.slow
def test_an_fsdp2_model_and_optimizer_round_trip_through_an_fsspec_url(results: dict[str, dict[str, bool]]) -> None:
    assert results["fsspec_fsdp2"] == {"loaded": True}


@pytest.mark.slow
def test_through_an_fsspec_url_overwrite_replaces_and_its_absence_refuses(
    results: dict[str, dict[str, bool]],
) -> None:
    assert results["fsspec_overwrite"] == {"replaced": True, "refused": True, "kept": True}
