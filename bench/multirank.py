"""Multi-rank save and load: ckptfmt beside torch DCP, on 1, 2 and 4 gloo ranks (CPU), in one run.

    python bench/multirank.py [--size-mib 256] [--repeat 3] [--json OUT] [--dir DIR]

Each configuration starts its ranks as processes on this machine. A model of ``--size-mib`` of fp32
parameters is sharded with FSDP2 (``fully_shard``) over the ranks, given AdamW state by one step, then
saved and loaded by ckptfmt (``ckptfmt.torch.save``/``load``) and by DCP (``dcp.save``/``dcp.load`` of
the same state dicts), alternating, medians of ``--repeat``; every save is made durable (ckptfmt
fsyncs; DCP's files are fsynced by its writer) and the checkpoint's files are evicted from the page cache
before each load (fsync + ``posix_fadvise(DONTNEED)`` per file, which needs no root), then ``sync`` and a
second of quiet, so no load is timed against the writeback of the saves before it. Before each save every
rank writes and deletes a scratch file of its share of the state and a quarter more (``ranks.warm_page_cache``),
so every save starts from memory the hypervisor already backs, as in ``bench/save_phases.py``. Without it this
bench was wrong about the saves through the page cache: it keeps every save's files, so safetensors and DCP wrote
into memory this VM's host backs lazily, a cost of the VM and not theirs (safetensors' 1-rank save of 384 MiB at
``--size-mib 128`` took 1.15 s; the disk writes 256 MiB in 0.13 s). The same holds before each timed load, after
the quiet second (in which the host takes back what the eviction freed): every rank writes and deletes a scratch file
of two and a half times its share, for the load's page cache, its new tensors and its buffers. Without it a restart,
which allocates the optimizer's moments, paid 0.3-0.6 s per 256 MiB of new memory or nothing, by chance (DCP's 1-rank
restart of 384 MiB took 0.57-1.43 s in three runs, ckptfmt's 0.30-0.53 s). It also loads the
4-rank ckptfmt checkpoint on 3 and on 2 ranks (the load path's ``read_snapshot``) and reports the tensor
bytes each rank fetched (``Checkpoint.bytes_read``) over the checkpoint's tensor bytes (the sum of its
chunks' stored sizes): the ideal is 1/3 and 1/2. Prints markdown tables (``--json OUT``: the figures);
writes nothing outside ``--dir`` (default: a temp dir under bench/out, on the disk).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import ranks  # bench/ is not a package
from ranks import evict, fsync_path, settle, warm_page_cache


def tensor_bytes(ckpt: Any) -> int:
    """The checkpoint's tensor bytes as stored: what ``bytes_read`` counts when every chunk is read once."""
    return sum(c.nbytes for f in ckpt.fields.values() for t in f.tensors.values() for c in t.chunks)


