"""Write, inspect, verify and reload a realistic training checkpoint on local disk.

    python examples/demo.py [OUT_DIR]

A small GPT-style model's weights (bf16) with fp32 master copies and AdamW moments, the embedding
sharded over four simulated ranks, Python and numpy RNG states, the data position, config,
topology and provenance: the seven fields, written together. Then ``ckpt inspect`` and
``ckpt verify`` on it, a bit-for-bit reload, and a flipped byte that verify catches.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ckptfmt
from ckptfmt import rng

CONFIG = {"model": {"d_model": 256, "n_layers": 4, "n_heads": 8, "vocab": 8192}, "lr": 3e-4, "seed": 1234}


def build_state(seed: int) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, np.ndarray[Any, Any]]]:
    gen = np.random.default_rng(seed)
    d, vocab = CONFIG["model"]["d_model"], CONFIG["model"]["vocab"]  # type: ignore[index]
    weights: dict[str, np.ndarray[Any, Any]] = {"embed.weight": gen.standard_normal((vocab, d), dtype=np.float32)}
    for layer in range(CONFIG["model"]["n_layers"]):  # type: ignore[index]
        p = f"blocks.{layer}."
        weights[p + "attn.qkv.weight"] = gen.standard_normal((3 * d, d), dtype=np.float32) * 0.02
        weights[p + "attn.out.weight"] = gen.standard_normal((d, d), dtype=np.float32) * 0.02
        weights[p + "mlp.up.weight"] = gen.standard_normal((4 * d, d), dtype=np.float32) * 0.02
        weights[p + "mlp.down.weight"] = gen.standard_normal((d, 4 * d), dtype=np.float32) * 0.02
        weights[p + "ln.weight"] = np.ones(d, dtype=np.float32)
    optimizer: dict[str, np.ndarray[Any, Any]] = {}
    for name, w in weights.items():
        optimizer[f"state.{name}.exp_avg"] = (w * 0.1).astype(np.float32)
        optimizer[f"state.{name}.exp_avg_sq"] = (w * w * 0.01).astype(np.float32)
        optimizer[f"state.{name}.step"] = np.array(100.0, dtype=np.float32)
    return weights, optimizer


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out")
    shutil.rmtree(out, ignore_errors=True)
    url = out / "run" / "step-000100"
    random.seed(CONFIG["seed"])  # type: ignore[arg-type]
    np.random.seed(1)
    data_rng = np.random.default_rng(7)
    weights, optimizer = build_state(0)
    world = 4
    rows = CONFIG["model"]["vocab"] // world  # type: ignore[index, operator]

    print(f"== writing a training checkpoint to {url}")
    with ckptfmt.open_writer(url, profile="training", target_file_size=8 << 20) as w:
        for name, array in weights.items():
            if name == "embed.weight":  # sharded over 4 ranks, as a tensor-parallel run writes it
                for rank in range(world):
                    part = array[rank * rows : (rank + 1) * rows]
                    w.write_tensor("weights", name, part, global_shape=array.shape, offsets=(rank * rows, 0))
            else:
                w.write_tensor("weights", name, array.astype(ml_dtypes.bfloat16))
        w.write_tensors("optimizer", optimizer)
        w.write_context(
            "optimizer", {"param_groups": [{"lr": CONFIG["lr"], "betas": [0.9, 0.95], "weight_decay": 0.1}]}
        )
        w.write_context("rng", rng.capture_default({"data": data_rng}))
        w.write_context(
            "data",
            {
                "epoch": 0,
                "global_sample_offset": 100 * 32,
                "dataset": {"name": "synthetic-lm", "version": "1", "digest": "sha256:" + "0" * 64},
                "sampler": {"seed": 1234, "shuffle": True},
                "quarantined_shards": [],
            },
        )
        w.write_config(CONFIG)
        w.write_context("topology", {"world_size": world, "mesh": {"dims": ["tp"], "shape": [world]}})
        w.write_context("provenance", {"step": 100, "code": {"commit": "0" * 40, "dirty": False}})
    expected_draw = data_rng.random()

    def ckpt(*args: str) -> int:
        print(f"\n== ckpt {' '.join(args)}")
        # the installed entry point: `python -m ckptfmt` from a checkout would import the source tree,
        # where cli/ is not mapped to ckptfmt.cli
        return subprocess.call([str(Path(sys.executable).with_name("ckpt")), *args])

    ckpt("inspect", str(url))
    if ckpt("verify", str(url)) != 0:
        print("verify failed on a fresh checkpoint", file=sys.stderr)
        return 1

    print("\n== reloading every tensor and the RNG, bit for bit")
    with ckptfmt.open(url) as c:
        for name, array in weights.items():
            got = c.read_tensor("weights", name)
            want = array if name == "embed.weight" else array.astype(ml_dtypes.bfloat16)
            assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
        for name, array in optimizer.items():
            assert np.array_equal(c.read_tensor("optimizer", name), array), name
        fresh = np.random.default_rng()
        rng.restore_numpy_generator(c.read_context("rng")["generators"]["data"], fresh)  # type: ignore[index]
        assert fresh.random() == expected_draw
        print(f"   {len(weights)} weights, {len(optimizer)} optimizer tensors and the data RNG restored exactly")
        print(f"   checkpoint id {c.id}")

    print("\n== flipping one byte in a copy; verify must catch it")
    bad = out / "corrupted"
    shutil.copytree(url, bad)
    victim = next((bad / "weights").glob("*.safetensors"))
    blob = bytearray(victim.read_bytes())
    blob[-100] ^= 0x01
    victim.write_bytes(bytes(blob))
    if ckpt("verify", str(bad)) != 1:
        print("verify did not catch the corruption", file=sys.stderr)
        return 1
    print("\ndemo finished: written, inspected, verified, reloaded bit for bit, corruption caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
