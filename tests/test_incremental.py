"""Incremental checkpoints through the library API: chunks equal to the base's are referenced, not written
(spec/references.md), on every storage backend, several ranks, codecs; a damaged base is caught."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rank_threads import run_ranks

import ckptfmt
from ckptfmt import ThreadCollective
from ckptfmt.errors import BaseCheckpointError, DigestMismatchError, UsageError
from ckptfmt.storage import open_store

Arrays = dict[str, np.ndarray[Any, Any]]


def state(seed: int = 0) -> Arrays:
    rng = np.random.default_rng(seed)
    return {
        "frozen.0": rng.standard_normal((64, 256), dtype=np.float32),  # 64 KiB: block digests too
        "frozen.1": rng.standard_normal((32, 256), dtype=np.float32),
        "adapter": rng.standard_normal((8, 8), dtype=np.float32),
    }


def save(url: str, arrays: Arrays, **kwargs: Any) -> ckptfmt.CheckpointWriter:
    with ckptfmt.open_writer(url, profile="weights", **kwargs) as w:
        w.write_tensors("weights", arrays)
    return w


def files_of(url: str) -> dict[str, int]:
    return open_store(url).list()


def test_unchanged_chunks_are_referenced_on_every_backend(store_url: str) -> None:
    run = store_url.rstrip("/")
    first = state()
    save(f"{run}/step-1", first)
    second = {**first, "adapter": first["adapter"] + 1}
    writer = save(f"{run}/step-2", second, base=f"{run}/step-1")

    stats = writer.referenced
    assert stats is not None and stats.chunks == 2
    assert stats.bytes == first["frozen.0"].nbytes + first["frozen.1"].nbytes
    own = files_of(f"{run}/step-2")
    assert sum(n for p, n in own.items() if p.endswith(".safetensors")) < 1024  # the adapter alone
    with ckptfmt.open(f"{run}/step-2") as ckpt:
        assert {c.base for t in ckpt.fields["weights"].tensors.values() for c in t.chunks} == {"../step-1", None}
        for name, array in second.items():
            np.testing.assert_array_equal(ckpt.read_tensor("weights", name), array)
        np.testing.assert_array_equal(
            ckpt.read_slice("weights", "frozen.0", (5, 16), (3, 8)), first["frozen.0"][5:8, 16:24]
        )
        report = ckpt.verify()
        assert report.ok, report.problems
        assert report.chunks_checked == 3
        assert ckpt.manifest.referenced_bytes == stats.bytes


def test_a_chain_points_at_the_checkpoint_that_stores_the_bytes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    arrays = state()
    save(str(run / "step-1"), arrays)
    save(str(run / "step-2"), {**arrays, "adapter": arrays["adapter"] * 2}, base=str(run / "step-1"))
    save(str(run / "step-3"), {**arrays, "adapter": arrays["adapter"] * 3}, base=str(run / "step-2"))
    with ckptfmt.open(run / "step-3") as ckpt:
        assert [b.location for b in ckpt.manifest.bases] == ["../step-1"]  # never "../step-2" (REF-8)
    shutil.rmtree(run / "step-2")  # the intermediate checkpoint is not needed by step 3
    with ckptfmt.open(run / "step-3") as ckpt:
        assert ckpt.verify().ok
        np.testing.assert_array_equal(ckpt.read_tensor("weights", "adapter"), arrays["adapter"] * 3)


def test_frozen_tensors_are_referenced_unhashed_and_keep_the_base_codec(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rng = np.random.default_rng(3)
    # smooth values compress: the base's chunks of these tensors are zstd
    big = {f"frozen.{i}": (rng.standard_normal((64, 512)) * 0.01).astype(np.float32) for i in range(2)}
    arrays = {**big, "adapter": np.ones((4, 4), np.float32)}
    save(str(run / "step-1"), arrays, codec="zstd", digest="xxh3-128")  # flat: VER-1 then names the codec's 1.1
    writer = save(
        str(run / "step-2"),
        {**arrays, "adapter": arrays["adapter"] * 2},
        base=str(run / "step-1"),
        frozen=list(big),
        digest="xxh3-128",
    )
    stats = writer.referenced
    assert stats is not None and stats.chunks == 2
    assert stats.hashed_bytes == arrays["adapter"].nbytes  # the frozen tensors were not hashed
    with ckptfmt.open(run / "step-2") as ckpt:
        codecs = {c.codec.name for name in big for c in ckpt.tensor("weights", name).chunks}
        assert codecs == {"zstd"}
        assert ckpt.format_version == "1.1"  # VER-1 counts the referenced chunks' codec
        for name, array in big.items():
            np.testing.assert_array_equal(ckpt.read_tensor("weights", name), array)
        assert ckpt.verify().ok
    # not declared frozen: an encoded base chunk is written again (only an encode could compare it); the
    # unchanged raw one (the adapter, too small to compress) is still referenced
    writer = save(str(run / "step-3"), arrays, base=str(run / "step-1"), codec="zstd")
    assert writer.referenced is not None and writer.referenced.chunks == 1
    with ckptfmt.open(run / "step-3") as ckpt:
        assert [c.base for name in big for c in ckpt.tensor("weights", name).chunks] == [None, None]


def test_encoded_chunks_are_compared_by_the_raw_digests_their_writer_recorded(tmp_path: Path) -> None:
    """The stored digest of a zstd chunk covers compressed bytes: the writer that wrote it also records its raw
    bytes' digest, and the next save of the process compares with that (a hash, no encode, no write)."""
    run = tmp_path / "run"
    rng = np.random.default_rng(5)
    arrays = {f"w{i}": (rng.standard_normal((64, 512)) * 0.01).astype(np.float32) for i in range(3)}
    first = save(str(run / "step-1"), arrays, codec="zstd")
    assert first.checkpoint_id is not None and len(first.raw_digests) == 3
    changed = {**arrays, "w2": arrays["w2"] + 1}
    content = (first.checkpoint_id, first.raw_digests)
    second = save(str(run / "step-2"), changed, base=str(run / "step-1"), codec="zstd", base_content=content)
    assert second.referenced is not None and second.referenced.chunks == 2
    assert second.checkpoint_id is not None and len(second.raw_digests) == 3  # written and referenced ones
    third = save(
        str(run / "step-3"),
        changed,
        base=str(run / "step-2"),
        codec="zstd",
        base_content=(second.checkpoint_id, second.raw_digests),
    )
    assert third.referenced is not None and third.referenced.chunks == 3
    # raw digests recorded for another checkpoint are not trusted
    other = save(str(run / "step-4"), arrays, base=str(run / "step-3"), codec="zstd", base_content=content)
    assert other.referenced is not None and other.referenced.chunks == 0
    with ckptfmt.open(run / "step-3") as ckpt:
        assert ckpt.verify().ok
        assert sorted({b.name for b in ckpt.manifest.bases}) == ["step-1", "step-2"]
        for name, array in changed.items():
            np.testing.assert_array_equal(ckpt.read_tensor("weights", name), array)


