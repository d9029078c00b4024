"""DCP's storage layer: ``ckptfmt.dcp.StorageWriter``/``StorageReader`` against DCP's own ``FileSystemWriter``/
``FileSystemReader``, on 1, 2 and 4 gloo ranks (CPU), and a 4-rank checkpoint loaded on 3, in one run.

    python bench/dcp_storage.py [--mib 64] [--repeat 3] [--json OUT] [--dir DIR]

Each world size is one launch of its ranks as processes on this machine (gloo over loopback), which makes every
measurement of that world size. The state is an FSDP2 model (``fully_shard`` on every Linear and the root; 512-wide
fp32 Linears) after one AdamW step, taken with ``get_state_dict``: ``--mib`` is the whole state (parameters and
both AdamW moments). Both sides get the same state dict and DCP's default planners; only the storage layer
differs, each with its defaults (ckptfmt: 2 I/O threads per rank, raw; ``FileSystemWriter``: ``sync_files=True``,
one thread, one file per rank). Per repetition, the two sides' order alternates (ckptfmt first in even ones):

- **save**: ``dcp.save`` into a new directory, barrier to barrier. Both are durable when it returns:
  ``FileSystemWriter`` fsyncs each file (``sync_files=True``); ckptfmt fsyncs by its commit protocol.
- **async stall**: ``dcp.async_save`` (thread executor, no stager given) until it returns, i.e. what the
  training loop waits; **async done**: until its future's result. The stall is mostly staging, a copy of the
  state into CPU memory, and DCP chooses the stager: ``FileSystemWriter`` is an ``AsyncStager`` and stages
  itself (``BlockingAsyncStager``), ckptfmt's writer is not, so DCP uses its ``DefaultStager``.
- **load**: ``dcp.load`` of the save's checkpoint into the existing state dict (built before the clock), cold:
  rank 0 evicts the checkpoint's files from the page cache (fsync + ``POSIX_FADV_DONTNEED``), then ``sync`` and a
  second of quiet, so no load is timed against the writeback of the saves before it.
- **4->3 reshard** (a fourth launch, 3 ranks): the last repetition's 4-rank checkpoints of both sides, loaded cold
  into a 3-rank FSDP2 state dict; the time, and the bytes each rank read: the ``rchar`` delta of ``/proc/self/io``
  around ``dcp.load`` (every ``read``/``pread`` of the process, its threads included, the same way for both
  readers; it also counts the small plan exchange over gloo's sockets), against the checkpoint's size on disk.

Each figure is the slowest rank's, median of ``--repeat``; ratios are ckptfmt's time / DCP's (<1: ckptfmt
faster; for bytes, <1: ckptfmt read less). The storage layer's own calls (``write_data`` + ``finish``,
``read_metadata`` + ``read_data``) are timed too, so the JSON (``--json OUT``) tells how much of a difference is
the storage layer's and how much DCP's planning and collectives, which are the same for both. No assertion.
Writes nothing outside ``--dir`` (default: a temp dir under bench/out). The default run (``--mib 64 --repeat 3``)
took 66 s on the 2-core CI VM, most of it in process starts and the second of quiet before each load.
"""

from __future__ import annotations

import argparse
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
from ranks import evict, settle

