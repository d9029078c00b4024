"""CPU-seconds per GiB of a save, a memory snapshot and a verify, against one xxh3 pass and one copy of the same
bytes: how many passes over each byte each one costs (issue 44's "one pass per byte", before and after).

    python bench/cpu_per_gib.py [--mib 1024] [--repeat 3] [--dir DIR] [--json FILE] [--digest ALGORITHM]

One process, fp32 tensors of ``--mib`` MiB in all (16 tensors), on the local disk under ``--dir`` (default: a
temporary directory under bench/out) and the memory tier in /dev/shm. CPU time is the process's (every thread:
``time.process_time``), and its user time alone (``getrusage``: hashes and copies, without the kernel's I/O), the
median of ``--repeat``; the floors are measured in the same run on the same bytes:

- ``xxh3``: one xxh3-128 pass over every byte (the digest ckptfmt writes), one thread;
- ``copy``: one copy of every byte into memory that exists (what a snapshot's host copy is);
- ``hashes``: the save's streaming pass over one data file of the tensors with every digest it computes (file,
  chunk, 64 KiB blocks; under a tree digest the pieces alone), into a store that keeps nothing: a save's hashing;
- ``save``: ``ckptfmt.open_writer`` of the tensors, committed (O_DIRECT writes, block digests, the file digests);
- ``snapshot``: ``CheckpointManager`` with the memory tier, one snapshot, waited for (copy, digests, slot write);
- ``verify``: ``ckptfmt.verify`` of the saved checkpoint, its files in the page cache (the hashing alone).

``--digest``: the digest algorithm of every write, the save's and the snapshot's (default: the library's,
``xxh3-128-tree`` since format 1.3; ``xxh3-128`` writes the flat digests of 1.2, which hash each byte twice or three
times: before and after issue 44 in one run).

Each row also reads as "xxh3 passes": its CPU time over the xxh3 floor's. Figures depend on the machine; they go to
docs/benchmarks.md with the command and commit.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import ckptfmt
from ckptfmt.arrays import byte_view
from ckptfmt.blocks import DEFAULT_BLOCK_BYTES
from ckptfmt.digests import DEFAULT_ALGORITHM
from ckptfmt.safetensors_io import build_header
from ckptfmt.torch import CheckpointManager, MemoryOptions, ResumableSampler
from ckptfmt.write_executor import stream_file

TENSORS = 16


def cpu_seconds(
    work: Callable[[], object], repeat: int, before: Callable[[], None] | None = None
) -> tuple[float, float]:
    """The median process CPU time of ``work`` (every thread of this process), user and system together, and its
    median user time alone (hashing and copies in the process; the system time is the kernel's I/O), ``before``
    run untimed first."""
    times, user = [], []
    for _ in range(repeat):
        if before is not None:
            before()
        started, started_user = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
        work()
        times.append(max(0.0, time.process_time() - started))
        user.append(max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_utime - started_user))
    return statistics.median(times), statistics.median(user)


class _Discard:
    """A store that keeps nothing: what is left of a save is its digests (the writer's streaming pass)."""

    def create(self, path: str) -> _Discard:
        return self

    def write(self, data: memoryview) -> None:
        pass

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


def save_hashes(arrays: dict[str, np.ndarray[Any, Any]], digest: str | None) -> None:
    """The writer's streaming pass over one data file of ``arrays`` with every digest the save computes (file,
    chunk, 64 KiB blocks), into a store that discards the bytes: the hashing of a save, without its I/O."""
    header, _ = build_header([(name, "F32", a.shape, a.nbytes) for name, a in arrays.items()])
    parts = [memoryview(header), *(byte_view(a) for a in arrays.values())]
    stream_file(
        _Discard(),  # type: ignore[arg-type]
        "data.safetensors",
        parts,
        chunk_parts=len(arrays),
        algorithm=digest or DEFAULT_ALGORITHM,
        block_sizes=[DEFAULT_BLOCK_BYTES] * len(arrays),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--digest", default=None, help="the writers' digest algorithm (default: the library's)")
    args = p.parse_args()
    if args.digest is not None:  # every writer, the snapshot's included, takes its default from here
        defaults = ckptfmt.CheckpointWriter.__init__.__kwdefaults__
        assert defaults is not None
        defaults["digest"] = args.digest
    chosen = {} if args.digest is None else {"digest": args.digest}
    base = args.dir or Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cpu-per-gib-", dir=base))
    memory = Path(tempfile.mkdtemp(prefix="cpu-per-gib-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    rng = np.random.default_rng(0)
    n = args.mib * 2**20 // 4 // TENSORS
    arrays = {f"t{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(TENSORS)}
    gib = sum(a.nbytes for a in arrays.values()) / 2**30
    into = {k: np.empty_like(a) for k, a in arrays.items()}
    try:
        figures: dict[str, tuple[float, float]] = {}
        figures["xxh3"] = cpu_seconds(lambda: [xxhash.xxh3_128(a).digest() for a in arrays.values()], args.repeat)

        def copy() -> None:
            for name, array in arrays.items():
                np.copyto(into[name], array)

        figures["copy"] = cpu_seconds(copy, args.repeat)

        saved = work / "ckpt"

        def save() -> None:
            with ckptfmt.open_writer(str(saved), profile="weights", **chosen) as w:
                for name, array in arrays.items():
                    w.write_tensor("weights", name, array)
                w.write_context("provenance", {"bench": "cpu_per_gib"})

        figures["save"] = cpu_seconds(save, args.repeat, before=lambda: shutil.rmtree(saved, ignore_errors=True))
        figures["hashes"] = cpu_seconds(lambda: save_hashes(arrays, chosen.get("digest")), args.repeat)
        ckptfmt.verify(str(saved))  # its files now in the page cache: the verify below is hashing, not the disk
        figures["verify"] = cpu_seconds(lambda: ckptfmt.verify(str(saved)), args.repeat)

        model = torch.nn.Module()
        for name, array in arrays.items():
            model.register_parameter(name, torch.nn.Parameter(torch.from_numpy(array)))
        mgr = CheckpointManager(
            work / "run", memory=MemoryOptions(every=1, memory_dir=memory), preemption_signals=(), keep_last=None
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: the snapshot is the weights
        sampler = ResumableSampler(10**6, seed=0)
        step = [0]

        def snapshot() -> None:
            step[0] += 1
            mgr.checkpoint_if_due(step[0], model=model, optimizer=optimizer, sampler=sampler, config={}, every=10**9)
            mgr.wait_memory()

        snapshot()  # the first one checks the memory directory's capacity: not what is measured
        figures["snapshot"] = cpu_seconds(snapshot, args.repeat)
        mgr.close(persist=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    floor = figures["xxh3"][0]
    digest = args.digest or ckptfmt.CheckpointWriter.__init__.__kwdefaults__["digest"]  # type: ignore[index]
    print(
        f"{gib:.2f} GiB of fp32 tensors, {TENSORS} tensors, {digest} digests; CPU seconds per GiB (every thread), "
        f"median of {args.repeat}"
    )
    print()
    print("| work | CPU s / GiB | user s / GiB | xxh3 passes |")
    print("| --- | --- | --- | --- |")
    for name in ("xxh3", "copy", "hashes", "save", "snapshot", "verify"):
        cpu, user = figures[name]
        print(f"| {name} | {cpu / gib:.3f} | {user / gib:.3f} | {cpu / floor:.2f} |")
    if args.json:
        report: dict[str, Any] = {
            "gib": gib,
            "digest": digest,
            "cpu_s_per_gib": {k: v[0] / gib for k, v in figures.items()},
            "user_s_per_gib": {k: v[1] / gib for k, v in figures.items()},
        }
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