def test_only_a_sibling_can_be_a_base(tmp_path: Path) -> None:
    save(str(tmp_path / "a" / "step-1"), state())
    with pytest.raises(UsageError, match="beside"):
        save(str(tmp_path / "b" / "step-2"), state(), base=str(tmp_path / "a" / "step-1"))
    with pytest.raises(UsageError, match="frozen"):
        save(str(tmp_path / "a" / "step-3"), state(), frozen=["adapter"])
    assert not (tmp_path / "b" / "step-2").exists()


def test_a_replaced_or_missing_base_is_refused_naming_both(tmp_path: Path) -> None:
    run = tmp_path / "run"
    arrays = state()
    save(str(run / "step-1"), arrays)
    save(str(run / "step-2"), arrays, base=str(run / "step-1"))
    shutil.rmtree(run / "step-1")
    save(str(run / "step-1"), state(seed=9))  # another checkpoint under the base's name
    with ckptfmt.open(run / "step-2") as ckpt:
        with pytest.raises(BaseCheckpointError, match="replaced") as info:
            ckpt.read_tensor("weights", "frozen.0")
        assert str(run / "step-2") in str(info.value) and str(run / "step-1") in str(info.value)
        assert info.value.requirement == "REF-7"
        report = ckpt.verify()
        assert [p.code for p in report.problems] == ["base_checkpoint"]
    shutil.rmtree(run / "step-1")
    report = ckptfmt.verify(run / "step-2")
    assert [p.code for p in report.problems] == ["base_checkpoint"]
    assert "gone" in report.problems[0].message


def test_a_flipped_byte_in_the_base_is_caught_by_reads_and_verify(tmp_path: Path) -> None:
    run = tmp_path / "run"
    arrays = state()
    save(str(run / "step-1"), arrays)
    save(str(run / "step-2"), {**arrays, "adapter": arrays["adapter"] + 1}, base=str(run / "step-1"))
    with ckptfmt.open(run / "step-1") as base:
        chunk = base.tensor("weights", "frozen.1").chunks[0]
    path = run / "step-1" / chunk.path
    data = bytearray(path.read_bytes())
    data[chunk.begin + 100] ^= 1
    path.write_bytes(bytes(data))
    with ckptfmt.open(run / "step-2") as ckpt:
        with pytest.raises(DigestMismatchError):
            ckpt.read_tensor("weights", "frozen.1")
        np.testing.assert_array_equal(ckpt.read_tensor("weights", "adapter"), arrays["adapter"] + 1)
        problems = ckpt.verify().problems
    assert problems and all(p.path == f"../step-1/{chunk.path}" for p in problems)


