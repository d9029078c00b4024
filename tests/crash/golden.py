"""Golden checkpoints of each released format version (conformance/golden/<version>/), and what they hold.

Written once by the writer of the day, committed as files, and loaded by tests/test_golden.py for as
long as the reader claims to read that version. Beside each checkpoint ``<name>/`` lies
``<name>.expected.json``: its checkpoint id (the manifest's digest: the files were not rewritten),
profile, format version, and every tensor (dtype, shape, SHA-256 of its little-endian bytes) and
context (rendered exactly: floats as hex, arrays and bytes by digest).

    PYTHONPATH=tests .venv/bin/python -m crash.golden 1.0   # write conformance/golden/1.0 (refuses to overwrite)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ckptfmt
from ckptfmt.codecs import WriteCodec
from ckptfmt.codecs.zstd import ZstdOptions

GOLDEN = Path(__file__).resolve().parents[2] / "conformance" / "golden"
PROVENANCE = {
    "writer": {"name": "ckptfmt", "version": ckptfmt.__version__},
    "created_at": "2026-12-01T00:00:00Z",
    "host": "golden",
    "step": 40,
}


def render(value: object) -> object:
    """A JSON rendering that keeps every distinction a context can make (float bits, array dtype and bytes)."""
    if isinstance(value, Mapping):
        return {str(k): render(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [render(v) for v in value]
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
        return {"$ndarray": value.dtype.str, "shape": list(value.shape), "sha256": hashlib.sha256(data).hexdigest()}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, float):
        return {"$float": value.hex()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"cannot render {type(value).__name__}")


def expected_of(url: str) -> dict[str, Any]:
    """What a checkpoint holds, as recorded beside a golden one."""
    with ckptfmt.open(url) as ckpt:
        tensors = {}
        for fname, record in sorted(ckpt.fields.items()):
            for tname in sorted(record.tensors):
                array = ckpt.read_tensor(fname, tname)
                tensors[f"{fname}/{tname}"] = {
                    "dtype": record.tensors[tname].dtype,
                    "shape": list(array.shape),
                    "chunks": len(record.tensors[tname].chunks),
                    "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
                }
        contexts = {f: render(ckpt.read_context(f)) for f, r in sorted(ckpt.fields.items()) if r.context is not None}
        return {
            "checkpoint_id": ckpt.id,
            "format_version": ckpt.format_version,
            "profile": ckpt.profile,
            "metadata": dict(ckpt.manifest.metadata),
            "tensors": tensors,
            "contexts": contexts,
        }


def _training(url: str) -> None:
    """All seven fields; many dtypes over several data files; a tensor in three chunks; a scalar and an empty tensor."""
    rng = np.random.default_rng(2026)
    with ckptfmt.open_writer(url, profile="training", target_file_size=64, metadata={"golden": "training"}) as w:
        w.write_tensor("weights", "emb", rng.standard_normal((8, 4)).astype(np.float32))
        w.write_tensor("weights", "ln.w", rng.standard_normal(4).astype(ml_dtypes.bfloat16))
        w.write_tensor("weights", "ln.b", rng.standard_normal(4).astype(np.float16))
        w.write_tensor("weights", "head.q", rng.integers(-128, 127, (3, 5)).astype(np.int8))
        w.write_tensor("weights", "head.f8", rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn))
        w.write_tensor("weights", "mask", rng.integers(0, 2, 7).astype(np.bool_))
        w.write_tensor("weights", "empty", np.zeros((0, 3), np.float64))
        w.write_tensor("weights", "c", (rng.standard_normal(2) + 1j * rng.standard_normal(2)).astype(np.complex64))
        full = rng.standard_normal((6, 4)).astype(np.float32)
        for start in (0, 2, 4):
            w.write_tensor("optimizer", "emb.exp_avg", full[start : start + 2], global_shape=(6, 4), offsets=(start, 0))
        w.write_tensor("optimizer", "step", np.array(40, np.int64))
        w.write_tensor("optimizer", "u", rng.integers(0, 1 << 40, 3).astype(np.uint64))
        w.write_context("optimizer", {"param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "params": ["emb"]}]})
        w.write_context(
            "rng",
            {
                "generators": {
                    "numpy": {"kind": "numpy.bit_generator", "state": np.random.PCG64(7).state},
                    "python": {"kind": "python.random", "state": [3, [*range(624), 624], None]},
                }
            },
        )
        w.write_context("data", {"epoch": 3, "global_sample_offset": 1 << 40, "shard_offsets": {"s0": 5}})
        w.write_config({"model": {"layers": 2, "hidden": 4}, "lr": 3e-4, "tags": ["golden", "v1"], "seed": 7})
        w.write_context("topology", {"world_size": 2, "rank": 0, "mesh": {"dims": ["dp"], "shape": [2]}})
        w.write_context("provenance", {**PROVENANCE, "code": {"commit": "0" * 40, "dirty": False}})


def _weights(url: str) -> None:
    """The weights profile, written by rank 1, one tensor in chunks along two dimensions."""
    rng = np.random.default_rng(1)
    full = rng.standard_normal((4, 6)).astype(np.float64)
    with ckptfmt.open_writer(url, profile="weights", rank=1) as w:
        for r in (0, 2):
            for c in (0, 3):
                w.write_tensor("weights", "w", full[r : r + 2, c : c + 3], global_shape=(4, 6), offsets=(r, c))
        w.write_tensor("weights", "b", rng.integers(0, 1 << 15, 6).astype(np.uint16))
        w.write_context("provenance", PROVENANCE)


def _encoded(url: str) -> None:
    """Version 1.1: zstd chunks of several frames (byte-shuffled floats) beside a raw integer tensor."""
    rng = np.random.default_rng(11)
    with ckptfmt.open_writer(
        url, profile="weights", codec=WriteCodec(name="zstd", options=ZstdOptions(frame_bytes=4096))
    ) as w:
        w.write_tensor("weights", "big", rng.standard_normal((64, 48)).astype(np.float32))
        w.write_tensor("weights", "half", rng.standard_normal((40, 33)).astype(ml_dtypes.bfloat16))
        w.write_tensor("weights", "ints", np.arange(3000, dtype=np.int64).reshape(100, 30))
        w.write_context("provenance", PROVENANCE)


def _blocks(url: str) -> None:
    """Version 1.2: block digests of 4096 bytes on raw chunks, each chunk ending in a short block; a tensor in
    two chunks along dim 0; an integer tensor; a scalar too small for blocks."""
    rng = np.random.default_rng(12)
    with ckptfmt.open_writer(url, profile="weights", block_bytes=4096) as w:
        w.write_tensor("weights", "emb", rng.standard_normal((250, 200)).astype(np.float32))  # 49 blocks
        proj = rng.standard_normal((96, 100)).astype(np.float32)
        for start in (0, 48):  # 19200 bytes a chunk: 5 blocks each
            w.write_tensor("weights", "proj", proj[start : start + 48], global_shape=(96, 100), offsets=(start, 0))
        w.write_tensor("weights", "ids", rng.integers(-(1 << 40), 1 << 40, 1000).astype(np.int64))  # 2 blocks
        w.write_tensor("weights", "step", np.array(40, np.int64))
        w.write_context("provenance", PROVENANCE)


def _tree(url: str) -> None:
    """Version 1.3: tree digests (the default): a float tensor of several 64 KiB pieces ending in a short one, a
    tensor in two chunks, a chunk of one piece (a flat value under the tree name) and an integer tensor."""
    rng = np.random.default_rng(13)
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensor("weights", "emb", rng.standard_normal((300, 200)).astype(np.float32))  # 240,000 B: 4 pieces
        proj = rng.standard_normal((128, 160)).astype(np.float32)
        for start in (0, 64):  # 40,960 bytes a chunk: one piece each
            w.write_tensor("weights", "proj", proj[start : start + 64], global_shape=(128, 160), offsets=(start, 0))
        w.write_tensor("weights", "ids", rng.integers(-(1 << 40), 1 << 40, 20000).astype(np.int64))  # 3 pieces
        w.write_context("provenance", PROVENANCE)


def _delta_base(url: str) -> None:
    """Version 1.3: the base of ``delta`` (zstd keyframes, tree digests)."""
    rng = np.random.default_rng(14)
    with ckptfmt.open_writer(url, profile="weights", codec="zstd") as w:
        w.write_tensor("weights", "w", rng.standard_normal((256, 64)).astype(np.float32))
        w.write_tensor("weights", "h", rng.standard_normal((64, 40)).astype(ml_dtypes.bfloat16))
        w.write_context("provenance", PROVENANCE)


def _delta(url: str) -> None:
    """Version 1.3: xor-zstd chunks against ``delta-base`` (a sibling): the base's tensors nudged in their low
    mantissa bits, as one step of training moves them; a new tensor is a keyframe."""
    base = str(Path(url).parent / "delta-base")
    with ckptfmt.open(base) as ckpt:
        w0, h0 = ckpt.read_tensor("weights", "w"), ckpt.read_tensor("weights", "h")
    w1 = (w0.view(np.uint32) ^ np.uint32(0x3)).view(np.float32)
    h1 = (h0.view(np.uint16) ^ np.uint16(0x1)).view(ml_dtypes.bfloat16)
    with ckptfmt.open_writer(url, profile="weights", codec="xor-zstd", base=base) as w:
        w.write_tensor("weights", "w", w1)
        w.write_tensor("weights", "h", h1)
        w.write_tensor("weights", "new", np.linspace(0, 1, 4096, dtype=np.float32))
        w.write_context("provenance", PROVENANCE)


# What each released version's golden directory holds (a checkpoint a version's writer writes only then).
CHECKPOINTS = {
    "1.0": {"training": _training, "weights": _weights},
    "1.1": {"encoded": _encoded},
    "1.2": {"blocks": _blocks},
    "1.3": {"tree": _tree, "delta-base": _delta_base, "delta": _delta},  # delta after its base
}


def write_version(version: str) -> None:
    if version not in CHECKPOINTS:
        raise SystemExit(f"no golden checkpoints are defined for {version}")
    target = GOLDEN / version
    if target.exists():
        raise SystemExit(f"{target} exists: golden checkpoints are written once, never rewritten")
    target.mkdir(parents=True)
    for name, write in CHECKPOINTS[version].items():
        write(str(target / name))
        doc = expected_of(str(target / name))
        if doc["format_version"] != version:
            shutil.rmtree(target)
            raise SystemExit(f"{name} was written as {doc['format_version']}, not {version}")
        (target / f"{name}.expected.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_version(sys.argv[1])