def local(value: Any) -> Any:
    """A DTensor's shard on this rank (contiguous, as safetensors takes it); any other tensor as it is."""
    shard = value.to_local() if hasattr(value, "to_local") else value
    return shard.detach().contiguous()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptfmt
    import ckptfmt.torch as ct
    from ckptfmt.torch import read_state as st

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    width = 1024
    layers = max(1, (args.size_mib << 20) // (4 * width * width))
    torch.manual_seed(0)

    def build() -> tuple[Any, Any]:
        """The model, sharded, and an optimizer with no state yet: what a restarted process holds before its load."""
        built = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        for layer in built:
            fully_shard(layer, mesh=mesh)
        fully_shard(built, mesh=mesh)
        return built, torch.optim.AdamW(built.parameters(), lr=1e-3)

    model, optimizer = build()
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    sampler = ct.ResumableSampler(1000, seed=1, rank=rank, world_size=world)
    config = {"layers": layers, "width": width}
    out = Path(args.out)
    share = 3 * sum(local(p).nbytes for p in model.parameters())  # this rank's parameters and both AdamW moments
    result: dict[str, Any] = {}

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def dcp_restore(into: Any, into_optimizer: Any, path: Path) -> None:
        msd2, osd2 = get_state_dict(into, into_optimizer)
        state: dict[str, Any] = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(into, into_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def cold(path: Path) -> None:
        """Before a timed load: ``path``'s files out of the page cache and the disk quiet (rank 0), then every rank
        writes and deletes a scratch file of its share of the state two and a half times, so the load's page cache,
        new tensors and buffers come from memory the hypervisor already backs (``ranks.warm_page_cache``)."""
        if rank == 0:
            evict(path)
            settle()
        dist.barrier()
        warm_page_cache(out, 2 * share + share // 2)

    def restarts(ours: Path, theirs: Path, i: int) -> None:
        """Each side's load into fresh objects, built before the clock starts (the order alternating with ``i``)."""
        for key, path in [("ckptfmt_restart", ours), ("dcp_restart", theirs)][:: 1 if i % 2 == 0 else -1]:
            fresh, fresh_optimizer = build()
            cold(path)
            load: Callable[[], object]
            if key == "ckptfmt_restart":
                load = functools.partial(
                    ct.load, ours, model=fresh, optimizer=fresh_optimizer, config=config, sampler=sampler, fresh=True
                )
            else:
                load = functools.partial(dcp_restore, fresh, fresh_optimizer, path)
            result.setdefault(key, []).append(timed(load))
            del fresh, fresh_optimizer, load

    if args.mode == "saveload":
        for i in range(args.repeat):
            url = out / f"ckptfmt-{world}-{i}"
            dcp_dir = out / f"dcp-{world}-{i}"
            st_dir = out / f"safetensors-{world}-{i}"

            def ckptfmt_save() -> None:
                ct.save(url, step=1, model=model, optimizer=optimizer, config=config, sampler=sampler)

            def dcp_save() -> None:
                msd, osd = get_state_dict(model, optimizer)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir))

            def safetensors_save() -> None:
                # each rank's own shards in one file of its own, then fsync: the plain-format floor
                msd, osd = get_state_dict(model, optimizer)
                flat = {f"model.{k}": local(v) for k, v in msd.items()}
                states: dict[str, Any] = osd["state"]  # type: ignore[assignment]
                for param, state in states.items():
                    flat.update({f"optim.{param}.{k}": local(v) for k, v in state.items() if torch.is_tensor(v)})
                st_dir.mkdir(parents=True, exist_ok=True)
                path = st_dir / f"rank{rank:05d}.safetensors"
                save_file(flat, str(path))
                fsync_path(path)
                fsync_path(st_dir)

            def ckptfmt_load() -> None:
                ct.load(url, model=model, optimizer=optimizer, config=config, sampler=sampler)

            def dcp_load() -> None:
                dcp_restore(model, optimizer, dcp_dir)

            # the order alternates each repetition, so neither side always runs first
            saves = [("ckptfmt_save", ckptfmt_save), ("dcp_save", dcp_save), ("safetensors_save", safetensors_save)]
            loads = [("ckptfmt_load", ckptfmt_load, url), ("dcp_load", dcp_load, dcp_dir)]
            for key, fn in saves if i % 2 == 0 else saves[::-1]:
                warm_page_cache(out, share + share // 4)  # every save starts from the same memory (ranks.py)
                result.setdefault(key, []).append(timed(fn))
            for key, fn, path in loads if i % 2 == 0 else loads[::-1]:
                cold(path)  # the files were just written, so all of them are cached
                result.setdefault(key, []).append(timed(fn))
            # A restart: fresh objects (built before the clock starts), whose optimizer has no state yet, so both
            # loads allocate it (DCP's get_state_dict initializes it; ckptfmt reads into new arrays it adopts).
            restarts(url, dcp_dir, i)
        if world == 4:  # kept for the reshard runs (4 -> 3, 4 -> 2)
            keep, dcp_keep = out / "ckptfmt-4-keep", out / "dcp-4-keep"
            if rank == 0:
                shutil.rmtree(keep, ignore_errors=True)
                shutil.rmtree(dcp_keep, ignore_errors=True)
            dist.barrier()
            ct.save(keep, step=1, model=model, optimizer=optimizer, config=config, sampler=sampler)
            msd, osd = get_state_dict(model, optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dcp_keep))
    elif args.mode == "bytes":
        keep, dcp_keep = out / "ckptfmt-4-keep", out / "dcp-4-keep"

        def ckptfmt_read() -> None:
            with ckptfmt.open(keep) as ckpt:
                st.read_snapshot(ckpt, st.load_targets(model))  # what ct.load reads, before applying it
                result["bytes_read"] = ckpt.bytes_read
                result["tensor_bytes"] = tensor_bytes(ckpt)
                result["file_bytes"] = ckpt.manifest.total_bytes

        def dcp_load() -> None:
            msd2, osd2 = get_state_dict(model, optimizer)
            dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(dcp_keep))

        reads = [("ckptfmt_read", ckptfmt_read, keep), ("dcp_load", dcp_load, dcp_keep)]
        for i in range(args.repeat):  # alternating which goes first, each cold
            for key, fn, path in reads if i % 2 == 0 else reads[::-1]:
                cold(path)
                result.setdefault(key, []).append(timed(fn))
            # The recovery this is about: fewer ranks restart from the checkpoint of a lost node's run, into fresh
            # objects whose optimizer has no state yet; each load is the whole restore (read, verify, apply).
            restarts(keep, dcp_keep, i)
    (out / f"result-{args.mode}-{world}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # Skip the interpreter's teardown: in about one run in six a rank aborted there, after its results were written
    # and its group destroyed ("terminate called without an active exception", a joinable C++ thread destroyed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(mode: str, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    return ranks.launch(
        __file__, mode, world, args.out, ["--size-mib", str(args.size_mib), "--repeat", str(args.repeat)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under bench/out)")
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="saveload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    root = Path(args.dir) if args.dir else Path(__file__).parent / "out"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multirank-", dir=root) as tmp:
        args.out = tmp
        report = run(args)
    print_tables(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"size_mib": args.size_mib, "repeat": args.repeat, "worlds": {}, "reshard": {}}
    for world in (1, 2, 4):
        rows = launch("saveload", world, args)
        # a step takes as long as its slowest rank: the max over ranks of each repetition, then the median
        slowest = {k: [max(r[k][i] for r in rows) for i in range(args.repeat)] for k in rows[0]}
        report["worlds"][str(world)] = {k: statistics.median(v) for k, v in slowest.items()}
        report["worlds"][str(world)]["save_ratios"] = _ratios(slowest["dcp_save"], slowest["ckptfmt_save"])
        report["worlds"][str(world)]["safetensors_save_ratios"] = _ratios(
            slowest["safetensors_save"], slowest["ckptfmt_save"]
        )
        report["worlds"][str(world)]["load_ratios"] = _ratios(slowest["dcp_load"], slowest["ckptfmt_load"])
        report["worlds"][str(world)]["restart_ratios"] = _ratios(slowest["dcp_restart"], slowest["ckptfmt_restart"])
    for world in (3, 2):
        rows = launch("bytes", world, args)
        total = rows[0]["tensor_bytes"]
        ours = [max(r["ckptfmt_read"][i] for r in rows) for i in range(args.repeat)]
        theirs = [max(r["dcp_load"][i] for r in rows) for i in range(args.repeat)]
        report["reshard"][f"4->{world}"] = {
            "tensor_bytes": total,
            "file_bytes": rows[0]["file_bytes"],
            "per_rank": [r["bytes_read"] / total for r in rows],
            "sum": sum(r["bytes_read"] for r in rows) / total,
            "ideal": 1 / world,
            "ckptfmt_read": statistics.median(ours),
            "dcp_load": statistics.median(theirs),
            "ratios": _ratios(theirs, ours),
        }
        for key in ("ckptfmt_restart", "dcp_restart"):
            report["reshard"][f"4->{world}"][key] = statistics.median(
                max(r[key][i] for r in rows) for i in range(args.repeat)
            )
        report["reshard"][f"4->{world}"]["restart_ratios"] = _ratios(
            [max(r["dcp_restart"][i] for r in rows) for i in range(args.repeat)],
            [max(r["ckptfmt_restart"][i] for r in rows) for i in range(args.repeat)],
        )
    return report


