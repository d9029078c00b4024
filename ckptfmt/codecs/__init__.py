"""Chunk codecs: how a chunk's stored bytes encode its elements (spec/codecs.md).

A codec is a named, configured object, recorded on disk as ``{"name": ..., "configuration": {...}}``
in each chunk record. The registry maps a name to the implementation; a name it does not hold is
refused for the one tensor that uses it (TEN-14), never for the whole checkpoint.

Each codec types what it knows: its configuration (what a chunk record holds, a frozen dataclass with
``to_dict``/``from_dict`` that names the member at fault) and its write options (what a writer was asked
for, :class:`CodecOptions`). This module knows neither: it is the registry only, over the interface in :mod:`.base`.

Call sequence: the writer parses ``"NAME[:ARGUMENT]"`` into a :class:`WriteCodec` (the codec's
:meth:`ChunkCodec.parse_options`), its planner picks the codec per entry (:func:`writer_codec`, which asks
:meth:`ChunkCodec.worth_encoding`), the executor calls :meth:`ChunkCodec.encode` in the write pass and records
``Encoded.configuration.to_dict()``, and the reader asks :meth:`ChunkCodec.plan_frames` which stored bytes a
raw byte range needs, then :meth:`ChunkCodec.decode_into` to fill the destination.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..manifest import RAW
from .base import ChunkCodec, CodecConfiguration, CodecOptions, Encoded, FrameSpan
from .registry import _REGISTRY, get_codec, known_codecs, register


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteCodec:
    """What a writer was asked to encode with: a codec name and its options (``"zstd"``, ``"zstd:3"``)."""

    name: str = RAW
    options: CodecOptions | None = None  # the codec's own (zstd: ZstdOptions); None: its defaults

    @classmethod
    def parse(cls, value: str | WriteCodec | None) -> WriteCodec:
        if value is None:
            return cls()
        if isinstance(value, WriteCodec):
            return value
        name, _, argument = str(value).partition(":")
        if name not in _REGISTRY:
            raise UsageError(f"unknown codec {name!r}; known: {', '.join(known_codecs())}")
        if not argument:
            return cls(name=name)
        return cls(name=name, options=_REGISTRY[name].parse_options(argument))


_RAW_WRITE = WriteCodec()  # one for every raw entry: immutable, and a write of many tensors makes none per entry


def writer_codec(choice: WriteCodec, *, dtype: str, nbytes: int) -> WriteCodec:
    """The codec one entry is written with: the codec skips chunks where encoding cannot pay (zstd: empty,
    tiny, boolean or integer chunks stay raw), so such tensors stay readable by 1.0 readers."""
    if choice.name == RAW:
        return choice
    if not get_codec(choice.name).worth_encoding(dtype=dtype, nbytes=nbytes):
        return _RAW_WRITE
    return choice


from . import raw as _raw  # noqa: E402  (registration after the registry exists)
from . import xor_zstd as _xor_zstd  # noqa: E402
from . import zstd as _zstd  # noqa: E402

register(_raw.RawCodec())
register(_zstd.ZstdCodec())
register(_xor_zstd.XorZstdCodec())

__all__ = [
    "ChunkCodec",
    "CodecConfiguration",
    "CodecOptions",
    "Encoded",
    "FrameSpan",
    "WriteCodec",
    "get_codec",
    "known_codecs",
    "register",
    "writer_codec",
]
