"""One rank of the multi-rank cases of PyTorch's storage-layer tests, run through ``ckptfmt.dcp``:
``python dcp_contract_worker.py OUT_DIR`` under RANK/WORLD_SIZE/MASTER_* (gloo, 2 ranks). Every case saves through
``StorageWriter`` and loads through ``StorageReader``; rank 0 writes OUT_DIR/results.json, ``{case: {sub: ok}}``
(tests/test_dcp_storage_contract.py asserts on it):

- ``shard_round_trip``: a ShardedTensor saved and loaded with the same sharding;
- ``reshard``: a ShardedTensor saved with one sharding loads into every other, row-wise to column-wise included;
- ``switch``: a ShardedTensor loads into a plain tensor and a plain tensor into a ShardedTensor;
- ``dtensor``: a DTensor sharded on rows loads into one sharded on columns and into a replicated one;
- ``plain_values``: a list and a string, on both ranks, come back on both;
- ``fsspec_fsdp2``: an FSDP2 model and AdamW (tests/dcp_worker.py's) saved and loaded through an fsspec URL
  (``local://``, fsspec's name for this machine's disk, which ckptfmt maps to its own local store; the
  ``storage_options`` a user of fsspec passes are taken and not needed);
- ``fsspec_overwrite``: through that URL, a second save is refused without ``overwrite`` and replaces with it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_worker import build, digest, state
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from ckptfmt.dcp import StorageReader, StorageWriter
from ckptfmt.errors import CheckpointExistsError

warnings.filterwarnings("ignore", category=FutureWarning)  # ShardedTensor is deprecated; DCP still serves it
warnings.filterwarnings("ignore", category=DeprecationWarning)


def rows(*shards: tuple[int, int, int], cols: int = 20) -> EnumerableShardingSpec:
    """Row blocks ``(begin, rows, rank)`` of a ``[sum(rows), cols]`` tensor (``cols=0``: a 1-D tensor)."""
    return EnumerableShardingSpec(
        shards=[
            ShardMetadata(
                shard_offsets=[b, 0] if cols else [b],
                shard_sizes=[n, cols] if cols else [n],
                placement=f"rank:{r}",
            )
            for b, n, r in shards
        ]
    )


SPECS_2D: dict[str, Any] = {  # of a [10, 20] tensor
    "rows2": ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
    "rows4": ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
    "uneven5": rows((0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)),
    "uneven2": rows((0, 8, 1), (8, 2, 0)),
    "cols2": ChunkShardingSpec(dim=1, placements=["rank:0", "rank:1"]),
}
SPECS_1D: dict[str, Any] = {  # of a [32] tensor
    "rows2": ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
    "rows4": ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
    "first8": rows((0, 8, 1), (8, 24, 0), cols=0),
    "first10": rows((0, 10, 0), (10, 22, 1), cols=0),
}


def gathered(st: Any) -> torch.Tensor | None:
    """The whole of ShardedTensor ``st`` on rank 0 (None elsewhere); every rank calls it."""
    full = torch.zeros(st.shape) if dist.get_rank() == 0 else None
    st.gather(dst=0, out=full)
    return full


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)


def everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank; every rank calls it."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save(sd: dict[str, Any], url: str | Path, **options: Any) -> None:
    dcp.save(sd, storage_writer=StorageWriter(url, **options))


def load(sd: dict[str, Any], url: str | Path, **options: Any) -> None:
    dcp.load(sd, storage_reader=StorageReader(url, **options))


def shard_round_trip(out: Path) -> dict[str, bool]:
    result = {}
    for threads in (1, 2):
        saved = sharded_tensor.rand(SPECS_2D["rows2"], 10, 20, init_rrefs=False)
        target = sharded_tensor.zeros(SPECS_2D["rows2"], 10, 20, init_rrefs=False)
        save({"st": saved}, out / f"round-{threads}", thread_count=threads)
        pairs = list(zip(saved.local_shards(), target.local_shards(), strict=True))
        before = all(not torch.equal(s.tensor, t.tensor) for s, t in pairs)
        load({"st": target}, out / f"round-{threads}")
        after = all(torch.equal(s.tensor, t.tensor) for s, t in pairs)
        result[f"threads{threads}"] = everywhere(before and after)
    return result


def reshard(out: Path) -> dict[str, bool]:
    result = {}
    for i, (name, spec) in enumerate(SPECS_2D.items()):
        saved = sharded_tensor.rand(spec, 10, 20, init_rrefs=False)
        save({"st": saved}, out / f"reshard-{name}", thread_count=1 + i % 2)
        whole = gathered(saved)
        for other, other_spec in SPECS_2D.items():
            if other == name:
                continue
            target = sharded_tensor.zeros(other_spec, 10, 20, init_rrefs=False)
            load({"st": target}, out / f"reshard-{name}")
            loaded = gathered(target)
            if dist.get_rank() == 0:
                result[f"{name}->{other}"] = same(loaded, whole)
    return result


def switch(out: Path) -> dict[str, bool]:
    result = {}
    for name, spec in SPECS_1D.items():
        replicated = torch.rand(32)
        dist.broadcast(replicated, src=0)
        saved = {"sharded": sharded_tensor.rand(spec, 32, init_rrefs=False), "replicated": replicated}
        save(saved, out / f"switch-{name}")
        whole = gathered(saved["sharded"])
        for other, other_spec in SPECS_1D.items():
            target = {"sharded": torch.zeros(32), "replicated": sharded_tensor.zeros(other_spec, 32, init_rrefs=False)}
            load(target, out / f"switch-{name}")
            loaded = gathered(target["replicated"])
            if dist.get_rank() == 0:
                ok = same(target["sharded"], whole) and same(loaded, replicated)
                result[f"{name}->{other}"] = ok
    return result


def dtensor(out: Path) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(5)
    full = torch.randn(6, 8)
    save({"d": distribute_tensor(full, mesh, [Shard(0)])}, out / "dtensor")
    result = {}
    for label, placement in (("shard1", Shard(1)), ("replicate", Replicate())):
        target = {"d": distribute_tensor(torch.zeros(6, 8), mesh, [placement])}
        load(target, out / "dtensor")
        result[label] = everywhere(same(target["d"].full_tensor(), full))
    return result


def plain_values(out: Path) -> dict[str, bool]:
    save({"bytes0": [1], "bytes1": "string"}, out / "plain")
    target: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    load(target, out / "plain")
    return {"every_rank": everywhere(target == {"bytes0": [1], "bytes1": "string"})}


FSSPEC_OPTIONS = {"storage_options": {"auto_mkdir": True}}


def fsspec_fsdp2(out: Path) -> dict[str, bool]:
    url = f"local://{out / 'fsdp2'}"
    model, optimizer = build(1234)
    save(state(model, optimizer), url, **FSSPEC_OPTIONS)
    saved = digest(model, optimizer)
    model, optimizer = build(99)
    differs = digest(model, optimizer) != saved
    target = state(model, optimizer)
    load(target, url, **FSSPEC_OPTIONS)
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    loaded = digest(model, optimizer)
    return {"loaded": differs and loaded == saved} if dist.get_rank() == 0 else {}


def fsspec_overwrite(out: Path) -> dict[str, bool]:
    url = f"local://{out / 'overwrite'}"
    t1, t2 = torch.randn(10), torch.randn(10)
    dist.broadcast(t1, src=0)
    dist.broadcast(t2, src=0)
    save({"random": t1}, url, **FSSPEC_OPTIONS)
    save({"random": t2}, url, overwrite=True, **FSSPEC_OPTIONS)
    target = {"random": torch.zeros(10)}
    load(target, url, **FSSPEC_OPTIONS)
    replaced = torch.equal(target["random"], t2)
    try:
        save({"random": t1}, url, **FSSPEC_OPTIONS)
        refused = False
    except CheckpointException as exc:
        refused = any(isinstance(error, CheckpointExistsError) for error, _ in exc.failures.values())
    load(target, url, **FSSPEC_OPTIONS)
    kept = torch.equal(target["random"], t2)
    return {"replaced": everywhere(replaced), "refused": everywhere(refused), "kept": everywhere(kept)}


CASES = (shard_round_trip, reshard, switch, dtensor, plain_values, fsspec_fsdp2, fsspec_overwrite)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(dist.get_rank())
    results = {case.__name__: case(out) for case in CASES}
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