def _ratios(theirs: list[float], ours: list[float]) -> list[float]:
    """DCP's time / ckptfmt's, repetition by repetition (each the slowest rank)."""
    return [t / o for t, o in zip(theirs, ours, strict=True)]


def _spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def print_tables(report: dict[str, Any]) -> None:
    print(
        f"{report['size_mib']} MiB of fp32 parameters (+ AdamW moments), FSDP2 over gloo on this machine; "
        f"median of {report['repeat']} (each the slowest rank); ratio = DCP time / ckptfmt time (>1: ckptfmt faster)"
    )
    print()
    print("| ranks | ckptfmt save | DCP save | save ratio | ckptfmt load | DCP load | load ratio | per repetition |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for world, m in report["worlds"].items():
        save, dsave, load, dload = (m[k] for k in ("ckptfmt_save", "dcp_save", "ckptfmt_load", "dcp_load"))
        print(
            f"| {world} | {save:.2f} s | {dsave:.2f} s | {dsave / save:.2f} | {load:.2f} s | {dload:.2f} s "
            f"| {dload / load:.2f} | {_spread(m['load_ratios'])} |"
        )
    print()
    print("Durable saves: DCP (its writer fsyncs) and each rank's shards through safetensors.save_file + fsync")
    print()
    print("| ranks | ckptfmt | DCP | DCP / ckptfmt (per repetition) | safetensors | safetensors / ckptfmt (per rep.) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for world, m in report["worlds"].items():
        save, dsave, ssave = (m[k] for k in ("ckptfmt_save", "dcp_save", "safetensors_save"))
        print(
            f"| {world} | {save:.3f} s | {dsave:.3f} s | {statistics.median(m['save_ratios']):.2f} "
            f"({_spread(m['save_ratios'])}) | {ssave:.3f} s | {statistics.median(m['safetensors_save_ratios']):.2f} "
            f"({_spread(m['safetensors_save_ratios'])}) |"
        )
    print()
    print("Loaded by a restart: into a fresh model and an optimizer with no state yet (built before the clock starts)")
    print()
    print("| ranks | ckptfmt load | DCP load | ratio | per repetition |")
    print("| --- | --- | --- | --- | --- |")
    for world, m in report["worlds"].items():
        ours, theirs = m["ckptfmt_restart"], m["dcp_restart"]
        print(f"| {world} | {ours:.2f} s | {theirs:.2f} s | {theirs / ours:.2f} | {_spread(m['restart_ratios'])} |")
    print()
    print(
        "| 4-rank checkpoint loaded on | tensor bytes read per rank / checkpoint's | sum | ideal per rank "
        "| ckptfmt read | DCP load | ratio | per repetition |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, m in report["reshard"].items():
        per_rank = " / ".join(f"{f:.3f}" for f in m["per_rank"])
        print(
            f"| {label.split('->')[1]} ranks | {per_rank} | {m['sum']:.3f} | {m['ideal']:.3f} "
            f"| {m['ckptfmt_read']:.2f} s | {m['dcp_load']:.2f} s | {m['dcp_load'] / m['ckptfmt_read']:.2f} "
            f"| {_spread(m['ratios'])} |"
        )
    print()
    print("A 4-rank checkpoint restored by a restart on fewer ranks: fresh model and optimizer, the whole load")
    print()
    print("| 4-rank checkpoint restored on | ckptfmt load | DCP load | ratio | per repetition |")
    print("| --- | --- | --- | --- | --- |")
    for label, m in report["reshard"].items():
        ours, theirs = m["ckptfmt_restart"], m["dcp_restart"]
        print(
            f"| {label.split('->')[1]} ranks | {ours:.2f} s | {theirs:.2f} s | {theirs / ours:.2f} "
            f"| {_spread(m['restart_ratios'])} |"
        )
    some = next(iter(report["reshard"].values()))
    tensor_mib, file_mib = some["tensor_bytes"] / (1 << 20), some["file_bytes"] / (1 << 20)
    print(
        f"\ncheckpoint tensor bytes {tensor_mib:.1f} MiB (files {file_mib:.1f} MiB);"
        " cold: each checkpoint's files evicted from the page cache before each load; a reshard's ckptfmt"
        " read is read_snapshot (read and verified, not applied), DCP's is dcp.load into the state dicts"
    )


if __name__ == "__main__":
    main()
