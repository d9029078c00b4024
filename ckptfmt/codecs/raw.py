"""The ``raw`` codec: the stored bytes are the chunk's elements, little-endian, in C order (TEN-13)."""

from __future__ import annotations

from ..errors import IntegrityError, UsageError
from ..manifest import RAW, Codec
from .base import CodecOptions, Encoded, FrameSpan


class RawCodec:
    """It has no configuration (a raw chunk's ``codec`` is ``{"name": "raw"}``) and takes no options."""

    name = RAW

    def parse_options(self, argument: str) -> CodecOptions:
        raise UsageError(f"codec {RAW!r} takes no options, got {argument!r}")

    def worth_encoding(self, *, dtype: str, nbytes: int) -> bool:
        return False  # its stored bytes are the raw ones: there is nothing to encode

    def encode(self, data: memoryview, *, dtype: str, itemsize: int, options: CodecOptions | None = None) -> Encoded:
        return Encoded(parts=(data,), configuration=None)

    def plan_frames(self, codec: Codec, *, stored_size: int, raw_size: int, raw_begin: int, raw_end: int) -> FrameSpan:
        return FrameSpan(stored_begin=raw_begin, stored_end=raw_end, raw_begin=raw_begin, raw_end=raw_end)

    def decode_into(self, codec: Codec, stored: memoryview, span: FrameSpan, out: memoryview, *, itemsize: int) -> None:
        if len(stored) != len(out):
            raise IntegrityError(f"raw chunk holds {len(stored)} bytes where {len(out)} are needed")
        out[:] = stored
