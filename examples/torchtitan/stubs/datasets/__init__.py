"""The part of Hugging Face ``datasets`` torchtitan's text dataloader uses, over a local JSON-lines file
(``DIR/data.json``): enough for the debug config offline, without ``datasets`` and its dependencies."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any


class Dataset:
    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        self._rows = list(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._rows)

    def skip(self, n: int) -> Dataset:
        return Dataset(self._rows[n:])

    def shuffle(self, seed: int = 0) -> Dataset:
        rows = list(self._rows)
        random.Random(seed).shuffle(rows)
        return Dataset(rows)


def load_dataset(path: str, split: str = "train", **kwargs: Any) -> Dataset:
    with open(os.path.join(path, "data.json")) as f:
        return Dataset(json.loads(line) for line in f if line.strip())
