"""The codec registry: name -> implementation. A module of its own, so that a codec that decodes its base chunk
with another codec (``xor-zstd``) looks it up without importing the package that imports it."""

from __future__ import annotations

from ..errors import UnsupportedCodecError
from .base import ChunkCodec

_REGISTRY: dict[str, ChunkCodec] = {}


def register(codec: ChunkCodec) -> None:
    _REGISTRY[codec.name] = codec


def get_codec(name: str, **where: object) -> ChunkCodec:
    """The implementation of codec ``name``; an unknown name refuses the tensor that uses it (TEN-14)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedCodecError(
            f"chunk is stored with codec {name!r}, which this reader does not implement "
            f"(known: {', '.join(sorted(_REGISTRY))})",
            requirement="TEN-14",
            **where,  # type: ignore[arg-type]
        ) from None


def known_codecs() -> list[str]:
    return sorted(_REGISTRY)
