"""Where the reference writer puts things inside a checkpoint root (spec/layout.md)."""

from __future__ import annotations

DATA_SUFFIX = ".safetensors"
CONTEXT_NAME = "context.msgpack"


def data_path(field: str, rank: int, seq: int) -> str:
    """``<field>/r<rank>-<seq>.safetensors``: ranks never collide, and names sort in write order."""
    return f"{field}/r{rank:05d}-{seq:05d}{DATA_SUFFIX}"


def context_path(field: str) -> str:
    return f"{field}/{CONTEXT_NAME}"
