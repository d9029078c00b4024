"""One process, durable saves of a model and its AdamW state: ckptfmt beside DCP, safetensors and torch.save, in one
run, and where a ckptfmt save spends its time.

    python bench/save_phases.py [--mib 256] [--repeat 5] [--dir DIR] [--json OUT] [--no-phases]

The state is ``--mib`` MiB in all: fp32 weights of a stack of linear layers and AdamW's two moments (one step
taken). Each repetition saves it once with each method, into a fresh directory (removed after the save), in an
order that rotates each repetition; before each save, ``sync`` and a second of quiet (``ranks.settle``), so no save
is timed against the writeback of the one before, then a scratch file of the state's size and a quarter more written
and deleted (``ranks.warm_page_cache``), so every save starts from memory the hypervisor already backs. Without the
scratch file this bench was wrong: each save found whatever memory the saves before it had freed, so the figures
depended on the order (192 MiB: DCP 0.36-0.39 s right after ckptfmt's save, 0.16 s first in a repetition;
safetensors, right after DCP's removed directory, at the disk's speed). Every save is durable: ckptfmt fsyncs its
files and directories; DCP's FileSystemWriter fsyncs its files (its default); ``safetensors.torch.save_file`` of the
flattened state and ``torch.save`` are each followed by an fsync of the file and its directory. Reported: the median
of ``--repeat`` and the per-repetition ratio's range, ratio = peer time / ckptfmt time (>1: ckptfmt faster).

Phases (unless ``--no-phases``, and when ``yappi`` is installed: ``pip install yappi``): one more ckptfmt save
under yappi's wall clock, every thread, with the time of each group of functions, summed over threads (threads
overlap, so the groups can exceed the save's wall time): state capture, hashing, ``write`` calls, ``fsync``,
context encoding, provenance, manifest and commit.
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
from ranks import fsync_path, settle, warm_page_cache  # bench/ is not a package

# yappi function-name fragments (module path or name) -> phase
PHASES: dict[str, tuple[str, ...]] = {
    "state capture (torch -> arrays)": ("ckptfmt/torch/", "ckptfmt/arrays.py"),
    "hashing (xxh3, blocks)": ("xxhash", "ckptfmt/blocks.py", "ckptfmt/digests.py", "ckptfmt/digest_checks.py"),
    "write calls": ("posix:write", "posix:pwrite", "posix:writev", "posix:pwritev", "ckptfmt/storage/direct.py"),
    "fsync": ("posix:fsync", "posix:fdatasync"),
    "context encoding (msgpack)": ("ckptfmt/context.py", "msgpack"),
    "provenance": ("ckptfmt/provenance.py", "subprocess"),
    "manifest + commit": ("ckptfmt/plan.py", "ckptfmt/canonical.py", "ckptfmt/commit.py", "ckptfmt/manifest"),
    "waiting (locks, queues: threads idle)": ("acquire", "SimpleQueue"),
}


def build(mib: int) -> tuple[Any, Any]:
    import torch

    width = 1024
    layers = max(1, (mib << 20) // (3 * 4 * width * width))  # weights + two AdamW moments, fp32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def methods(model: Any, optimizer: Any) -> dict[str, Callable[[Path], None]]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import ckptfmt.torch as ct

    config = {"layers": len(model), "width": 1024}
    sampler = ct.ResumableSampler(1000, seed=1)

    def ckptfmt_save(path: Path) -> None:
        ct.save(path, step=1, model=model, optimizer=optimizer, config=config, sampler=sampler)

    def dcp_save(path: Path) -> None:
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(path))

    def safetensors_save(path: Path) -> None:
        flat = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
        for param, state in optimizer.state_dict()["state"].items():
            flat.update({f"optim.{param}.{k}": v.contiguous() for k, v in state.items() if torch.is_tensor(v)})
        path.mkdir(parents=True)
        save_file(flat, str(path / "state.safetensors"))
        fsync_path(path / "state.safetensors")
        fsync_path(path)

    def torch_save(path: Path) -> None:
        path.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path / "state.pt")
        fsync_path(path / "state.pt")
        fsync_path(path)

    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3

    def disk(path: Path) -> None:
        """The floor: the same number of bytes from one page-aligned buffer with O_DIRECT, then fsync."""
        import mmap

        path.mkdir(parents=True)
        chunk = 32 << 20
        buffer = mmap.mmap(-1, chunk)
        buffer.write(bytes(range(256)) * (chunk // 256))
        fd = os.open(path / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            view, written = memoryview(buffer), 0
            while written < nbytes:
                written += os.write(fd, view[: min(chunk, -(-(nbytes - written) // 4096) * 4096)])
            os.fsync(fd)
        finally:
            os.close(fd)
            view.release()
            buffer.close()
        fsync_path(path)

    return {
        "ckptfmt": ckptfmt_save,
        "dcp": dcp_save,
        "safetensors": safetensors_save,
        "torch.save": torch_save,
        "disk (O_DIRECT + fsync, no format)": disk,
    }


def timed(fn: Callable[[Path], None], path: Path, nbytes: int) -> float:
    settle()
    # after the quiet, not before: the host may take back memory freed a second or two earlier (ranks.py)
    warm_page_cache(path.parent, nbytes + nbytes // 4)
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def phases(save: Callable[[Path], None], path: Path) -> dict[str, float] | None:
    """Thread-seconds per phase of one ckptfmt save, under yappi (None without it)."""
    try:
        import yappi  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    settle()
    yappi.set_clock_type("wall")
    yappi.start(builtins=True, profile_threads=True)
    start = time.perf_counter()
    save(path)
    wall = time.perf_counter() - start
    yappi.stop()
    totals = dict.fromkeys(PHASES, 0.0)
    for stat in yappi.get_func_stats():
        where = f"{stat.module}:{stat.name}"
        for phase, fragments in PHASES.items():
            if any(f in where for f in fragments):
                totals[phase] += stat.tsub  # own time: a phase's callees are counted in theirs
                break
    yappi.clear_stats()
    return {"wall (under the profiler)": wall, **totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under bench/out)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-phases", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(__file__).parent / "out"
    root.mkdir(parents=True, exist_ok=True)
    model, optimizer = build(args.mib)
    saves = methods(model, optimizer)
    names = list(saves)
    times: dict[str, list[float]] = {n: [] for n in names}
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    with tempfile.TemporaryDirectory(prefix="save-phases-", dir=root) as tmp:
        for i in range(args.repeat):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                path = Path(tmp) / f"{name}-{i}"
                times[name].append(timed(saves[name], path, nbytes))
                shutil.rmtree(path)
        split = None if args.no_phases else phases(saves["ckptfmt"], Path(tmp) / "profiled")
    print(f"{nbytes / (1 << 20):.0f} MiB of fp32 weights + AdamW moments, one process, durable saves, "
          f"median of {args.repeat}; ratio = peer time / ckptfmt time per repetition (>1: ckptfmt faster)")  # fmt: skip
    print()
    print("| method | median s | min-max s | MB/s | ratio median | ratio range |")
    print("| --- | --- | --- | --- | --- | --- |")
    ours = times["ckptfmt"]
    report: dict[str, Any] = {"bytes": nbytes, "repeat": args.repeat, "times": times, "ratios": {}}
    for name in names:
        t = times[name]
        ratios = [theirs / mine for theirs, mine in zip(t, ours, strict=True)]
        report["ratios"][name] = ratios
        print(
            f"| {name} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} | "
            f"{nbytes / statistics.median(t) / 1e6:.0f} | {statistics.median(ratios):.2f} | "
            f"{min(ratios):.2f}-{max(ratios):.2f} |"
        )
    if split is not None:
        report["phases"] = split
        print()
        print("| one ckptfmt save under yappi (wall clock, all threads) | seconds |")
        print("| --- | --- |")
        for phase, seconds in split.items():
            print(f"| {phase} | {seconds:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
