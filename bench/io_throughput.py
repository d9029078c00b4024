"""Write and read throughput of ckptfmt beside its peers, measured in the same run on the same tensors.

    python bench/io_throughput.py --size-mib 1024 [--dir /path] [--repeat 3] [--json out.json]

Peers: safetensors.numpy.save_file / load_file, torch.save / torch.load(weights_only=True),
torch.distributed.checkpoint save / load (single process). Each writes the same set of tensors
(a mix of F32 and BF16, 8-64 MiB each) to local disk. Reported: MB/s (median of --repeat runs) and
the ratio of ckptfmt to each peer (>1 means ckptfmt is faster).

Durability differs: ckptfmt fsyncs every file and the directory before committing; the peers do
not, so by default they are also timed with an explicit fsync of their files (`+fsync`) for a fair
comparison. Reads follow a drop of the page cache when the machine lets us (root), else they are
warm-cache reads, and the report says which.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ckptfmt

MiB = 1 << 20


def make_tensors(total_mib: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    sizes = [8, 16, 32, 64]
    used = 0
    i = 0
    while used < total_mib:
        mib = min(sizes[i % len(sizes)], total_mib - used)
        n = mib * MiB // 4
        arr = rng.standard_normal(n, dtype=np.float32)
        if i % 3 == 2:  # some bf16 tensors, as real models have
            arr = arr[: n * 2 // 2].astype(ml_dtypes.bfloat16)
            arr = np.concatenate([arr, arr])[: mib * MiB // 2]
        tensors[f"layers.{i}.weight"] = arr.reshape(-1, 1024) if arr.size % 1024 == 0 else arr
        used += mib
        i += 1
    return tensors


def fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def durable(save: Callable[[], object], path: Path) -> Callable[[], None]:
    """``save``, then an fsync of everything under ``path``: a peer's save made as durable as ckptfmt's."""

    def run() -> None:
        save()
        fsync_tree(path)

    return run


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def to_torch(tensors: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    import torch

    out = {}
    for name, arr in tensors.items():
        if arr.dtype == ml_dtypes.bfloat16:
            out[name] = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(arr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on /work's disk)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch peers")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="ckptfmt-bench-", dir=args.dir))
    tensors = make_tensors(args.size_mib)
    nbytes = sum(a.nbytes for a in tensors.values())
    ttensors = None if args.no_torch else to_torch(tensors)
    results: dict[str, dict[str, list[float]]] = {}
    cold = drop_caches()

    def settle() -> None:
        """Start every timed write and read from the same state: no dirty pages from the previous one
        competing for the disk, and a cold page cache when the machine lets us drop it."""
        os.sync()
        drop_caches()

    def timed(fn: Callable[[], object]) -> float:
        settle()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def record(name: str, op: str, seconds: float) -> None:
        results.setdefault(name, {}).setdefault(op, []).append(nbytes / seconds / 1e6)

    def fresh(name: str) -> Path:
        path = base / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    for _ in range(args.repeat):
        # ckptfmt
        path = fresh("ckptfmt")

        def ck_write() -> None:
            with ckptfmt.open_writer(path, profile="weights") as w:
                for name, arr in tensors.items():
                    w.write_tensor("weights", name, arr)

        record("ckptfmt", "write", timed(ck_write))

        def ck_read() -> None:
            with ckptfmt.open(path) as ckpt:
                for _name, _arr in ckpt.iter_tensors("weights"):
                    pass

        record("ckptfmt", "read", timed(ck_read))

        # safetensors
        from safetensors.numpy import load_file, save_file

        st = fresh("safetensors")
        st.mkdir()
        record("safetensors", "write", timed(lambda: save_file(tensors, str(st / "model.safetensors"))))
        fresh("safetensors_fsync").mkdir()
        sf = base / "safetensors_fsync" / "model.safetensors"
        record(
            "safetensors+fsync",
            "write",
            timed(durable(lambda: save_file(tensors, str(sf)), sf.parent)),
        )
        record("safetensors", "read", timed(lambda: load_file(str(st / "model.safetensors"))))

        if ttensors is not None:
            import torch
            import torch.distributed.checkpoint as dcp

            tp = fresh("torch")
            tp.mkdir()
            record("torch.save", "write", timed(lambda: torch.save(ttensors, tp / "model.pt")))
            record(
                "torch.save+fsync",
                "write",
                timed(durable(lambda: torch.save(ttensors, tp / "model2.pt"), tp)),
            )
            record("torch.save", "read", timed(lambda: torch.load(tp / "model.pt", weights_only=True)))

            dp = fresh("dcp")
            record("dcp", "write", timed(lambda: dcp.save(ttensors, checkpoint_id=str(dp))))
            target = {k: torch.empty_like(v) for k, v in ttensors.items()}
            record("dcp", "read", timed(lambda: dcp.load(target, checkpoint_id=str(dp))))

    shutil.rmtree(base, ignore_errors=True)
    summary = {name: {op: statistics.median(v) for op, v in ops.items()} for name, ops in results.items()}
    print(f"{nbytes / MiB:.0f} MiB of tensors, {args.repeat} runs, median MB/s; reads {'cold' if cold else 'warm'}")
    print(f"{'':24}{'write MB/s':>12}{'read MB/s':>12}{'ckptfmt/peer w':>16}{'ckptfmt/peer r':>16}")
    ours = summary["ckptfmt"]
    for name, ops in summary.items():
        w = ops.get("write")
        r = ops.get("read")
        rw = f"{ours['write'] / w:.2f}x" if w and name != "ckptfmt" else ""
        rr = f"{ours['read'] / r:.2f}x" if r and name != "ckptfmt" else ""
        print(
            f"{name:24}{w or 0:12.0f}{r or 0:12.0f}{rw:>16}{rr:>16}"
            if r
            else f"{name:24}{w or 0:12.0f}{'':>12}{rw:>16}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": nbytes, "cold_reads": cold, "median_mb_s": summary}, indent=2))


if __name__ == "__main__":
    main()
