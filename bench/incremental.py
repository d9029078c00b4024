"""Incremental checkpoints on a LoRA-style run: a frozen base model and small trained adapters, saved every step.

    python bench/incremental.py [--size-mib 256] [--saves 20] [--json OUT] [--dir DIR]

The model: ``--size-mib`` of frozen fp32 base weights (Linear layers of 2048x2048) with rank-16 LoRA adapters
trained by AdamW. Each configuration trains one step and saves, ``--saves`` times, on the same model state:

- ``ckptfmt full``: ``CheckpointManager`` (durable: fsync'd) writing every checkpoint in full;
- ``ckptfmt incremental``: ``CheckpointManager(incremental=True)``: chunks whose bytes equal the previous
  checkpoint's are referenced (hashed, not written);
- ``ckptfmt incremental, frozen``: the same, the base declared ``frozen=`` (referenced without hashing);
- peers in the same run, each followed by an fsync of what it wrote: ``torch.save`` of the model's and
  optimizer's state dicts, and ``torch.distributed.checkpoint.save`` of the same.

Reported per configuration: the median save time (the first save, full for every configuration, excluded),
bytes written per save (median, first excluded), the run directory's size after all saves, and the peer's time
over this one's (>1: faster than the peer). Every save's directory is kept, so the sizes are what a run
directory holds; nothing outside ``--dir`` (default: a temp dir under bench/out) is written.
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
from pathlib import Path
from typing import Any

WIDTH, RANK = 2048, 16


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def build(size_mib: int) -> tuple[Any, Any, list[str]]:
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(WIDTH, WIDTH, bias=False)
            self.base.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(RANK, WIDTH) * 0.01)
            self.lora_b = nn.Parameter(torch.zeros(WIDTH, RANK))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.lora_a.T @ self.lora_b.T  # type: ignore[no-any-return]

    torch.manual_seed(0)
    layers = max(1, (size_mib << 20) // (4 * WIDTH * WIDTH))
    model = nn.Sequential(*[LoRALinear() for _ in range(layers)])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return model, optimizer, frozen


def train_step(model: Any, optimizer: Any, step: int) -> None:
    import torch

    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run(config: str, out: Path, saves: int, size_mib: int) -> dict[str, Any]:
    import torch

    from ckptfmt.torch import CheckpointManager, ResumableSampler

    model, optimizer, frozen = build(size_mib)
    sampler = ResumableSampler(1 << 20, seed=0)
    run_dir = out / config.replace(" ", "-").replace(",", "")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    manager = None
    if config.startswith("ckptfmt"):
        manager = CheckpointManager(
            run_dir,
            keep_last=None,
            incremental="incremental" in config,
            full_every=saves + 1,
            frozen=frozen if "frozen" in config else (),
        )
    seconds, written = [], []
    for step in range(1, saves + 1):
        train_step(model, optimizer, step)
        sampler.advance(8)
        before = dir_bytes(run_dir)
        start = time.perf_counter()
        if manager is not None:
            manager.save(step, model=model, optimizer=optimizer, config={"lr": 1e-3}, sampler=sampler)
        elif config == "torch.save":
            path = run_dir / f"step-{step}.pt"
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)
            fsync_tree(path)
        else:
            import torch.distributed.checkpoint as dcp

            target = run_dir / f"step-{step}"
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(target))
            fsync_tree(target)
        seconds.append(time.perf_counter() - start)
        written.append(dir_bytes(run_dir) - before)
    if manager is not None:
        manager.close()
    return {
        "config": config,
        "save_s": statistics.median(seconds[1:]) if saves > 1 else seconds[0],
        "first_save_s": seconds[0],
        "bytes_per_save": int(statistics.median(written[1:])) if saves > 1 else written[0],
        "first_save_bytes": written[0],
        "run_dir_bytes": dir_bytes(run_dir),
        "saves": saves,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="frozen base weights, MiB (default 256)")
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    out_root = Path(__file__).parent / "out"
    out_root.mkdir(exist_ok=True)  # absent in a fresh clone (ignored by git)
    base = args.dir or Path(tempfile.mkdtemp(prefix="incremental-", dir=out_root))
    configs = ["ckptfmt full", "ckptfmt incremental", "ckptfmt incremental, frozen", "torch.save", "dcp.save"]
    rows = []
    try:
        for config in configs:
            rows.append(run(config, base, args.saves, args.size_mib))
            print(f"done: {config}", file=sys.stderr)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    peer = {r["config"]: r for r in rows}
    print(f"\nLoRA-style run: {args.size_mib} MiB frozen fp32 base + rank-{RANK} adapters (AdamW), one save per step")
    print(f"median of saves 2..{args.saves} (the first is full everywhere); ratios: the peer's time / this one's\n")
    print("| save | s per save | MB written per save | run dir after all saves (MB) | torch.save / this | DCP / this |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mb = r["bytes_per_save"] / 1e6
        total = r["run_dir_bytes"] / 1e6
        vs_pt = peer["torch.save"]["save_s"] / r["save_s"]
        vs_dcp = peer["dcp.save"]["save_s"] / r["save_s"]
        print(f"| {r['config']} | {r['save_s']:.3f} | {mb:.2f} | {total:.1f} | {vs_pt:.2f} | {vs_dcp:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