def test_each_rank_references_its_own_chunks(tmp_path: Path) -> None:
    """Two ranks, each a half of every tensor; in the second save only rank 1's half of 'moving' changed."""
    run = tmp_path / "run"
    full = {"still": np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "moving": np.zeros((64, 64), np.float32)}

    def saver(name: str, arrays: Arrays, base: str | None) -> Callable[[int, ThreadCollective], object]:
        def body(rank: int, coll: ThreadCollective) -> object:
            with ckptfmt.open_writer(str(run / name), profile="weights", collective=coll, base=base) as w:
                for tname, array in arrays.items():
                    half = array[rank * 32 : (rank + 1) * 32]
                    w.write_tensor("weights", tname, half, global_shape=array.shape, offsets=(rank * 32, 0))
            return w.referenced

        return body

    assert not any(isinstance(r, BaseException) for r in run_ranks(2, saver("step-1", full, None)))
    moved = {**full, "moving": full["moving"].copy()}
    moved["moving"][40] = 1.0  # rank 1's half
    stats = run_ranks(2, saver("step-2", moved, str(run / "step-1")))
    assert [s.chunks for s in stats] == [2, 1]  # type: ignore[union-attr]
    with ckptfmt.open(run / "step-2") as ckpt:
        assert ckpt.verify().ok
        for name, array in moved.items():
            np.testing.assert_array_equal(ckpt.read_tensor("weights", name), array)
        chunks = ckpt.tensor("weights", "moving").chunks
        assert [c.base for c in chunks] == ["../step-1", None]


def test_a_symlinked_base_is_refused(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    arrays = state()
    save(str(run / "step-1"), arrays)
    save(str(run / "step-2"), arrays, base=str(run / "step-1"))
    (run / "step-1").rename(elsewhere)
    (run / "step-1").symlink_to(elsewhere)  # the same checkpoint, id and all, reached through a link
    with ckptfmt.open(run / "step-2") as ckpt, pytest.raises(BaseCheckpointError, match="symbolic link") as info:
        ckpt.read_tensor("weights", "frozen.0")
    assert info.value.requirement == "REF-16"


def test_a_root_given_through_a_symbolic_link_finds_its_base_beside_the_directory_it_is(tmp_path: Path) -> None:
    """REF-15 (spec/notes/gaps-1.2.md N10): '../step-1' is a sibling of the directory the root is, not of
    the link the user gave, and a location is the own root by directory identity, not by path."""
    run = tmp_path / "run"
    arrays = state()
    save(str(run / "step-1"), arrays)
    save(str(run / "step-2"), arrays, base=str(run / "step-1"))
    (tmp_path / "latest").symlink_to(run / "step-2", target_is_directory=True)
    with ckptfmt.open(tmp_path / "latest") as ckpt:
        np.testing.assert_array_equal(ckpt.read_tensor("weights", "frozen.0"), arrays["frozen.0"])
    assert ckptfmt.verify(tmp_path / "latest").problems == []


def test_the_writer_lock_names_the_bases_while_the_save_is_at_work(tmp_path: Path) -> None:
    from ckptfmt.lock import read_lock

    run = tmp_path / "run"
    save(str(run / "step-1"), state())
    with ckptfmt.open_writer(run / "step-2", profile="weights", base=run / "step-1") as writer:
        lock = read_lock(open_store(run / "step-2"))
        assert lock is not None and lock.bases == ("step-1",)  # before any data file is written (REF-13)
        writer.write_tensors("weights", state())


def test_an_error_in_a_base_file_names_it_as_the_referencing_checkpoint_sees_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save(str(run / "step-1"), state())
    save(str(run / "step-2"), state(), base=str(run / "step-1"))
    data = next((run / "step-1" / "weights").glob("*.safetensors"))
    data.write_bytes(data.read_bytes()[:-1])  # truncated
    with ckptfmt.open(run / "step-2") as ckpt, pytest.raises(ckptfmt.SizeMismatchError) as info:
        ckpt.read_tensor("weights", "frozen.0")
    assert info.value.path == f"../step-1/weights/{data.name}"


def test_a_base_deleted_while_the_save_is_at_work_fails_the_save(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save(str(run / "step-1"), state())
    writer = ckptfmt.open_writer(run / "step-2", profile="weights", base=run / "step-1")
    writer.write_tensors("weights", state())
    shutil.rmtree(run / "step-1")  # a gc that planned before this writer took its lock
    with pytest.raises(BaseCheckpointError, match="vanished"):
        writer.commit()
    assert not (run / "step-2" / "manifest.json").exists()
