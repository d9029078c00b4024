"""Writer inputs of the valid vectors: tensors as bytes, context values as tagged JSON (conformance/values.py).

Every value is a fixed function of its name, so that generating twice gives the same bytes.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np

from ckptfmt import dtypes
from ckptfmt.canonical import config_hash

from .values import to_context

PROVENANCE: dict[str, Any] = {
    "created_at": "2025-01-01T00:00:00Z",
    "host": "conformance",
    "writer": {"name": "ckptfmt-conformance", "version": "1"},
}


def pattern(nbytes: int, seed: int = 0) -> bytes:
    """Deterministic bytes that exercise every bit (NaN and subnormal patterns included)."""
    return bytes((i * 37 + seed * 101 + 11) % 256 for i in range(nbytes))


def tensor(dtype: str, shape: list[int], seed: int = 0, chunks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    count = 1
    for d in shape:
        count *= d
    raw = pattern(count * dtypes.itemsize(dtype), seed)
    if dtype == "BOOL":
        raw = bytes(b & 1 for b in raw)
    entry: dict[str, Any] = {
        "dtype": dtype,
        "shape": shape,
        "digest": "sha256:" + hashlib.sha256(raw).hexdigest(),
        "data": raw.hex(),
    }
    if chunks is not None:
        entry["chunks"] = chunks
    return entry


def f(value: float) -> dict[str, str]:
    """A tagged float, as the description writes it."""
    from ckptfmt.description import float_text

    return {"$float": float_text(value)}


def integer(value: int) -> object:
    """An int as the description writes it: plain inside the msgpack int range, else ``$bigint``."""
    return value if -(1 << 63) <= value < (1 << 64) else {"$bigint": str(value)}


def ndarray(array: np.ndarray[Any, Any]) -> dict[str, Any]:
    data = array.tobytes(order="C")
    return {
        "$ndarray": {
            "dtype": dtypes.from_numpy(array.dtype),
            "shape": list(array.shape),
            "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
            "data": data.hex(),
        }
    }


def config_blob(config: dict[str, Any]) -> dict[str, Any]:
    """A ``config`` context with its hash, ``config`` given as tagged JSON."""
    return {"config": config, "hash": config_hash(to_context(config))}


def document(
    profile: str, fields: dict[str, Any], metadata: dict[str, str] | None = None, **hints: Any
) -> dict[str, Any]:
    doc: dict[str, Any] = {"format_version": "1.0", "profile": profile, "metadata": metadata or {}, "fields": fields}
    if hints:
        doc["hints"] = hints
    return doc


def provenance(**extra: Any) -> dict[str, Any]:
    return {"kind": "context", "context": {**PROVENANCE, **extra}}


def weights_base() -> dict[str, Any]:
    """The base of most invalid vectors: one whole tensor, one in two chunks, one empty; a plain context field."""
    return document(
        "weights",
        {
            "weights": {
                "kind": "tensors",
                "tensors": {
                    "w": tensor("F32", [2, 3]),
                    "s": tensor(
                        "F32",
                        [4],
                        seed=1,
                        chunks=[{"rank": 0, "offsets": [0], "shape": [2]}, {"rank": 0, "offsets": [2], "shape": [2]}],
                    ),
                    "e": tensor("F32", [0, 3]),
                },
            },
            "notes": {"kind": "context", "context": {"text": "hello"}},
            "provenance": provenance(),
        },
    )


def training_base() -> dict[str, Any]:
    """The smallest training checkpoint: the base of the vectors about standard field content."""
    return document(
        "training",
        {
            "weights": {"kind": "tensors", "tensors": {"w": tensor("F32", [2, 3])}},
            "optimizer": {
                "kind": "tensors",
                "tensors": {"w.exp_avg": tensor("F32", [2, 3], seed=2)},
                "context": {"param_groups": [{"lr": f(0.001)}]},
            },
            "rng": {"kind": "context", "context": {"generators": {}}},
            "data": {"kind": "context", "context": {"epoch": 0, "global_sample_offset": 0}},
            "config": {"kind": "context", "context": config_blob({"lr": f(0.001), "seed": 0})},
            "topology": {"kind": "context", "context": {"world_size": 1}},
            "provenance": provenance(),
        },
    )


def rng_states() -> dict[str, Any]:
    """One generator of every kind 1.0 defines, plus one of a kind it does not (RNG-6)."""
    version, internal, gauss = random.Random(0).getstate()
    legacy = np.random.RandomState(0).get_state(legacy=True)
    assert isinstance(legacy, tuple)
    pcg = np.random.PCG64(0).state
    return {
        "generators": {
            "python": {"kind": "python.random", "state": [version, list(internal), gauss]},
            "numpy": {
                "kind": "numpy.random_state",
                "state": {
                    "algorithm": legacy[0],
                    "key": ndarray(np.asarray(legacy[1], dtype=np.uint32)),
                    "pos": int(legacy[2]),
                    "has_gauss": int(legacy[3]),
                    "cached_gaussian": f(float(legacy[4])),
                },
            },
            "pcg": {
                "kind": "numpy.bit_generator",
                "state": {
                    "bit_generator": pcg["bit_generator"],
                    "has_uint32": pcg["has_uint32"],
                    "uinteger": pcg["uinteger"],
                    "state": {"inc": integer(pcg["state"]["inc"]), "state": integer(pcg["state"]["state"])},
                },
            },
            "torch.cpu": {"kind": "torch.cpu", "state": ndarray(np.frombuffer(pattern(32), dtype=np.uint8))},
            "torch.cuda:0": {
                "kind": "torch.cuda",
                "device": 0,
                "state": ndarray(np.frombuffer(pattern(16, 1), dtype=np.uint8)),
            },
            "custom": {"kind": "org.example.rng", "state": {"counter": 7, "key": {"$bin": "00ff"}}, "extra": [1, 2]},
        }
    }
