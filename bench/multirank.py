"""Multi-rank save and load: ckptfmt beside torch DCP, on 1, 2 and 4 gloo ranks (CPU), in one run.

    python bench/multirank.py [--size-mib 256] [--repeat 3]

Each configuration starts its ranks as processes on this machine. A model of ``--size-mib`` of fp32
parameters is sharded with FSDP2 (``fully_shard``) over the ranks, given AdamW state by one step, then
saved and loaded by ckptfmt (``ckptfmt.torch.save``/``load``) and by DCP (``dcp.save``/``dcp.load`` of
the same state dicts), alternating, medians of ``--repeat``; every save is made durable (ckptfmt
fsyncs; DCP's files are fsynced by its writer) and the page cache is dropped before each load where
the machine allows. It also loads the 4-rank ckptfmt checkpoint on 3 ranks and reports the bytes each
rank read against the checkpoint's size. Prints one table; writes nothing outside ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptfmt
    import ckptfmt.torch as ct
    from ckptfmt.torch import state as st

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    width = 1024
    layers = max(1, (args.size_mib << 20) // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    sampler = ct.ResumableSampler(1000, seed=1, rank=rank, world_size=world)
    config = {"layers": layers, "width": width}
    out = Path(args.out)
    result: dict[str, Any] = {}

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    if args.mode == "saveload":
        for i in range(args.repeat):
            url = out / f"ckptfmt-{world}-{i}"
            dcp_dir = out / f"dcp-{world}-{i}"
            result.setdefault("ckptfmt_save", []).append(
                timed(lambda: ct.save(url, step=1, model=model, optimizer=optimizer, config=config, sampler=sampler))
            )
            msd, osd = get_state_dict(model, optimizer)
            result.setdefault("dcp_save", []).append(
                timed(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir)))
            )
            if rank == 0:
                _drop_caches()
            result.setdefault("ckptfmt_load", []).append(
                timed(lambda: ct.load(url, model=model, optimizer=optimizer, config=config, sampler=sampler))
            )
            if rank == 0:
                _drop_caches()

            def dcp_load() -> None:
                msd2, osd2 = get_state_dict(model, optimizer)
                state = {"model": msd2, "optim": osd2}
                dcp.load(state, checkpoint_id=str(dcp_dir))
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

            result.setdefault("dcp_load", []).append(timed(dcp_load))
        if world == 4:
            keep = out / "ckptfmt-4-keep"
            if rank == 0 and keep.exists():
                shutil.rmtree(keep)
            dist.barrier()
            ct.save(keep, step=1, model=model, optimizer=optimizer, config=config, sampler=sampler)
    elif args.mode == "bytes":
        ckpt = ckptfmt.open(out / "ckptfmt-4-keep")
        st.read_snapshot(ckpt, st.load_targets(model))
        result["bytes_read"] = ckpt.bytes_read
        result["checkpoint_bytes"] = ckpt.manifest.total_bytes
    (out / f"result-{args.mode}-{world}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(mode: str, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
        env.update({"WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--out", args.out]
        cmd += ["--size-mib", str(args.size_mib), "--repeat", str(args.repeat)]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{mode} on {world} ranks failed")
    return [json.loads((Path(args.out) / f"result-{mode}-{world}-{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="saveload")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="ckptfmt-bench-") as tmp:
        args.out = args.out or tmp
        print(f"{args.size_mib} MiB of fp32 parameters (+ AdamW moments), FSDP2 over gloo on this machine")
        head = ("ranks", "ckptfmt save", "DCP save", "ratio", "ckptfmt load", "DCP load", "ratio")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 13, 9, 6, 13, 9, 6), strict=True)))
        for world in (1, 2, 4):
            rows = launch("saveload", world, args)
            med = {k: statistics.median(max(r[k][i] for r in rows) for i in range(args.repeat)) for k in rows[0]}
            save, dsave, load, dload = (med[k] for k in ("ckptfmt_save", "dcp_save", "ckptfmt_load", "dcp_load"))
            print(
                f"{world:>5} {save:>12.2f}s {dsave:>8.2f}s {dsave / save:>5.2f}x"
                f" {load:>12.2f}s {dload:>8.2f}s {dload / load:>5.2f}x"
            )
        rows = launch("bytes", 3, args)
        total = rows[0]["checkpoint_bytes"]
        per_rank = ", ".join(f"rank {i}: {r['bytes_read'] / total:.3f}" for i, r in enumerate(rows))
        read_sum = sum(r["bytes_read"] for r in rows) / total
        print(f"4 -> 3 ranks: tensor bytes read / checkpoint size: {per_rank}; sum {read_sum:.3f}")
        print("ratio = DCP time / ckptfmt time (above 1: ckptfmt faster)")


if __name__ == "__main__":
    main()
