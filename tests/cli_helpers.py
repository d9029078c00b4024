"""Helpers for the CLI and converter tests: running ``ckpt`` both ways, building and tampering with checkpoints.

Imported by path (pytest's importlib mode keeps tests/ off sys.path): each test module inserts
its own directory first. conftest.py belongs to the core suite; these helpers do not depend on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from ckptfmt.cli import cli
from click.testing import CliRunner

import ckptfmt

CKPT = Path(sys.executable).parent / "ckpt"
PROVENANCE = {"writer": {"name": "tests", "version": "1"}, "created_at": "2026-01-02T03:04:05Z", "step": 100}


@dataclass(frozen=True)
class Run:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def run_cli(*args: str) -> Run:
    """``ckpt ARGS`` in-process through click's CliRunner (stdout and stderr kept apart)."""
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return Run(result.exit_code, result.stdout, result.stderr)


def run_ckpt(*args: str, cwd: str | os.PathLike[str] | None = None) -> Run:
    """``ckpt ARGS`` as a real subprocess of the installed console script."""
    proc = subprocess.run([str(CKPT), *args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False)
    return Run(proc.returncode, proc.stdout, proc.stderr)


RUNNERS: dict[str, Callable[..., Run]] = {"clirunner": run_cli, "subprocess": run_ckpt}


def training_arrays(seed: int = 0) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(seed)
    return {
        "weights": {
            "layer0.w": rng.standard_normal((6, 4)).astype(np.float32),
            "layer0.b": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
            "count": np.array(seed, dtype=np.int64),
        },
        "optimizer": {"layer0.w.exp_avg": rng.standard_normal((6, 4)).astype(np.float32)},
    }


def write_training(url: str, *, seed: int = 0, step: int = 100, **options: Any) -> str:
    """A complete training checkpoint; the optimizer tensor is stored as two chunks (rows 0-2, 3-5)."""
    arrays = training_arrays(seed)
    with ckptfmt.open_writer(url, profile="training", **options) as w:
        w.write_tensors("weights", arrays["weights"])
        exp_avg = arrays["optimizer"]["layer0.w.exp_avg"]
        for start in (0, 3):
            w.write_tensor(
                "optimizer", "layer0.w.exp_avg", exp_avg[start : start + 3], global_shape=(6, 4), offsets=(start, 0)
            )
        w.write_context("optimizer", {"param_groups": [{"lr": 0.001, "params": ["layer0.w"]}]})
        w.write_context(
            "rng", {"generators": {"np": {"kind": "numpy.bit_generator", "state": np.random.PCG64(seed).state}}}
        )
        w.write_context("data", {"epoch": 1, "global_sample_offset": 4096})
        w.write_config({"model": {"layers": 1}, "lr": 0.001, "seed": seed})
        w.write_context("topology", {"world_size": 1, "mesh": {"dims": ["dp"], "shape": [1]}})
        w.write_context("provenance", {**PROVENANCE, "step": step, "code": {"commit": "abc123"}})
    assert w.checkpoint_id is not None
    return w.checkpoint_id


def manifest_doc(url: str) -> dict[str, Any]:
    return json.loads(Path(url, "manifest.json").read_bytes())  # type: ignore[no-any-return]


def edit_manifest(url: str, edit: Callable[[dict[str, Any]], object]) -> None:
    """Rewrite manifest.json after ``edit`` mutates it. Nothing is recomputed: readers must refuse."""
    doc = manifest_doc(url)
    edit(doc)
    Path(url, "manifest.json").write_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def data_file(url: str, field: str) -> Path:
    doc = manifest_doc(url)
    paths = sorted({c["path"] for t in doc["fields"][field]["tensors"].values() for c in t["chunks"]})
    return Path(url, paths[0])


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def bits(array: Any) -> bytes:
    """The bytes of a numpy array or a torch tensor, so comparisons are bit for bit (NaN, -0.0, bf16)."""
    if type(array).__module__.startswith("torch"):
        import torch

        flat = array.detach().contiguous().reshape(-1)
        return bytes(flat.view(torch.uint8).numpy().tobytes())
    return bytes(np.ascontiguousarray(array).tobytes())


def torch_dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("torch.")


def assert_same_tensor(actual: Any, expected: Any) -> None:
    """Same shape and same bytes (and, for two torch tensors or two numpy arrays, same dtype)."""
    assert tuple(actual.shape) == tuple(expected.shape)
    if type(actual).__module__.split(".")[0] == type(expected).__module__.split(".")[0]:
        assert actual.dtype == expected.dtype
    assert bits(actual) == bits(expected)


NUMPY_OF_TORCH = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def assert_ckpt_tensor(ckpt: ckptfmt.Checkpoint, field: str, name: str, expected: Any) -> None:
    """A ckptfmt tensor equals a torch tensor: shape, dtype (by name) and bytes."""
    actual = ckpt.read_tensor(field, name)
    from ckptfmt.convert.torch_bridge import TORCH_DTYPES

    assert TORCH_DTYPES[ckpt.tensor(field, name).dtype] == torch_dtype_name(expected), name
    assert tuple(actual.shape) == tuple(expected.shape), name
    assert bits(actual) == bits(expected), name


def keys_of(doc: dict[str, Any], expected: Sequence[str]) -> None:
    missing = set(expected) - set(doc)
    assert not missing, f"missing keys {missing} in {sorted(doc)}"
