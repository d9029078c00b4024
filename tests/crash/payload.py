"""What the harnesses write, and the one oracle they judge every outcome by.

A payload is a deterministic training checkpoint of several tensors spread over several data files
(a small ``target_file_size``), one tensor written as two chunks, and every standard context field.
After a crash or a fault, :func:`judge` says what a reader sees at the URL: ``refused`` (a library
error: not found, incomplete), ``whole`` (opens, verifies, holds exactly the payload) or ``wrong``
(anything else, the one outcome that must never happen).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

import ckptfmt

TARGET_FILE_SIZE = 1024  # small: each field's tensors spread over several data files
Outcome = Literal["refused", "whole", "wrong"]


def tensors(seed: int) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(seed)
    return {
        "weights": {
            "emb": rng.standard_normal((16, 8)).astype(np.float32),  # 512 B
            "layer0.w": rng.standard_normal((8, 24)).astype(np.float32),  # 768 B
            "layer0.b": rng.standard_normal(24).astype(np.float32),
            "layer1.w": rng.integers(-100, 100, (12, 12)).astype(np.int16),
            "head": rng.standard_normal((8, 20)).astype(np.float64),  # 1280 B: a file of its own
        },
        "optimizer": {
            "emb.exp_avg": rng.standard_normal((16, 8)).astype(np.float32),  # written as two chunks
            "step": np.array(seed + 7, dtype=np.int64),
        },
    }


def contexts(seed: int) -> dict[str, dict[str, object]]:
    return {
        "optimizer": {"param_groups": [{"lr": 0.001, "params": ["emb", "layer0.w"]}]},
        "rng": {"generators": {"numpy": {"kind": "numpy.bit_generator", "state": {"bit_generator": "PCG64"}}}},
        "data": {"epoch": 1, "global_sample_offset": 4096 + seed},
        "topology": {"world_size": 1, "rank": 0},
        "provenance": {
            "writer": {"name": "ckptfmt-crash", "version": "1"},
            "created_at": "2026-01-02T03:04:05Z",
            "host": "crash-host",
            "step": seed,
        },
    }


def config(seed: int) -> dict[str, object]:
    return {"model": {"layers": 2, "hidden": 8}, "lr": 0.001, "seed": seed}


def write_into(w: ckptfmt.CheckpointWriter, seed: int) -> None:
    """Write the payload of ``seed`` into an open writer, without committing."""
    arrays = tensors(seed)
    for name, array in arrays["weights"].items():
        w.write_tensor("weights", name, array)
    exp_avg = arrays["optimizer"]["emb.exp_avg"]
    for start in (0, 8):
        w.write_tensor("optimizer", "emb.exp_avg", exp_avg[start : start + 8], global_shape=(16, 8), offsets=(start, 0))
    w.write_tensor("optimizer", "step", arrays["optimizer"]["step"])
    for field, value in contexts(seed).items():
        w.write_context(field, value)
    w.write_config(config(seed))


def write(url: str, seed: int, *, storage_options: Mapping[str, Any] | None = None, **options: Any) -> str:
    """Write and commit the payload; returns the checkpoint id."""
    options.setdefault("target_file_size", TARGET_FILE_SIZE)
    with ckptfmt.open_writer(url, profile="training", storage_options=storage_options, **options) as w:
        write_into(w, seed)
    assert w.checkpoint_id is not None
    return w.checkpoint_id


def _same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _same_value(x: object, y: object) -> bool:
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_value(i, j) for i, j in zip(x, y, strict=True))
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


@dataclass(frozen=True, slots=True)
class Judgement:
    outcome: Outcome
    detail: str  # the refusal's error code, or what was wrong


def holds_payload(ckpt: ckptfmt.Checkpoint, seed: int) -> str | None:
    """None when ``ckpt`` verifies and holds exactly the payload of ``seed``; else what differs."""
    report = ckpt.verify()
    if not report.ok:
        return f"verify: {report.problems[0]}"
    expected = tensors(seed)
    if set(ckpt.fields) != {"weights", "optimizer", "rng", "data", "config", "topology", "provenance"}:
        return f"fields {sorted(ckpt.fields)}"
    for field, arrays in expected.items():
        if set(ckpt.tensor_names(field)) != set(arrays):
            return f"tensors of {field}: {sorted(ckpt.tensor_names(field))}"
        for name, array in arrays.items():
            if not _same_bits(ckpt.read_tensor(field, name), array):
                return f"tensor {field}/{name} differs"
    for field, value in contexts(seed).items():
        if not _same_value(ckpt.read_context(field), value):
            return f"context {field} differs"
    if not _same_value(ckpt.read_context("config").get("config"), config(seed)):
        return "config differs"
    return None


def judge(url: str, seed: int, *, storage_options: Mapping[str, Any] | None = None) -> Judgement:
    """What a reader sees at ``url`` after a crash or fault, against the payload of ``seed``.

    Any exception other than a library error is ``wrong`` too: only ckptfmt's errors may escape.
    """
    try:
        ckpt = ckptfmt.open(url, storage_options)
    except ckptfmt.CheckpointError as exc:
        return Judgement("refused", exc.code)
    except Exception as exc:
        return Judgement("wrong", f"open raised {type(exc).__name__}: {exc}")
    try:
        with ckpt:
            problem = holds_payload(ckpt, seed)
    except ckptfmt.CheckpointError as exc:
        return Judgement("wrong", f"opened, then {exc.code}: {exc}")
    except Exception as exc:
        return Judgement("wrong", f"opened, then {type(exc).__name__}: {exc}")
    return Judgement("wrong", problem) if problem else Judgement("whole", "")
