"""The ``zstd`` codec: independent zstd frames of bounded raw size, optionally byte-grouped (spec/codecs.md).

A chunk's raw bytes are cut into frames of ``frame_bytes`` raw bytes (the last may be shorter).
With ``bytegroup``, each frame's elements are split into byte planes before compression (the most
significant byte of every element, then the next, ...): float exponents land side by side, which is
where zstd finds the redundancy. With ``sign_last`` as well, each element is first rotated left by
one bit, so the sign moves to the lowest bit and the high plane holds exponent bits only (bf16 and
fp32: exactly the 8-bit exponent), which the entropy coder then sees without the sign's noise.
Each frame is one zstd frame with its content size and checksum, so a reader decodes only the
frames a slice touches, fetches only their stored bytes, and never lets a frame produce more than
the manifest says it holds.

Configuration (:class:`ZstdConfiguration`): ``{"frame_bytes": F, "frames": [stored size of each frame],
"bytegroup": bool, "sign_last": bool, "level": L}`` (``level``, informative, only when the writer was asked for
a zstd level). Write options (:class:`ZstdOptions`): ``"zstd:LEVEL"``, and the frame size.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import zstandard
else:
    from ..lazy_import import numpy as np
    from ..lazy_import import zstandard

from ..errors import IntegrityError, ManifestError, UsageError
from ..manifest import Codec
from .base import CodecOptions, Encoded, FrameSpan

NAME = "zstd"
FRAME_BYTES = 4 << 20  # raw bytes per frame: the granularity of random access
_BLOCK = 128 << 10  # bytes (re)grouped at a time: three scratch blocks stay in a core's L2 cache
MIN_COMPRESS_BYTES = 4096  # smaller chunks stay raw: a frame header and checksum would eat the gain
MAX_FRAMES = 1 << 24
# No zstd block decodes to more than 128 KiB, and none takes fewer than 4 stored bytes (an RLE block: a 3-byte
# header and the byte), so no chunk can hold more raw bytes than this many times its stored ones (COD-4).
MAX_EXPANSION = (128 << 10) // 4
_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_COMPRESSIBLE = _FLOATING | {"I64", "I32", "I16", "U64", "U32", "U16"}
_local = threading.local()  # a zstd context per thread: contexts are not thread-safe


@dataclass(frozen=True, slots=True, kw_only=True)
class ZstdOptions(CodecOptions):
    """What a writer asks of the zstd codec."""

    level: int = 0  # 0: entropy coding of the byte planes, no match search (:func:`_compressor`); else 1..19
    frame_bytes: int | None = None  # raw bytes per frame; None: FRAME_BYTES (read when encoding)

    @classmethod
    def parse(cls, argument: str) -> ZstdOptions:
        """``LEVEL`` of ``"zstd:LEVEL"``."""
        if not argument.isdigit() or not 1 <= int(argument) <= 19:
            raise UsageError(f"codec level must be an integer in 1..19, got {argument!r}")
        return cls(level=int(argument))


@dataclass(frozen=True, slots=True, kw_only=True)
class ZstdConfiguration:
    """A zstd chunk's ``codec.configuration``. ``from_dict`` checks each member on its own (COD-4); how they
    fit the chunk's stored and raw sizes is :meth:`check`'s."""

    frame_bytes: int
    frames: tuple[int, ...]  # the stored size of each frame
    bytegroup: bool = False
    sign_last: bool = False
    level: int | None = None  # informative: what the writer was asked for; a reader ignores it

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "bytegroup": self.bytegroup,
            "frame_bytes": self.frame_bytes,
            "frames": list(self.frames),
        }
        if self.sign_last:
            out["sign_last"] = True
        if self.level is not None:
            out["level"] = self.level
        return out

    @classmethod
    def from_dict(cls, config: Mapping[str, object] | None) -> ZstdConfiguration:
        if config is None:
            raise ManifestError("zstd codec has no 'configuration'", requirement="COD-4")
        frame, sizes = config.get("frame_bytes"), config.get("frames")
        if type(frame) is not int or frame <= 0:
            raise ManifestError(f"zstd 'frame_bytes' must be a positive integer, got {frame!r}", requirement="COD-4")
        if type(sizes) is not list or not all(type(s) is int and s > 0 for s in sizes):
            raise ManifestError("zstd 'frames' must be a list of positive integers", requirement="COD-4")
        flags: dict[str, object] = {}
        for flag in ("bytegroup", "sign_last"):
            flags[flag] = config.get(flag, False)
            if type(flags[flag]) is not bool:
                raise ManifestError(f"zstd '{flag}' must be a boolean", requirement="COD-4")
        unknown = sorted(set(config) - _MEMBERS)
        if unknown:  # every member but 'level' changes how the bytes decode: one not understood is refused
            raise ManifestError(
                f"zstd configuration has members this reader does not know: {unknown}", requirement="COD-4"
            )
        level = config.get("level")
        return cls(
            frame_bytes=frame,
            frames=tuple(sizes),
            bytegroup=flags["bytegroup"] is True,
            sign_last=flags["sign_last"] is True,
            level=level if type(level) is int else None,  # informative, so never refused (spec/codecs.md)
        )

    def check(self, *, stored_size: int, raw_size: int) -> None:
        """The frames against the chunk's stored and raw sizes (COD-4)."""
        if raw_size > MAX_EXPANSION * stored_size:
            raise ManifestError(
                f"zstd chunk claims {raw_size} raw bytes from {stored_size} stored; zstd cannot expand more than "
                f"{MAX_EXPANSION}x",
                requirement="COD-4",
            )
        expected = -(-raw_size // self.frame_bytes)
        if len(self.frames) != expected or len(self.frames) > MAX_FRAMES:
            raise ManifestError(
                f"zstd 'frames' lists {len(self.frames)} frames; {raw_size} raw bytes in frames of "
                f"{self.frame_bytes} make {expected}",
                requirement="COD-4",
            )
        if sum(self.frames) != stored_size:
            raise ManifestError(
                f"zstd 'frames' add up to {sum(self.frames)} bytes; the chunk's range holds {stored_size}",
                requirement="COD-4",
            )


_MEMBERS = frozenset(ZstdConfiguration.__dataclass_fields__)


def compressible(dtype: str) -> bool:
    """Floating dtypes only: integer and boolean chunks of a training state are small (steps, masks)."""
    return dtype in _FLOATING


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """Level 0 (the default): no match search, so each block is Huffman-coded literals. On byte planes of
    weights and optimizer moments, repeats long enough to match are rare: searching for them costs time
    and the bits spent on the few found cost ratio (on real weights level 0 is both smaller and faster than
    level 1: docs/benchmarks.md). Levels 1-19 are zstd's own."""
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        if level == 0:
            params = zstandard.ZstdCompressionParameters(
                window_log=17,
                chain_log=6,
                hash_log=6,
                search_log=1,
                min_match=7,
                target_length=0,
                strategy=zstandard.STRATEGY_FAST,
                write_checksum=True,
                write_content_size=True,
            )
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def _compress_planes(cctx: zstandard.ZstdCompressor, planes: memoryview, itemsize: int) -> bytes:
    """One zstd frame of ``planes``, its blocks ending at each plane's end: a block then never mixes the
    exponent plane with a mantissa plane, so each gets a Huffman table of its own (a better ratio than blocks
    that straddle planes: docs/benchmarks.md)."""
    size = len(planes) // itemsize
    cobj = cctx.compressobj(size=len(planes))
    parts = []
    for k in range(itemsize):
        parts.append(cobj.compress(planes[k * size : (k + 1) * size]))
        parts.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(cobj.flush())
    return b"".join(parts)


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    d: zstandard.ZstdDecompressor = _local.decompressor
    return d


def _scratch(name: str, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A per-thread buffer reused from frame to frame: a fresh multi-MiB array per frame is a fresh mmap
    whose every page faults in (on a VM whose host backs memory lazily, slower than compressing it)."""
    buffers: dict[str, np.ndarray[Any, np.dtype[np.uint8]]] = _local.__dict__.setdefault("scratch", {})
    buffer = buffers.get(name)
    if buffer is None or len(buffer) < nbytes:
        buffer = buffers[name] = np.empty(max(nbytes, FRAME_BYTES), dtype=np.uint8)
    return buffer[:nbytes]


def group_bytes(data: memoryview, itemsize: int, *, sign_last: bool = False, reuse: bool = False) -> memoryview:
    """Byte planes of ``data``: the most significant byte of every (little-endian) element first;
    with ``sign_last``, of the elements rotated left by one bit. With ``reuse`` the result lives in
    this thread's scratch space, valid until its next call."""
    n = len(data)
    if itemsize == 1 and not sign_last:
        return data
    planes = (_scratch("planes", n) if reuse else np.empty(n, dtype=np.uint8)).reshape(itemsize, -1)
    elements = np.frombuffer(data, dtype=f"<u{itemsize}")
    step = _BLOCK // itemsize
    for lo in range(0, len(elements), step):  # a block at a time, so every pass below runs in cache
        block = elements[lo : lo + step]
        if sign_last:  # whole elements (contiguous, vectorized), not bytes (strided)
            rotated = _scratch("rotated", _BLOCK).view(f"<u{itemsize}")[: len(block)]
            sign = _scratch("sign", _BLOCK).view(f"<u{itemsize}")[: len(block)]
            np.left_shift(block, 1, out=rotated)
            np.right_shift(block, 8 * itemsize - 1, out=sign)
            rotated |= sign
            block = rotated
        rows = block.view(np.uint8).reshape(-1, itemsize)
        for k in range(itemsize):
            planes[k, lo : lo + len(block)] = rows[:, itemsize - 1 - k]
    return planes.data.cast("B")


def ungroup_bytes(planes: bytes, itemsize: int, out: memoryview, *, sign_last: bool = False) -> None:
    """Inverse of :func:`group_bytes`, written straight into ``out``."""
    source = np.frombuffer(planes, dtype=np.uint8).reshape(itemsize, -1)
    elements = np.frombuffer(out, dtype=f"<u{itemsize}")
    step = _BLOCK // itemsize
    for lo in range(0, len(elements), step):
        block = elements[lo : lo + step]
        rows = block.view(np.uint8).reshape(-1, itemsize)
        for k in range(itemsize):
            rows[:, itemsize - 1 - k] = source[k, lo : lo + len(block)]
        if sign_last:
            _rotate_right(block, itemsize)


def rotate_right(out: memoryview, itemsize: int) -> None:
    """Rotate each (little-endian) element of ``out`` right by one bit, in place: undoes ``sign_last``."""
    elements = np.frombuffer(out, dtype=f"<u{itemsize}")
    step = _BLOCK // itemsize
    for lo in range(0, len(elements), step):
        _rotate_right(elements[lo : lo + step], itemsize)


def _rotate_right(block: np.ndarray[Any, Any], itemsize: int) -> None:
    sign = _scratch("sign", _BLOCK).view(f"<u{itemsize}")[: len(block)]
    np.left_shift(block, 8 * itemsize - 1, out=sign)
    block >>= 1
    block |= sign


class ZstdCodec:
    name = NAME
    sign_last = True  # with bytegroup (floating dtypes); a subclass without it writes 1.1's older layout

    def parse_options(self, argument: str) -> ZstdOptions:
        return ZstdOptions.parse(argument)

    def worth_encoding(self, *, dtype: str, nbytes: int) -> bool:
        return nbytes >= MIN_COMPRESS_BYTES and compressible(dtype)

    def encode(self, data: memoryview, *, dtype: str, itemsize: int, options: CodecOptions | None = None) -> Encoded:
        if options is None:
            options = ZstdOptions()
        if not isinstance(options, ZstdOptions):
            raise UsageError(f"the zstd codec takes ZstdOptions, got {type(options).__name__}")
        group = dtype in _FLOATING and itemsize > 1
        frame = options.frame_bytes or FRAME_BYTES
        frame = max(itemsize, frame - frame % itemsize)
        cctx = _compressor(options.level)
        stored = bytearray()  # frames appended in place: no list of frames joined later (one copy less)
        sizes: list[int] = []
        for lo in range(0, len(data), frame):
            piece = data[lo : lo + frame]
            before = len(stored)
            if group:
                planes = group_bytes(piece, itemsize, sign_last=self.sign_last, reuse=True)
                stored += _compress_planes(cctx, planes, itemsize)
            else:
                stored += cctx.compress(piece)
            sizes.append(len(stored) - before)
        config = ZstdConfiguration(
            frame_bytes=frame,
            frames=tuple(sizes),
            bytegroup=group,
            sign_last=group and self.sign_last,
            level=options.level or None,
        )
        return Encoded(parts=(stored,), configuration=config)

    def plan_frames(self, codec: Codec, *, stored_size: int, raw_size: int, raw_begin: int, raw_end: int) -> FrameSpan:
        config = ZstdConfiguration.from_dict(codec.configuration)
        config.check(stored_size=stored_size, raw_size=raw_size)
        frame, sizes = config.frame_bytes, config.frames
        if raw_begin >= raw_end:
            return FrameSpan(stored_begin=0, stored_end=0, raw_begin=raw_begin, raw_end=raw_begin)
        first, last = raw_begin // frame, (raw_end - 1) // frame
        stored_begin = sum(sizes[:first])
        stored_end = stored_begin + sum(sizes[first : last + 1])
        return FrameSpan(
            stored_begin=stored_begin,
            stored_end=stored_end,
            raw_begin=first * frame,
            raw_end=min(raw_size, (last + 1) * frame),
            configuration=config,
        )

    def decode_into(self, codec: Codec, stored: memoryview, span: FrameSpan, out: memoryview, *, itemsize: int) -> None:
        config = span.configuration
        if not isinstance(config, ZstdConfiguration):  # a span not planned by plan_frames: parse it here
            config = ZstdConfiguration.from_dict(codec.configuration)
        frame, sizes = config.frame_bytes, config.frames
        group = config.bytegroup and itemsize > 1
        sign_last = config.sign_last
        if (group or sign_last) and frame % itemsize:
            raise ManifestError(
                f"zstd 'frame_bytes' {frame} is not a multiple of the itemsize {itemsize}", requirement="COD-4"
            )
        index = span.raw_begin // frame
        position = 0
        for lo in range(0, span.raw_end - span.raw_begin, frame):
            want = min(frame, span.raw_end - span.raw_begin - lo)
            size = sizes[index]
            decoded = _decode_frame(stored[position : position + size], want, index)
            if group:
                ungroup_bytes(decoded, itemsize, out[lo : lo + want], sign_last=sign_last)
            else:
                out[lo : lo + want] = decoded
                if sign_last:
                    rotate_right(out[lo : lo + want], itemsize)
            position += size
            index += 1


def _decode_frame(data: memoryview, want: int, index: int) -> bytes:
    """One frame, refused unless it declares exactly ``want`` bytes of content and a checksum.

    The declared size is checked before decoding: python-zstandard sizes its output from the frame
    header and ignores ``max_output_size`` when the header states a size.
    """
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"zstd frame {index}: not a zstd frame ({exc})", requirement="COD-5") from exc
    if params.content_size != want:
        raise IntegrityError(
            f"zstd frame {index} declares {params.content_size} bytes of content, the manifest says {want}",
            requirement="COD-5",
        )
    if not params.has_checksum:
        raise IntegrityError(f"zstd frame {index} has no content checksum", requirement="COD-5")
    dobj = _decompressor().decompressobj()
    try:
        decoded = dobj.decompress(data)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"zstd frame {index} does not decode: {exc}", requirement="COD-5") from exc
    if len(decoded) != want or not dobj.eof or dobj.unused_data:
        raise IntegrityError(
            f"zstd frame {index} decodes to {len(decoded)} bytes with "
            f"{len(dobj.unused_data) if dobj.eof else 'missing'} trailing bytes; the manifest says {want} bytes, "
            "one frame",
            requirement="COD-5",
        )
    return decoded


__all__ = [
    "FRAME_BYTES",
    "MIN_COMPRESS_BYTES",
    "ZstdCodec",
    "ZstdConfiguration",
    "ZstdOptions",
    "compressible",
    "group_bytes",
    "ungroup_bytes",
]
