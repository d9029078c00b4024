"""Digests written as ``algorithm:hex`` (spec/digests.md): xxh3-128 by default, sha256 on request."""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import xxhash

from .errors import UsageError

DEFAULT_ALGORITHM = "xxh3-128"
ALGORITHMS: dict[str, int] = {"xxh3-128": 32, "sha256": 64}  # name -> hex length
_HEX = re.compile(r"[0-9a-f]+")


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise UsageError(f"unknown digest algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def digest_of(algorithm: str, data: bytes | memoryview) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return format_digest(algorithm, hasher)


def parse_digest(value: object) -> tuple[str, str] | None:
    """(algorithm, hex) if ``value`` is a well-formed digest string of a known algorithm, else None."""
    if not isinstance(value, str) or ":" not in value:
        return None
    algorithm, _, hexpart = value.partition(":")
    length = ALGORITHMS.get(algorithm)
    if length is None or len(hexpart) != length or _HEX.fullmatch(hexpart) is None:
        return None
    return algorithm, hexpart


def algorithm_of(digest: str) -> str:
    """The algorithm part of an ``algorithm:hex`` digest string."""
    return digest.partition(":")[0]


def format_digest(algorithm: str, hasher: Hasher) -> str:
    """The ``algorithm:hex`` string of a finished hasher: the one place digest strings are made."""
    return f"{algorithm}:{hasher.hexdigest()}"
