"""Digests written as ``algorithm:hex`` (spec/digests.md): xxh3-128 and sha256 of all the bytes ("flat"), and
their tree forms ``xxh3-128-tree`` and ``sha256-tree`` (spec/tree-digests.md, format 1.3), derived from the digests
of 64 KiB pieces so that a writer or a verifier hashes each byte once. The default is ``xxh3-128-tree``."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Protocol

import xxhash

from .errors import UsageError

DEFAULT_ALGORITHM = "xxh3-128-tree"
FLAT_ALGORITHMS: dict[str, int] = {"xxh3-128": 32, "sha256": 64}  # name -> hex length
TREE_SUFFIX = "-tree"
ALGORITHMS: dict[str, int] = {**FLAT_ALGORITHMS, **{a + TREE_SUFFIX: n for a, n in FLAT_ALGORITHMS.items()}}
_HEX = re.compile(r"[0-9a-f]+")


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def is_tree(algorithm: str) -> bool:
    return algorithm.endswith(TREE_SUFFIX)


def base_algorithm(algorithm: str) -> str:
    """The flat algorithm a tree algorithm hashes its pieces and leaves with (itself for a flat one)."""
    return algorithm.removesuffix(TREE_SUFFIX)


def new_hasher(algorithm: str) -> Hasher:
    """A hasher of a flat algorithm (a file's digest under any algorithm: ``tree_digests.file_hasher``)."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise UsageError(f"unknown digest algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def hex_digest_function(algorithm: str) -> Callable[[bytes | memoryview], str]:
    """The hex digits of a flat algorithm's digest of some bytes, in one call (no hasher object)."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128_hexdigest
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).hexdigest()
    raise UsageError(f"no flat digest algorithm {algorithm!r}")


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
