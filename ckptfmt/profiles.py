"""Profiles: which fields, of which kind, a checkpoint must hold (spec/fields.md)."""

from __future__ import annotations

from typing import Literal

Kind = Literal["tensors", "context"]

TRAINING: dict[str, Kind] = {
    "weights": "tensors",
    "optimizer": "tensors",
    "rng": "context",
    "data": "context",
    "config": "context",
    "topology": "context",
    "provenance": "context",
}
WEIGHTS: dict[str, Kind] = {"weights": "tensors", "provenance": "context"}

PROFILES: dict[str, dict[str, Kind]] = {"training": TRAINING, "weights": WEIGHTS}