SIDES = ("ckptfmt", "dcp")
WIDTH = 512
# what the storage layer's share of a save and of a load is made of (the rest is DCP's planning and collectives)
SAVE_CALLS = ("write_data", "finish")
LOAD_CALLS = ("read_metadata", "read_data")


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def proc_io() -> dict[str, int]:
    """This process's I/O counters (``rchar``: bytes passed to read calls; ``read_bytes``: fetched from storage)."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def time_calls(obj: Any, names: tuple[str, ...], sink: dict[str, float]) -> Any:
    """``obj`` with each of its methods ``names`` timed into ``sink`` (seconds summed per name)."""
    for name in names:
        method = getattr(obj, name)

        def timed(*args: Any, _method: Callable[..., Any] = method, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                sink[_name] = sink.get(_name, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)
    return obj


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptfmt.dcp import StorageReader, StorageWriter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    layers = max(1, round((args.mib << 20) / (3 * 4 * WIDTH * WIDTH)))  # weights + two AdamW moments, fp32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    out = Path(args.out)
    result: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        result.setdefault(key, []).append(value)

    def writer(side: str, path: Path, calls: dict[str, float]) -> Any:
        made = StorageWriter(path) if side == "ckptfmt" else FileSystemWriter(str(path))
        return time_calls(made, SAVE_CALLS, calls)

    def reader(side: str, path: Path, calls: dict[str, float]) -> Any:
        made = StorageReader(path) if side == "ckptfmt" else FileSystemReader(str(path))
        return time_calls(made, LOAD_CALLS, calls)

    def save(side: str, path: Path) -> None:
        calls: dict[str, float] = {}
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer(side, path, calls))
        dist.barrier()
        record(f"{side}_save", time.perf_counter() - start)
        record(f"{side}_save_storage", sum(calls.values()))

    def async_save(side: str, path: Path) -> None:
        calls: dict[str, float] = {}
        dist.barrier()
        start = time.perf_counter()
        pending: Any = dcp.async_save(
            state, storage_writer=writer(side, path, calls), async_checkpointer_type=AsyncCheckpointerType.THREAD
        )
        stall = time.perf_counter() - start
        # no collective on this thread until the save is done: its background thread uses the same group
        (pending.upload_completion if hasattr(pending, "upload_completion") else pending).result()
        done = time.perf_counter() - start
        dist.barrier()
        record(f"{side}_stall", stall)
        record(f"{side}_done", done)

    def load(side: str, path: Path) -> None:
        calls: dict[str, float] = {}
        storage_reader = reader(side, path, calls)
        if rank == 0:
            evict(path)
            settle()
        dist.barrier()
        before = proc_io()
        start = time.perf_counter()
        dcp.load(state, storage_reader=storage_reader)
        elapsed = time.perf_counter() - start
        after = proc_io()
        dist.barrier()
        record(f"{side}_load", elapsed)
        record(f"{side}_load_storage", sum(calls.values()))
        record(f"{side}_rchar", after["rchar"] - before["rchar"])
        record(f"{side}_read_bytes", after["read_bytes"] - before["read_bytes"])

    for i in range(args.repeat):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        if args.mode == "reshard":  # the 4-rank launch's last checkpoints, loaded on this (smaller) world
            for side in order:
                load(side, out / f"{side}-4-sync")
            continue
        sync_dirs = {side: out / f"{side}-{world}-sync" for side in SIDES}
        async_dirs = {side: out / f"{side}-{world}-async" for side in SIDES}
        if rank == 0:
            for path in [*sync_dirs.values(), *async_dirs.values()]:
                shutil.rmtree(path, ignore_errors=True)  # the previous repetition's
        for side in order:
            save(side, sync_dirs[side])
        for side in order:
            async_save(side, async_dirs[side])
        for side in order:
            load(side, sync_dirs[side])
    if rank == 0 and args.mode != "reshard":
        result["checkpoint_bytes"] = [float(disk_bytes(out / f"{side}-{world}-sync")) for side in SIDES]
    (out / f"result-{args.mode}-{world}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # as bench/multirank.py: skip the interpreter's teardown, where a rank now and then aborted after its results
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(mode: str, world: int, args: argparse.Namespace) -> list[dict[str, list[float]]]:
    return ranks.launch(__file__, mode, world, args.out, ["--mib", str(args.mib), "--repeat", str(args.repeat)])


def slowest(rows: list[dict[str, list[float]]], key: str) -> list[float]:
    """Per repetition, the slowest rank's figure (a step waits for its slowest rank)."""
    return [max(r[key][i] for r in rows) for i in range(len(rows[0][key]))]


