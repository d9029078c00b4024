"""The planner alone: no storage, no threads, no bytes."""

from __future__ import annotations

import pytest

from ckptfmt.errors import ChunkLayoutError, ManifestError, MissingFieldError, UsageError
from ckptfmt.manifest import ChunkRecord, FileRecord
from ckptfmt.plan import PlacedChunk, RankPlanner, RankResult, merge_results

DIGEST = "xxh3-128:" + "0" * 32
PROV = {"provenance": "provenance/context.msgpack"}


def _placed(
    field: str, tensor: str, offsets: tuple[int, ...], shape: tuple[int, ...], gshape: tuple[int, ...]
) -> PlacedChunk:
    path = f"{field}/r00000-00000.safetensors"
    chunk = ChunkRecord(
        path=path, key=f"{tensor}@{offsets}", offsets=offsets, shape=shape, begin=8, end=8, digest=DIGEST
    )
    return PlacedChunk(field=field, tensor=tensor, dtype="F32", global_shape=gshape, chunk=chunk)


def test_planner_splits_files_at_the_target_size() -> None:
    planner = RankPlanner(rank=3, target_file_size=100)
    flushed = []
    for i in range(5):
        _, full = planner.add("weights", f"t{i}", dtype="F32", shape=(10,), nbytes=40)
        flushed.extend(full)
    flushed.extend(planner.finish())
    assert [p.path for p in flushed] == [f"weights/r00003-0000{i}.safetensors" for i in range(3)]
    assert [[e.tensor for e in p.entries] for p in flushed] == [["t0", "t1"], ["t2", "t3"], ["t4"]]


def test_planner_keys_chunks_by_offset_and_refuses_repeats() -> None:
    planner = RankPlanner(target_file_size=1 << 20)
    entry, _ = planner.add("w", "t", dtype="F32", shape=(2, 4), nbytes=32, global_shape=(4, 4), offsets=(2, 0))
    assert entry.key == "t@2,0" and entry.global_shape == (4, 4)
    with pytest.raises(UsageError, match="already written"):
        planner.add("w", "t", dtype="F32", shape=(2, 4), nbytes=32, global_shape=(4, 4), offsets=(2, 0))
    with pytest.raises(UsageError, match="earlier chunks said"):
        planner.add("w", "t", dtype="F16", shape=(2, 4), nbytes=16, global_shape=(4, 4), offsets=(0, 0))
    with pytest.raises(ChunkLayoutError, match="outside"):
        planner.add("w", "u", dtype="F32", shape=(3, 4), nbytes=48, global_shape=(4, 4), offsets=(2, 0))


def test_merge_joins_ranks_and_checks_tiling_across_them() -> None:
    top = RankResult(
        rank=0, chunks=(_placed("weights", "t", (0, 0), (2, 4), (4, 4)),), tensor_fields=("weights",), contexts=PROV
    )
    bottom = RankResult(rank=1, chunks=(_placed("weights", "t", (2, 0), (2, 4), (4, 4)),), tensor_fields=("weights",))
    manifest = merge_results([bottom, top], profile="weights")
    chunks = manifest.fields["weights"].tensors["t"].chunks
    assert [c.offsets for c in chunks] == [(0, 0), (2, 0)]
    with pytest.raises(ChunkLayoutError, match="gap"):
        merge_results([top], profile="weights")
    overlap = RankResult(rank=1, chunks=(_placed("weights", "t", (1, 0), (3, 4), (4, 4)),))
    with pytest.raises(ChunkLayoutError, match="overlap"):
        merge_results([top, overlap], profile="weights")


def test_merge_refuses_disagreeing_ranks_and_shared_files() -> None:
    a = RankResult(rank=0, chunks=(_placed("weights", "t", (0,), (2,), (4,)),), contexts=PROV)
    b = RankResult(rank=1, chunks=(_placed("weights", "t", (2,), (2,), (5,)),))
    with pytest.raises(ChunkLayoutError, match="another rank"):
        merge_results([a, b], profile="weights")
    f = FileRecord(path="weights/x.safetensors", size=8, digest=DIGEST)
    with pytest.raises(ChunkLayoutError, match="same file"):
        merge_results(
            [RankResult(rank=0, files=(f,), contexts=PROV), RankResult(rank=1, files=(f,))], profile="weights"
        )
    with pytest.raises(ChunkLayoutError, match="context"):
        merge_results(
            [RankResult(rank=0, contexts={"rng": "rng/a"}), RankResult(rank=1, contexts={"rng": "rng/b"})],
            profile="weights",
        )
    with pytest.raises(MissingFieldError):
        merge_results([RankResult(rank=0)], profile="weights")


def test_rank_result_round_trips_as_json_and_refuses_garbage() -> None:
    result = RankResult(
        rank=2,
        files=(FileRecord(path="weights/r00002-00000.safetensors", size=40, digest=DIGEST),),
        chunks=(_placed("weights", "t", (0,), (2,), (4,)),),
        contexts={"rng": "rng/context.r00002.msgpack"},
        tensor_fields=("weights",),
    )
    assert RankResult.from_bytes(result.to_bytes()) == result
    for bad in (b"[]", b'{"rank": 1}', b"{", b'{"rank":"x","files":[],"chunks":[],"contexts":{},"tensor_fields":[]}'):
        with pytest.raises(ManifestError):
            RankResult.from_bytes(bad)
