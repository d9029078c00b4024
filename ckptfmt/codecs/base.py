"""The interface every chunk codec implements (spec/codecs.md): its options, what it encodes to, the frames a
read decodes, and the :class:`ChunkCodec` protocol. Its own module, below the registry (``codecs/__init__.py``)
and the codecs, which the registry imports to register them: each codec takes the interface from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..manifest import Codec


class CodecConfiguration(Protocol):
    """A codec's configuration, typed by the codec; ``to_dict`` is the chunk's ``codec.configuration``."""

    def to_dict(self) -> dict[str, object]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecOptions:
    """A codec's write options; each codec that takes any subclasses this (the raw codec takes none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Encoded:
    """A chunk as stored: its bytes in parts (written back to back) and the configuration to record."""

    parts: tuple[bytes | bytearray | memoryview, ...]
    configuration: CodecConfiguration | None

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
    # the configuration plan_frames parsed and checked, handed to decode_into so that it is not parsed again
    # for every piece decoded (None: decode_into parses ``codec.configuration`` itself)
    configuration: CodecConfiguration | None = None


class ChunkCodec(Protocol):
    """One codec. ``encode`` and ``decode_into`` run on worker threads and must release the GIL for bulk work."""

    name: str

    def parse_options(self, argument: str) -> CodecOptions:
        """The options a writer asks for as ``"NAME:ARGUMENT"``; :class:`~ckptfmt.errors.UsageError` for a bad one."""
        ...

    def worth_encoding(self, *, dtype: str, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` raw bytes of ``dtype`` is encoded at all, or stays raw."""
        ...

    def encode(self, data: memoryview, *, dtype: str, itemsize: int, options: CodecOptions | None = None) -> Encoded:
        """The stored form of a chunk's raw little-endian C-order bytes (``options``: the codec's defaults when
        None)."""
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
