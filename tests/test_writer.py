"""The writer and its commit protocol: abort, completeness, no overwrite, determinism (the lock: test_lock.py)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckptfmt
from ckptfmt import dtypes
from ckptfmt.errors import (
    CheckpointExistsError,
    ChunkLayoutError,
    DTypeError,
    MissingFieldError,
    UsageError,
)
from ckptfmt.profiles import PROFILES

PROVENANCE = {"writer": {"name": "ckptfmt-tests", "version": "1"}, "created_at": "2026-01-02T03:04:05Z"}


def listing(url: str) -> dict[str, int]:
    """Every file under the root, hidden ones (temp files, the lock) included."""
    return ckptfmt.open_store(url).list()


class Boom(Exception):
    pass


# ---------------------------------------------------------------- abort


@pytest.mark.parametrize("target", [1 << 30, 1])
def test_exception_in_the_block_leaves_nothing(store_url: str, target: int) -> None:
    with pytest.raises(Boom), ckptfmt.open_writer(store_url, profile="training", target_file_size=target) as w:
        w.write_tensors("weights", {f"w{i}": np.ones((64, 64), np.float32) for i in range(4)})
        w.write_context("topology", {"world_size": 1})
        if target == 1:
            w.flush()  # data files are already published under their final names
            assert any(p.endswith(".safetensors") for p in listing(store_url))
        raise Boom
    assert listing(store_url) == {}  # no manifest, no data file, no blob, no temp file, no lock
    with pytest.raises(ckptfmt.CheckpointNotFoundError):
        ckptfmt.open(store_url)


def test_writer_error_in_the_block_leaves_nothing(store_url: str) -> None:
    with pytest.raises(UsageError), ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "a", np.zeros(3))
        w.flush()
        w.write_tensor("weights", "a", np.zeros(3))
    assert listing(store_url) == {}


def test_writer_is_closed_after_abort(store_url: str) -> None:
    w = ckptfmt.open_writer(store_url, profile="weights")
    w.abort()
    w.abort()  # idempotent
    with pytest.raises(UsageError):
        w.write_tensor("weights", "a", np.zeros(1))
    with pytest.raises(UsageError):
        w.commit()
    assert listing(store_url) == {}


def test_writer_is_closed_after_commit(store_url: str, fill_writer: Callable[..., None]) -> None:
    w = ckptfmt.open_writer(store_url, profile="weights")
    fill_writer(w, profile="weights")
    checkpoint_id = w.commit()
    assert checkpoint_id == w.checkpoint_id == ckptfmt.open(store_url).id
    with pytest.raises(UsageError):
        w.write_tensor("weights", "late", np.zeros(1))
    with pytest.raises(UsageError):
        w.commit()
    w.abort()  # a no-op once committed: the checkpoint stays
    assert ckptfmt.verify(store_url).ok


def test_abort_keeps_a_checkpoint_that_was_committed_elsewhere(
    store_url: str, new_url: Callable[[], str], write_training: Callable[..., str]
) -> None:
    write_training(store_url)
    before = listing(store_url)
    other = new_url()
    with pytest.raises(Boom), ckptfmt.open_writer(other) as w:
        w.write_tensors("weights", {"x": np.zeros(2)})
        raise Boom
    assert listing(store_url) == before


# ---------------------------------------------------------------- completeness


@pytest.mark.parametrize(
    ("profile", "missing"),
    [(p, f) for p, fields in PROFILES.items() for f in fields if f != "provenance"],
)
def test_a_missing_required_field_refuses_the_commit(
    store_url: str, profile: str, missing: str, fill_writer: Callable[..., None]
) -> None:
    with pytest.raises(MissingFieldError) as info, ckptfmt.open_writer(store_url, profile=profile) as w:
        fill_writer(w, profile=profile, omit=(missing,))
    assert info.value.field == missing
    assert missing in str(info.value)
    assert listing(store_url) == {}


@pytest.mark.parametrize("profile", list(PROFILES))
def test_provenance_is_filled_in_when_not_given(store_url: str, profile: str, fill_writer: Callable[..., None]) -> None:
    # The one exception to "missing field refuses": the reference writer fills writer and created_at.
    with ckptfmt.open_writer(store_url, profile=profile) as w:
        fill_writer(w, profile=profile, omit=("provenance",))
    value = ckptfmt.open(store_url).read_context("provenance")
    assert value["writer"] == {"name": "ckptfmt", "version": ckptfmt.__version__}
    assert isinstance(value["created_at"], str)


@pytest.mark.parametrize("field", ["weights", "optimizer"])
def test_a_required_field_of_the_wrong_kind_is_missing(
    store_url: str, field: str, fill_writer: Callable[..., None]
) -> None:
    with pytest.raises(MissingFieldError) as info, ckptfmt.open_writer(store_url, profile="training") as w:
        fill_writer(w, profile="training", omit=(field,))
        w.write_context(field, {"oops": "a context, not tensors"})
    assert info.value.field == field
    assert listing(store_url) == {}


def test_a_required_context_field_written_as_tensors_is_missing(
    store_url: str, fill_writer: Callable[..., None]
) -> None:
    with pytest.raises(MissingFieldError), ckptfmt.open_writer(store_url, profile="training") as w:
        fill_writer(w, profile="training", omit=("topology",))
        w.write_tensors("topology", {"world_size": np.array(1)})
    assert listing(store_url) == {}


def test_extra_fields_are_allowed(store_url: str, fill_writer: Callable[..., None]) -> None:
    with ckptfmt.open_writer(store_url, profile="training") as w:
        fill_writer(w, profile="training")
        w.write_tensors("ema", {"w": np.ones(3, np.float32)})
        w.write_context("lr_scheduler", {"last_epoch": 3})
        w.write_tensors("empty_field", {})
    ckpt = ckptfmt.open(store_url)
    assert ckpt.read_context("lr_scheduler") == {"last_epoch": 3}
    assert ckpt.tensor_names("empty_field") == []
    assert ckpt.fields["ema"].kind == "tensors"


def test_unknown_profile_is_a_usage_error(store_url: str) -> None:
    with pytest.raises(UsageError):
        ckptfmt.open_writer(store_url, profile="inference")
    assert listing(store_url) == {}


# ---------------------------------------------------------------- no overwrite in place


def test_writing_over_a_committed_checkpoint_is_refused(store_url: str, write_training: Callable[..., str]) -> None:
    first = write_training(store_url)
    before = {p: ckptfmt.open_store(store_url).read(p) for p in listing(store_url)}
    with pytest.raises(CheckpointExistsError):
        write_training(store_url, seed=1)
    after = {p: ckptfmt.open_store(store_url).read(p) for p in listing(store_url)}
    assert after == before  # untouched, and the lock is gone
    assert ckptfmt.open(store_url).id == first
    assert ckptfmt.verify(store_url).ok


def test_overwrite_replaces_and_keeps_no_stale_files(
    store_url: str, write_training: Callable[..., str], fill_writer: Callable[..., None]
) -> None:
    with ckptfmt.open_writer(store_url, profile="training", target_file_size=1) as w:
        fill_writer(w)
        w.write_tensors("ema", {"a": np.ones(4), "b": np.ones(4)})
        w.write_context("extra", {"k": 1})
    old = set(listing(store_url))
    assert any(p.startswith("ema/") for p in old)
    new_id = write_training(store_url, seed=1, overwrite=True)
    ckpt = ckptfmt.open(store_url)
    assert ckpt.id == new_id
    assert set(listing(store_url)) == {f.path for f in ckpt.manifest.files} | {"manifest.json"}
    assert "ema" not in ckpt.fields and "extra" not in ckpt.fields
    assert ckptfmt.verify(store_url).ok


# ---------------------------------------------------------------- determinism


def tree(url: str) -> dict[str, bytes]:
    store = ckptfmt.open_store(url)
    return {path: store.read(path) for path in sorted(store.list())}


def test_same_inputs_give_a_byte_identical_tree(
    store_url: str, new_url: Callable[[], str], write_training: Callable[..., str]
) -> None:
    other = new_url()
    a = write_training(store_url, target_file_size=100)
    b = write_training(other, target_file_size=100)
    assert a == b
    first, second = tree(store_url), tree(other)
    assert len(first) > 8  # several data files per field, blobs, manifest
    assert first.keys() == second.keys()
    for path in first:
        assert first[path] == second[path], path


def test_local_and_memory_trees_are_identical(tmp_path: Any, write_training: Callable[..., str]) -> None:
    import uuid

    import fsspec

    local = str(tmp_path / "c")
    root = f"/ckptfmt-tests-{uuid.uuid4().hex}"
    try:
        assert write_training(local) == write_training(f"memory://{root}/c")
        assert tree(local) == tree(f"memory://{root}/c")
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


def test_different_inputs_give_different_ids(
    store_url: str, new_url: Callable[[], str], write_training: Callable[..., str]
) -> None:
    assert write_training(store_url, seed=0) != write_training(new_url(), seed=1)


def test_checkpoint_id_is_the_sha256_of_the_manifest_bytes(store_url: str, write_training: Callable[..., str]) -> None:
    import hashlib

    cid = write_training(store_url)
    data = ckptfmt.open_store(store_url).read("manifest.json")
    assert cid == "sha256:" + hashlib.sha256(data).hexdigest()
    assert ckptfmt.open(store_url).id == cid
    doc = json.loads(data)
    assert data == json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------- data files are plain safetensors


def random_bits(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    if name == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    dtype = dtypes.to_numpy(name)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def test_every_data_file_opens_with_safetensors(store_url: str, tmp_path: Any) -> None:
    arrays = {name: random_bits(name, (3, 4), seed) for seed, name in enumerate(dtypes.DTYPES)}
    arrays["scalar"] = np.float32(1.25)
    arrays["empty"] = np.zeros((0, 3), np.float16)
    with ckptfmt.open_writer(store_url, profile="weights", target_file_size=64) as w:
        w.write_tensors("weights", arrays)
        full = np.arange(20, dtype=np.float32).reshape(4, 5)
        w.write_tensor("weights", "sharded", full[:, :2], global_shape=(4, 5), offsets=(0, 0))
        w.write_tensor("weights", "sharded", full[:, 2:], global_shape=(4, 5), offsets=(0, 2))
        w.write_context("provenance", PROVENANCE)
    ckpt = ckptfmt.open(store_url)
    files = {c.path for t in ckpt.fields["weights"].tensors.values() for c in t.chunks}
    assert len(files) > 1
    seen = 0
    for path in sorted(files):
        local = tmp_path / path.replace("/", "_")
        local.write_bytes(ckpt.store.read(path))
        with safe_open(str(local), framework="pt") as f:
            keys = set(f.keys())
            for name, record in ckpt.fields["weights"].tensors.items():
                for chunk in record.chunks:
                    if chunk.path != path:
                        continue
                    assert chunk.key in keys
                    tensor = f.get_tensor(chunk.key)
                    assert tuple(tensor.shape) == chunk.shape
                    ours = ckpt.read_tensor("weights", name)
                    region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape, strict=True))
                    expected = np.ascontiguousarray(ours[region]).tobytes()
                    assert tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == expected
                    seen += 1
    assert seen == len(arrays) + 2


# ---------------------------------------------------------------- chunk and tensor mistakes


def test_duplicate_tensor_is_refused(store_url: str) -> None:
    with pytest.raises(UsageError) as info, ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "a", np.zeros(3))
        w.write_tensor("weights", "a", np.zeros(3))
    assert info.value.tensor == "a" and info.value.field == "weights"
    assert listing(store_url) == {}


@pytest.mark.parametrize("target", [1 << 30, 1])  # duplicate in the same file / in another file
def test_duplicate_chunk_is_refused(store_url: str, target: int) -> None:
    full = np.arange(8, dtype=np.float32)
    with (
        pytest.raises((UsageError, ChunkLayoutError)),
        ckptfmt.open_writer(store_url, profile="weights", target_file_size=target) as w,
    ):
        w.write_tensor("weights", "t", full[:4], global_shape=(8,), offsets=(0,))
        w.write_tensor("weights", "t", full[4:], global_shape=(8,), offsets=(4,))
        w.write_tensor("weights", "t", full[4:], global_shape=(8,), offsets=(4,))
        w.write_context("provenance", PROVENANCE)
    assert listing(store_url) == {}


CHUNK_MISTAKES = {
    "overlap": [((0, 0), (3, 4)), ((2, 0), (2, 4))],
    "gap": [((0, 0), (2, 4)), ((3, 0), (1, 4))],
    "overlap_and_gap_same_volume": [((0, 0), (2, 4)), ((1, 0), (2, 4))],
    "partial_column": [((0, 0), (4, 3))],
}


@pytest.mark.parametrize("mistake", CHUNK_MISTAKES)
@pytest.mark.parametrize("target", [1 << 30, 1])
def test_chunks_that_do_not_tile_are_refused(store_url: str, mistake: str, target: int) -> None:
    full = np.arange(16, dtype=np.int32).reshape(4, 4)
    with (
        pytest.raises(ChunkLayoutError) as info,
        ckptfmt.open_writer(store_url, profile="weights", target_file_size=target) as w,
    ):
        for offsets, shape in CHUNK_MISTAKES[mistake]:
            part = full[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
            w.write_tensor("weights", "t", part, global_shape=(4, 4), offsets=offsets)
        w.write_context("provenance", PROVENANCE)
    assert info.value.tensor == "t"
    assert listing(store_url) == {}


def test_chunk_outside_the_global_shape_is_refused(store_url: str) -> None:
    with pytest.raises(ChunkLayoutError), ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "t", np.zeros((2, 2)), global_shape=(4, 4), offsets=(3, 0))
    assert listing(store_url) == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"global_shape": (4,)},  # offsets missing
        {"offsets": (0,)},  # global_shape missing
        {"global_shape": (4, 4), "offsets": (0,)},  # rank mismatch
    ],
)
def test_inconsistent_chunk_arguments(store_url: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(UsageError), ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "t", np.zeros(2), **kwargs)
    assert listing(store_url) == {}


def test_chunks_of_one_tensor_must_agree_on_dtype_and_shape(store_url: str) -> None:
    with pytest.raises(UsageError), ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "t", np.zeros(2, np.float32), global_shape=(4,), offsets=(0,))
        w.write_tensor("weights", "t", np.zeros(2, np.float64), global_shape=(4,), offsets=(2,))
    assert listing(store_url) == {}


def test_tensor_named_like_another_tensors_chunk_key(store_url: str) -> None:
    # "t@0" is a valid tensor name, and also the key the writer gives chunk (0,) of tensor "t".
    full = np.arange(4, dtype=np.int16)
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensor("weights", "t", full[:2], global_shape=(4,), offsets=(0,))
        w.write_tensor("weights", "t@0", np.ones(3, np.int8))
        w.write_tensor("weights", "t", full[2:], global_shape=(4,), offsets=(2,))
        w.write_context("provenance", PROVENANCE)
    ckpt = ckptfmt.open(store_url)
    np.testing.assert_array_equal(ckpt.read_tensor("weights", "t"), full)
    np.testing.assert_array_equal(ckpt.read_tensor("weights", "t@0"), np.ones(3, np.int8))
    assert ckptfmt.verify(store_url).ok


BAD_FIELD_NAMES = ["", "Weights", "1st", "_x", "a-b", "a.b", "a b", "é", "a" * 65, "weights/x", 3, None]
BAD_TENSOR_NAMES = [
    "",
    "__metadata__",
    "a\x00b",
    "tab\there",
    "new\nline",
    "del\x7f",
    "x" * 1025,
    "é" * 513,
    "\ud800",
    7,
]


@pytest.mark.parametrize("name", BAD_FIELD_NAMES, ids=repr)
def test_bad_field_names(store_url: str, name: Any) -> None:
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensors("weights", {})
        with pytest.raises(UsageError):
            w.write_tensor(name, "t", np.zeros(1))
        with pytest.raises(UsageError):
            w.write_tensors(name, {"t": np.zeros(1)})
        with pytest.raises(UsageError):
            w.write_context(name, {"k": 1})
    assert set(ckptfmt.open(store_url).fields) == {"weights", "provenance"}


@pytest.mark.parametrize("name", BAD_TENSOR_NAMES, ids=repr)
def test_bad_tensor_names(store_url: str, name: Any) -> None:
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        with pytest.raises(UsageError):
            w.write_tensor("weights", name, np.zeros(1))
        w.write_tensors("weights", {})
    assert ckptfmt.open(store_url).tensor_names("weights") == []


def test_longest_valid_names(store_url: str) -> None:
    field = "f" + "0" * 63
    tensor = "é" * 512  # 1024 bytes
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensors("weights", {tensor: np.zeros(1), "a.b/c d@e:f": np.ones(1)})
        w.write_tensors(field, {"x": np.zeros(1)})
    ckpt = ckptfmt.open(store_url)
    assert set(ckpt.tensor_names("weights")) == {tensor, "a.b/c d@e:f"}
    assert ckpt.read_tensor(field, "x").shape == (1,)


def _stable_id(value: object) -> str:
    """repr, but the same in every process (pytest-xdist compares the workers' collections): no addresses."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


@pytest.mark.parametrize(
    "value", [[1, 2], "text", object(), np.array(["a"]), np.zeros(2, dtype="<m8[s]")], ids=_stable_id
)
def test_unsupported_arrays_are_refused(store_url: str, value: object) -> None:
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        with pytest.raises(DTypeError):
            w.write_tensor("weights", "t", value)
        w.write_tensors("weights", {})


def test_context_twice_and_non_mapping_context(store_url: str) -> None:
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensors("weights", {})
        w.write_context("extra", {"a": 1})
        with pytest.raises(UsageError):
            w.write_context("extra", {"a": 2})
        with pytest.raises(UsageError):
            w.write_context("other", [1, 2])  # type: ignore[arg-type]
    assert ckptfmt.open(store_url).read_context("extra") == {"a": 1}


@pytest.mark.parametrize(
    "options",
    [{"target_file_size": 0}, {"workers": -1}, {"rank": -1}, {"digest": "md5"}, {"metadata": {"a": 1}}],
    ids=repr,
)
def test_bad_writer_options(store_url: str, options: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        ckptfmt.open_writer(store_url, profile="weights", **options)
    assert listing(store_url) == {}


def test_no_workers_writes_on_the_caller_s_thread(tmp_path: Any) -> None:
    import threading

    arrays = {f"t{i}": np.full((64, 64), i, np.float32) for i in range(5)}
    written: dict[int, bytes] = {}
    for workers in (0, 2):
        url = str(tmp_path / f"w{workers}")
        before = {t.name for t in threading.enumerate()}
        with ckptfmt.open_writer(url, profile="weights", workers=workers, target_file_size=1 << 15) as w:
            w.write_tensors("weights", arrays)
            w.write_context("provenance", PROVENANCE)
            started = {t.name for t in threading.enumerate()} - before
        assert any(name.startswith("ckptfmt-write") for name in started) == (workers > 0)
        store = ckptfmt.open_store(url)
        written[workers] = b"".join(store.read(p) for p in sorted(store.list()))
    assert written[0] == written[2]


def test_sha256_digests_and_metadata(store_url: str) -> None:
    with ckptfmt.open_writer(store_url, profile="weights", digest="sha256", metadata={"run": "r1"}) as w:
        w.write_tensors("weights", {"a": np.arange(3)})
    ckpt = ckptfmt.open(store_url)
    assert all(f.digest.startswith("sha256:") and len(f.digest) == 7 + 64 for f in ckpt.manifest.files)
    assert ckpt.manifest.metadata == {"run": "r1"}
    assert ckptfmt.verify(store_url).ok


def test_local_writer_leaves_no_temp_files(local_url: str, write_training: Callable[..., str]) -> None:
    write_training(local_url, target_file_size=1)
    names = [name for _, _, files in os.walk(local_url) for name in files]
    assert not [n for n in names if n.startswith(".")]
