"""Chunk codecs: how a chunk's stored bytes encode its elements (spec/codecs.md).

A codec is a named, configured object, recorded on disk as ``{"name": ..., "configuration": {...}}``
in each chunk record. The registry maps a name to the implementation; a name it does not hold is
refused for the one tensor that uses it (TEN-14), never for the whole checkpoint.

Call sequence: the writer's planner picks a :class:`ChunkCodec` per entry (:func:`writer_codec`),
the executor calls :meth:`ChunkCodec.encode` in the write pass, and the reader asks
:meth:`ChunkCodec.plan_frames` which stored bytes a raw byte range needs, then
:meth:`ChunkCodec.decode_into` to fill the destination.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..errors import UnsupportedCodecError, UsageError
from ..manifest import RAW, Codec


@dataclass(frozen=True, slots=True, kw_only=True)
class Encoded:
    """A chunk as stored: its bytes in parts (written back to back) and the configuration to record."""

    parts: tuple[bytes | bytearray | memoryview, ...]
    configuration: Mapping[str, object] | None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameSpan:
    """The stored bytes ``[stored_begin, stored_end)`` (relative to the chunk) that decode to the raw
    bytes ``[raw_begin, raw_end)`` of the chunk."""

    stored_begin: int
    stored_end: int
    raw_begin: int
    raw_end: int


class ChunkCodec(Protocol):
    """One codec. ``encode`` and ``decode_into`` run on worker threads and must release the GIL for bulk work."""

    name: str

    def encode(
        self, data: memoryview, *, dtype: str, itemsize: int, level: int, frame_bytes: int | None = None
    ) -> Encoded:
        """The stored form of a chunk's raw little-endian C-order bytes (``frame_bytes``: the codec's default
        when None)."""
        ...

    def plan_frames(self, codec: Codec, *, stored_size: int, raw_size: int, raw_begin: int, raw_end: int) -> FrameSpan:
        """The smallest run of independently decodable stored bytes that covers ``[raw_begin, raw_end)``.

        Raises :class:`~ckptfmt.errors.ManifestError` for a configuration that does not describe
        ``stored_size`` stored bytes decoding to ``raw_size`` raw bytes.
        """
        ...

    def decode_into(self, codec: Codec, stored: memoryview, span: FrameSpan, out: memoryview, *, itemsize: int) -> None:
        """Decode the stored bytes of ``span`` into ``out`` (exactly ``span.raw_end - span.raw_begin`` bytes).

        Never produces more than ``len(out)`` bytes; raises :class:`~ckptfmt.errors.IntegrityError`
        for stored bytes that do not decode to exactly that.
        """
        ...


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


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteCodec:
    """What a writer was asked to encode with: a codec name and its options (``"zstd"``, ``"zstd:3"``)."""

    name: str = RAW
    level: int = 0  # 0: the codec's default (zstd: entropy coding of the byte planes, no match search)
    frame_bytes: int | None = None  # raw bytes per frame; None: the codec's default

    @classmethod
    def parse(cls, value: str | WriteCodec | None) -> WriteCodec:
        if value is None:
            return cls()
        if isinstance(value, WriteCodec):
            return value
        name, _, level = str(value).partition(":")
        if name not in _REGISTRY:
            raise UsageError(f"unknown codec {name!r}; known: {', '.join(known_codecs())}")
        if not level:
            return cls(name=name)
        if not level.isdigit() or not 1 <= int(level) <= 19:
            raise UsageError(f"codec level must be an integer in 1..19, got {level!r}")
        return cls(name=name, level=int(level))


def writer_codec(choice: WriteCodec, *, dtype: str, nbytes: int) -> WriteCodec:
    """The codec one entry is written with: compression is skipped where it cannot pay (empty, tiny,
    boolean or integer chunks stay raw), so such tensors stay readable by 1.0 readers."""
    from .zstd import MIN_COMPRESS_BYTES, compressible

    if choice.name == RAW or nbytes < MIN_COMPRESS_BYTES or not compressible(dtype):
        return WriteCodec()
    return choice


from . import raw as _raw  # noqa: E402  (registration after the registry exists)
from . import zstd as _zstd  # noqa: E402

register(_raw.RawCodec())
register(_zstd.ZstdCodec())

__all__ = [
    "ChunkCodec",
    "Encoded",
    "FrameSpan",
    "WriteCodec",
    "get_codec",
    "known_codecs",
    "register",
    "writer_codec",
]
