"""Where the reference writer puts things inside a checkpoint root (spec/layout.md)."""

from __future__ import annotations

DATA_SUFFIX = ".safetensors"
CONTEXT_NAME = "context.msgpack"


def data_path(field: str, rank: int, seq: int) -> str:
    """``<field>/r<rank>-<seq>.safetensors``: ranks never collide, and names sort in write order."""
    return f"{field}/r{rank:05d}-{seq:05d}{DATA_SUFFIX}"


def context_path(field: str, rank: int = 0) -> str:
    """``<field>/context.msgpack``, or ``<field>/context.r<rank>.msgpack`` when a rank other than the
    coordinator writes it, so two ranks never race for one name (the manifest refuses two blobs a field)."""
    return f"{field}/{CONTEXT_NAME}" if rank == 0 else f"{field}/context.r{rank:05d}.msgpack"