def summarize(rows: list[dict[str, list[float]]], figures: tuple[str, ...]) -> dict[str, Any]:
    """Per figure: each side's median (slowest rank), the median ratio ckptfmt / DCP and its range over repetitions."""
    out: dict[str, Any] = {}
    for figure in figures:
        ours, theirs = slowest(rows, f"ckptfmt_{figure}"), slowest(rows, f"dcp_{figure}")
        ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
        out[figure] = {
            "ckptfmt": statistics.median(ours),
            "dcp": statistics.median(theirs),
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"mib": args.mib, "repeat": args.repeat, "worlds": {}}
    figures = ("save", "save_storage", "stall", "done", "load", "load_storage")
    checkpoint_bytes: list[float] = []
    for world in (1, 2, 4):
        rows = launch("saveload", world, args)
        report["worlds"][str(world)] = summarize(rows, figures)
        checkpoint_bytes = rows[0]["checkpoint_bytes"]
    report["checkpoint_bytes"] = dict(zip(SIDES, checkpoint_bytes, strict=True))  # the 4-rank ones, read below
    rows = launch("reshard", 3, args)
    reshard = summarize(rows, ("load", "load_storage"))
    for side in SIDES:
        # bytes read are the same every repetition, up to the plan exchange: the median per rank
        reshard[f"{side}_rchar"] = [statistics.median(r[f"{side}_rchar"]) for r in rows]
        reshard[f"{side}_read_bytes"] = [statistics.median(r[f"{side}_read_bytes"]) for r in rows]
    report["reshard_4_to_3"] = reshard
    return report


def print_tables(report: dict[str, Any]) -> None:
    print(
        f"{report['mib']} MiB of state (fp32 parameters + AdamW moments), FSDP2 over gloo on this machine; "
        f"median of {report['repeat']} (each the slowest rank); ratio = ckptfmt time / DCP time (<1: ckptfmt faster)"
    )
    print()
    print(
        "| ranks | save: ckptfmt / DCP | ratio | async stall: ckptfmt / DCP | ratio | async done: ckptfmt / DCP "
        "| ratio | cold load: ckptfmt / DCP | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for world, m in report["worlds"].items():
        cells = [world]
        for figure in ("save", "stall", "done", "load"):
            cells += [f"{m[figure]['ckptfmt']:.2f} / {m[figure]['dcp']:.2f} s", _ratio(m[figure])]
        print("| " + " | ".join(cells) + " |")
    print()
    print("Of which in the storage layer's calls (save: write_data + finish; load: read_metadata + read_data):")
    print()
    print("| ranks | save: ckptfmt / DCP | ratio | load: ckptfmt / DCP | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for world, m in report["worlds"].items():
        cells = [world]
        for figure in ("save_storage", "load_storage"):
            cells += [f"{m[figure]['ckptfmt']:.2f} / {m[figure]['dcp']:.2f} s", _ratio(m[figure])]
        print("| " + " | ".join(cells) + " |")
    print()
    r, size = report["reshard_4_to_3"], report["checkpoint_bytes"]
    mib = 1 << 20
    print(
        f"4-rank checkpoint loaded cold on 3 ranks (on disk: ckptfmt {size['ckptfmt'] / mib:.1f} MiB, "
        f"DCP {size['dcp'] / mib:.1f} MiB); read per rank = rchar delta around dcp.load, MiB (÷ the checkpoint):"
    )
    print()
    print("| reader | read per rank | sum | load | of which storage calls |")
    print("| --- | --- | --- | --- | --- |")
    for side, label in (("ckptfmt", "ckptfmt StorageReader"), ("dcp", "FileSystemReader")):
        per_rank = " / ".join(f"{b / mib:.1f} ({b / size[side]:.3f})" for b in r[f"{side}_rchar"])
        total = sum(r[f"{side}_rchar"])
        print(
            f"| {label} | {per_rank} | {total / mib:.1f} ({total / size[side]:.3f}) "
            f"| {r['load'][side]:.2f} s | {r['load_storage'][side]:.2f} s |"
        )
    print(f"| ratio ckptfmt / DCP | | | {_ratio(r['load'])} | {_ratio(r['load_storage'])} |")


def _ratio(m: dict[str, Any]) -> str:
    low, high = m["ratio_range"]
    return f"{m['ratio']:.2f} ({low:.2f}-{high:.2f})" if low != high else f"{m['ratio']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="the whole state: parameters and AdamW moments")
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
    with tempfile.TemporaryDirectory(prefix="dcp-storage-", dir=root) as tmp:
        args.out = tmp
        report = run(args)
    print_tables(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":  # the ranks run this file again (--worker): nothing runs at import
    main()
