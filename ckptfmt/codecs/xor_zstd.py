"""The ``xor-zstd`` codec: a chunk stored as its difference from the same chunk of a base (spec/delta.md).

Consecutive checkpoints of one run differ in a few low mantissa bits: XORed with the base chunk's raw bytes, a
chunk's raw bytes are mostly zero bits, and the byte planes of zstd (sign rotated last, most significant plane
first) compress them far better than the chunk alone. The XORed bytes are then stored exactly as the ``zstd``
codec stores raw bytes (its frames, planes and checks are reused here), so a reader decodes only the frames a
slice needs, and only the same raw range of the base.

Configuration (:class:`XorConfiguration`): the zstd members (``frame_bytes``, ``frames``, ``bytegroup``,
``sign_last``, ``level``), plus ``base`` (the location of a base record of ``ckptfmt.references``) and ``chunk``
(the base chunk: ``path`` in the base, ``key``, ``range``, ``digest`` and ``codec`` as the base's manifest records
them; a base chunk may itself be ``xor-zstd``, up to :data:`MAX_DEPTH` deltas deep). This codec only decodes the
XORed bytes; the reader's :mod:`ckptfmt.delta` fetches and checks the base's bytes and XORs them back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..blocks import Blocks
from ..blocks import problem as block_problem
from ..digests import parse_digest
from ..errors import ManifestError, UsageError
from ..manifest import RAW, Codec, CodecDict
from .base import CodecOptions, Encoded, FrameSpan
from .registry import get_codec
from .zstd import ZstdCodec, ZstdConfiguration, ZstdOptions

if TYPE_CHECKING:
    import numpy as np
else:
    from ..lazy_import import numpy as np

NAME = "xor-zstd"
MAX_DEPTH = 8  # deltas in a chain: a read of the newest decodes at most this many bases besides the keyframe
_OWN = frozenset({"base", "chunk"})
_CHUNK = frozenset({"path", "key", "range", "digest", "codec", "blocks"})
_ZSTD = ZstdCodec()


_WHAT = "xor-zstd configuration: "


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseChunk:
    """The chunk of the base a delta is taken against, as the base's manifest records it."""

    path: str  # in the base
    key: str
    begin: int
    end: int
    digest: str
    codec: Codec
    blocks: Blocks | None = None  # a raw base chunk's block digests: a partial read checks only the blocks it reads

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "key": self.key,
            "range": [self.begin, self.end],
            "digest": self.digest,
            "codec": dict(self.codec.to_dict()),
        }
        if self.blocks is not None:
            out["blocks"] = dict(self.blocks.to_dict())
        return out

    @classmethod
    def from_dict(cls, doc: object) -> BaseChunk:
        if not isinstance(doc, Mapping):
            raise ManifestError(_WHAT + "'chunk' must be an object", requirement="DLT-1")
        unknown = sorted(set(doc) - _CHUNK)
        if unknown:
            raise ManifestError(
                _WHAT + f"'chunk' has members this reader does not know: {unknown}", requirement="DLT-1"
            )
        path, key, span, digest, codec = (doc.get(k) for k in ("path", "key", "range", "digest", "codec"))
        if type(path) is not str or type(key) is not str:
            raise ManifestError(_WHAT + "'chunk' needs a string 'path' and a string 'key'", requirement="DLT-1")
        if not isinstance(span, list) or len(span) != 2 or not all(type(v) is int for v in span):
            raise ManifestError(
                _WHAT + f"'chunk' 'range' must be two integers 0 <= begin <= end, got {span!r}", requirement="DLT-1"
            )
        if not 0 <= span[0] <= span[1]:
            raise ManifestError(
                _WHAT + f"'chunk' 'range' must be two integers 0 <= begin <= end, got {span!r}", requirement="DLT-1"
            )
        if parse_digest(digest) is None:
            raise ManifestError(
                _WHAT + f"'chunk' 'digest' {digest!r} is not a digest string (DIG-2)", requirement="DLT-1"
            )
        if not isinstance(codec, Mapping) or type(codec.get("name")) is not str:
            raise ManifestError(_WHAT + "'chunk' 'codec' must be an object with a string 'name'", requirement="DLT-1")
        configuration = codec.get("configuration")
        if configuration is not None and not isinstance(configuration, Mapping):
            raise ManifestError(_WHAT + "'chunk' 'codec' 'configuration' must be an object", requirement="DLT-1")
        unknown = sorted(set(codec) - {"name", "configuration"})
        if unknown:
            raise ManifestError(
                _WHAT + f"'chunk' 'codec' has members this reader does not know: {unknown}", requirement="DLT-1"
            )
        assert isinstance(digest, str)
        as_dict: CodecDict = {"name": codec["name"]}
        if configuration is not None:
            as_dict["configuration"] = configuration
        blocks = doc.get("blocks")
        if "blocks" in doc:  # as a chunk record's (BLK-1, BLK-2, BLK-3): on a raw base chunk only
            found = block_problem(blocks, nbytes=span[1] - span[0], algorithm=digest.partition(":")[0])
            if as_dict["name"] != RAW or not isinstance(blocks, Mapping) or found is not None:
                raise ManifestError(
                    _WHAT + f"'chunk' 'blocks' is not the block digests of a raw chunk of its range: {found}",
                    requirement="DLT-1",
                )
        return cls(
            path=path,
            key=key,
            begin=span[0],
            end=span[1],
            digest=digest,
            codec=Codec.from_dict(as_dict),
            blocks=None if blocks is None else Blocks.from_dict(blocks),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class XorConfiguration:
    """An ``xor-zstd`` chunk's ``codec.configuration``: where its base chunk is, and the zstd frames of the XOR."""

    base: str  # location of a base record ("../<name>")
    chunk: BaseChunk
    frames: ZstdConfiguration

    def to_dict(self) -> dict[str, object]:
        return {"base": self.base, "chunk": self.chunk.to_dict(), **self.frames.to_dict()}

    @classmethod
    def from_dict(cls, config: Mapping[str, object] | None) -> XorConfiguration:
        if config is None:
            raise ManifestError(_WHAT + "it is absent", requirement="DLT-1")
        unknown = sorted(set(config) - _OWN - _ZSTD_MEMBERS)
        if unknown:  # every member changes how bytes decode: one not understood is refused (as COD-4)
            raise ManifestError(_WHAT + f"members this reader does not know: {unknown}", requirement="DLT-1")
        base = config.get("base")
        if type(base) is not str:
            raise ManifestError(_WHAT + f"'base' must be a string, got {base!r}", requirement="DLT-1")
        chunk = BaseChunk.from_dict(config.get("chunk"))
        frames = ZstdConfiguration.from_dict({k: v for k, v in config.items() if k not in _OWN})
        return cls(base=base, chunk=chunk, frames=frames)

    def chain(self) -> Iterator[tuple[int, XorConfiguration]]:
        """(depth, configuration) of this delta and of every delta below it, newest first: at most
        :data:`MAX_DEPTH` (DLT-3), each parsed (DLT-1), so a manifest nested deeper is refused unread."""
        config: XorConfiguration = self
        depth = 1
        while True:
            yield depth, config
            if config.chunk.codec.name != NAME:
                return
            depth += 1
            if depth > MAX_DEPTH:
                raise ManifestError(
                    f"xor-zstd chunk is a delta of a delta {depth} or more deep; at most {MAX_DEPTH} are allowed",
                    requirement="DLT-3",
                )
            config = XorConfiguration.from_dict(config.chunk.codec.configuration)

    def check(self, *, stored_size: int, raw_size: int) -> None:
        """The frames against the chunk's sizes (COD-4), and every base chunk of the chain against the raw size:
        a base chunk decodes to exactly the chunk's raw bytes, by a codec this reader implements (DLT-1)."""
        levels = [config for _, config in self.chain()]  # every level parsed, the depth bounded, before any size
        self.frames.check(stored_size=stored_size, raw_size=raw_size)
        for config in levels:
            base = config.chunk
            name = base.codec.name
            if name == RAW:
                if base.nbytes != raw_size:
                    raise ManifestError(
                        _WHAT + f"raw base chunk holds {base.nbytes} bytes; the chunk has {raw_size} raw bytes",
                        requirement="DLT-1",
                    )
            elif name == NAME:
                XorConfiguration.from_dict(base.codec.configuration).frames.check(
                    stored_size=base.nbytes, raw_size=raw_size
                )
            else:
                get_codec(name).plan_frames(
                    base.codec, stored_size=base.nbytes, raw_size=raw_size, raw_begin=0, raw_end=0
                )


_ZSTD_MEMBERS = frozenset(ZstdConfiguration.__dataclass_fields__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaSource:
    """What a writer encodes one chunk against: the base chunk, where it is, and how to read its raw bytes."""

    location: str
    chunk: BaseChunk
    read: Callable[[], memoryview] = field(compare=False)  # the base chunk's raw bytes, read and checked


@dataclass(frozen=True, slots=True, kw_only=True)
class XorOptions(CodecOptions):
    """What a writer asks of the xor-zstd codec: zstd's options, and (set per chunk by the planner) its base."""

    zstd: ZstdOptions = field(default_factory=ZstdOptions)
    source: DeltaSource | None = None


def is_delta(codec: str | None) -> bool:
    """Whether a writer's codec argument (``"xor-zstd"`` or ``"xor-zstd:LEVEL"``) asks for delta chunks."""
    return codec is not None and codec.partition(":")[0] == NAME


def keyframe(codec: str | None) -> str | None:
    """The codec a save without a base writes with when ``xor-zstd`` was asked for: ``zstd`` with the same level
    (its chunks are the keyframes later deltas are taken against); any other codec as it is."""
    return "zstd" + codec[len(NAME) :] if codec is not None and is_delta(codec) else codec


def xor_into(out: memoryview, other: memoryview | bytes) -> None:
    """``out ^= other``, bytewise, in place (eight bytes at a time where the length allows)."""
    n = len(out)
    if len(other) != n:
        raise ValueError(f"xor of {n} bytes with {len(other)}")
    wide = 8 if n % 8 == 0 else 1
    a: np.ndarray[Any, Any] = np.frombuffer(out, dtype=f"u{wide}")
    a ^= np.frombuffer(other, dtype=f"u{wide}")


class XorZstdCodec:
    name = NAME

    def parse_options(self, argument: str) -> XorOptions:
        return XorOptions(zstd=ZstdOptions.parse(argument))

    def worth_encoding(self, *, dtype: str, nbytes: int) -> bool:
        return _ZSTD.worth_encoding(dtype=dtype, nbytes=nbytes)

    def encode(self, data: memoryview, *, dtype: str, itemsize: int, options: CodecOptions | None = None) -> Encoded:
        if not isinstance(options, XorOptions) or options.source is None:
            raise UsageError("the xor-zstd codec encodes a chunk against a base chunk: the planner names none")
        source = options.source
        delta = bytearray(data)
        xor_into(memoryview(delta), source.read())
        encoded = _ZSTD.encode(memoryview(delta), dtype=dtype, itemsize=itemsize, options=options.zstd)
        assert isinstance(encoded.configuration, ZstdConfiguration)
        config = XorConfiguration(base=source.location, chunk=source.chunk, frames=encoded.configuration)
        return Encoded(parts=encoded.parts, configuration=config)

    def plan_frames(self, codec: Codec, *, stored_size: int, raw_size: int, raw_begin: int, raw_end: int) -> FrameSpan:
        config = XorConfiguration.from_dict(codec.configuration)
        config.check(stored_size=stored_size, raw_size=raw_size)
        inner = Codec(name="zstd", configuration=config.frames.to_dict())
        span = _ZSTD.plan_frames(
            inner, stored_size=stored_size, raw_size=raw_size, raw_begin=raw_begin, raw_end=raw_end
        )
        return FrameSpan(
            stored_begin=span.stored_begin,
            stored_end=span.stored_end,
            raw_begin=span.raw_begin,
            raw_end=span.raw_end,
            configuration=config,
        )

    def decode_into(self, codec: Codec, stored: memoryview, span: FrameSpan, out: memoryview, *, itemsize: int) -> None:
        """The XORed bytes of ``span`` (not yet the chunk's raw bytes: :func:`ckptfmt.delta.xor_base` does that)."""
        config = span.configuration
        if not isinstance(config, XorConfiguration):
            config = XorConfiguration.from_dict(codec.configuration)
        _ZSTD.decode_into(codec, stored, replace(span, configuration=config.frames), out, itemsize=itemsize)


__all__ = [
    "MAX_DEPTH",
    "NAME",
    "BaseChunk",
    "DeltaSource",
    "XorConfiguration",
    "XorOptions",
    "XorZstdCodec",
    "is_delta",
    "keyframe",
    "xor_into",
]
