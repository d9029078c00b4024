"""Vectors about codecs (spec/codecs.md): the re-encoding helper, valid compressed inputs, invalid frames.

Compressed vectors start from a checkpoint the reference writer wrote raw, re-encoded with the
library's zstd codec (small frames, so several frames fit in a small vector). Invalid ones tamper
with what the encoder produced *before* the data file's header, digests and manifest are built,
so each breaks exactly one codec rule and nothing else.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zstandard

import ckptfmt
from ckptfmt.codecs import CodecOptions, Encoded, WriteCodec, get_codec, register
from ckptfmt.codecs.zstd import ZstdCodec, ZstdOptions
from ckptfmt.storage import open_store
from ckptfmt.writer import CheckpointWriter

from .edits import Mutation
from .inputs import document, provenance, tensor
from .invalid import Invalid
from .mutations import Json, Tree

FRAME_BYTES = 4096
Tamper = Callable[[Encoded], Encoded]


def zstd_input() -> dict[str, Any]:
    """Floating tensors of every width, one spanning several frames, one sharded, and raw ones beside them."""
    tensors = {
        "w": tensor("F32", [40, 64], seed=1),  # 10240 bytes: three frames of 4096
        "h": tensor("BF16", [48, 48], seed=2),
        "d": tensor("F64", [16, 40], seed=3),
        "f": tensor("F16", [2048], seed=4),
        "s": tensor(
            "F32",
            [32, 64],
            seed=5,
            chunks=[
                {"rank": 0, "offsets": [0, 0], "shape": [16, 64]},
                {"rank": 0, "offsets": [16, 0], "shape": [16, 64]},
            ],
        ),
        "steps": tensor("I64", [4], seed=6),  # integers and tiny tensors stay raw
        "tiny": tensor("F32", [3], seed=7),
    }
    return document("weights", {"weights": {"kind": "tensors", "tensors": tensors}, "provenance": provenance()})


class _Tampering(ZstdCodec):
    def __init__(self, tamper: Tamper, tensor_bytes: int) -> None:
        self.tamper = tamper
        self.tensor_bytes = tensor_bytes

    def encode(self, data: memoryview, *, dtype: str, itemsize: int, options: CodecOptions | None = None) -> Encoded:
        encoded = super().encode(data, dtype=dtype, itemsize=itemsize, options=options)
        return self.tamper(encoded) if len(data) == self.tensor_bytes else encoded


class _WithoutSignLast(ZstdCodec):
    sign_last = False


def to_zstd(t: Tree, *, tamper: Tamper | None = None, target_bytes: int = 10240, sign_last: bool = True) -> None:
    """Re-encode the checkpoint in ``t`` with zstd (frames of ``FRAME_BYTES``), in place.

    ``tamper`` rewrites the encoder's output for every chunk of ``target_bytes`` raw bytes (tensor ``w``
    of :func:`zstd_input`, or of the ``weights`` base) before the writer records it; without
    ``sign_last`` floating tensors are byte-grouped only.
    """
    src = ckptfmt.open(str(t.root))
    staging = t.root.parent / (t.root.name + ".zstd")
    real = get_codec("zstd")
    if tamper is not None:
        register(_Tampering(tamper, target_bytes))
    elif not sign_last:
        register(_WithoutSignLast())
    try:
        with CheckpointWriter(
            open_store(str(staging)),
            profile=src.profile,
            codec=WriteCodec(name="zstd", options=ZstdOptions(level=3, frame_bytes=FRAME_BYTES)),
            metadata=src.manifest.metadata,
            digest=src.manifest.files[0].digest.partition(":")[0],
        ) as writer:
            for fname, record in src.fields.items():
                if record.kind == "tensors":
                    writer.write_tensors(fname, {})
                for tname, rec in record.tensors.items():
                    for chunk in rec.chunks:
                        data = src.read_slice(fname, tname, chunk.offsets, chunk.shape)
                        if len(rec.chunks) == 1:
                            writer.write_tensor(fname, tname, data)
                        else:
                            writer.write_tensor(fname, tname, data, global_shape=rec.shape, offsets=chunk.offsets)
                if record.context is not None:
                    writer.write_context(fname, src.read_context(fname))
    finally:
        register(real)
        src.close()
    shutil.rmtree(t.root)
    staging.rename(t.root)


def _tampered(tamper: Tamper) -> Mutation:
    return lambda t: to_zstd(t, tamper=tamper)


@dataclass(frozen=True)
class _Members:
    """A configuration as a tampering encoder records it: any JSON object, whether the codec's type allows it
    or not (a 'sign_last' of 1, an unknown member)."""

    members: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        return dict(self.members)


def _members(encoded: Encoded) -> dict[str, object]:
    return {} if encoded.configuration is None else encoded.configuration.to_dict()


def _configured(encoded: Encoded, **members: object) -> Encoded:
    """``encoded`` with these members of its configuration replaced or added."""
    return Encoded(parts=encoded.parts, configuration=_Members({**_members(encoded), **members}))


def _sizes(encoded: Encoded) -> list[int]:
    return [int(n) for n in _members(encoded)["frames"]]  # type: ignore[attr-defined]


def _frames(encoded: Encoded) -> list[bytes]:
    """The stored frames, cut out of the encoder's output by the sizes it records."""
    stored = b"".join(bytes(p) for p in encoded.parts)
    out, at = [], 0
    for size in _sizes(encoded):
        out.append(stored[at : at + size])
        at += size
    return out


def _with(encoded: Encoded, parts: list[bytes], **config: object) -> Encoded:
    configuration = {**_members(encoded), "frames": [len(p) for p in parts], **config}
    return Encoded(parts=(b"".join(parts),), configuration=_Members(configuration))


def frame_past_size(encoded: Encoded) -> Encoded:
    """The last frame holds (and declares) one element more than the manifest's frame size allows."""
    parts = _frames(encoded)
    last = zstandard.ZstdDecompressor().decompress(parts[-1])
    parts[-1] = zstandard.ZstdCompressor(write_checksum=True).compress(last + last[:4])
    return _with(encoded, parts)


def frame_without_content_size(encoded: Encoded) -> Encoded:
    parts = _frames(encoded)
    plain = zstandard.ZstdDecompressor().decompress(parts[0])
    parts[0] = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(plain)
    return _with(encoded, parts)


def frame_without_checksum(encoded: Encoded) -> Encoded:
    parts = _frames(encoded)
    plain = zstandard.ZstdDecompressor().decompress(parts[0])
    parts[0] = zstandard.ZstdCompressor(write_checksum=False).compress(plain)
    return _with(encoded, parts)


def frame_checksum_wrong(encoded: Encoded) -> Encoded:
    parts = _frames(encoded)
    parts[1] = parts[1][:-1] + bytes([parts[1][-1] ^ 0x01])  # the last byte belongs to the checksum
    return _with(encoded, parts)


def frames_miscounted(encoded: Encoded) -> Encoded:
    """The frame sizes add up, but there is one entry too many: the last frame's size split in two."""
    sizes = _sizes(encoded)
    return _configured(encoded, frames=[*sizes[:-1], sizes[-1] - 1, 1])


def frames_shifted(encoded: Encoded) -> Encoded:
    """Frame boundaries off by one: the first frame's stated size takes a byte of the second."""
    sizes = _sizes(encoded)
    sizes[0] += 1
    sizes[1] -= 1
    return _configured(encoded, frames=sizes)


def frames_overrun(encoded: Encoded) -> Encoded:
    sizes = _sizes(encoded)
    sizes[-1] += 1
    return _configured(encoded, frames=sizes)


def frame_bytes_not_multiple(encoded: Encoded) -> Encoded:
    return _configured(encoded, frame_bytes=4095)


def sign_last_not_boolean(encoded: Encoded) -> Encoded:
    return _configured(encoded, sign_last=1)


def unknown_member(encoded: Encoded) -> Encoded:
    """A filter this reader cannot know: decoding without it would give wrong values that pass every checksum."""
    return _configured(encoded, delta=True)


def _chunk(doc: Json, name: str) -> Json:
    return doc["fields"]["weights"]["tensors"][name]["chunks"][0]


def _bomb(t: Tree) -> None:
    """Tensor w's shape and frame_bytes scaled by 2**36: the frame count still agrees, the claimed raw size
    does not fit any zstd expansion of its stored bytes."""
    to_zstd(t)

    def scale(doc: Json) -> None:
        record = doc["fields"]["weights"]["tensors"]["w"]
        record["shape"][0] <<= 36
        chunk = record["chunks"][0]
        chunk["shape"][0] <<= 36
        chunk["codec"]["configuration"]["frame_bytes"] <<= 36

    t.edit(scale)


def _rename_codec(t: Tree) -> None:
    to_zstd(t)
    t.edit(lambda d: _chunk(d, "w")["codec"].update(name="org.example.zstd2"))


VECTORS: tuple[Invalid, ...] = (
    Invalid(
        "zstd-frame-past-size",
        ("COD-5",),
        "Tensor w (zstd, frames of 4096 bytes): its last frame declares and holds 4 bytes more than the rest of w.",
        _tampered(frame_past_size),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frame-no-content-size",
        ("COD-5",),
        "Tensor w (zstd): its first frame does not declare its content size.",
        _tampered(frame_without_content_size),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frame-no-checksum",
        ("COD-5",),
        "Tensor w (zstd): its first frame has no content checksum.",
        _tampered(frame_without_checksum),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frame-checksum-wrong",
        ("COD-5",),
        "Tensor w (zstd): the second frame's content checksum has one bit flipped (the chunk digest agrees).",
        _tampered(frame_checksum_wrong),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frames-miscounted",
        ("COD-4",),
        "Tensor w (zstd): 'frames' lists four sizes that add up to the range, for three frames of raw data.",
        _tampered(frames_miscounted),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frames-shifted",
        ("COD-5",),
        "Tensor w (zstd): 'frames' puts the first boundary one byte late (the sizes still add up).",
        _tampered(frames_shifted),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frames-overrun",
        ("COD-4",),
        "Tensor w (zstd): 'frames' adds up to one byte more than the chunk's range.",
        _tampered(frames_overrun),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-frame-bytes-odd",
        ("COD-4",),
        "Tensor w (zstd, bytegroup, F32): 'frame_bytes' is 4095, not a multiple of the itemsize.",
        _tampered(frame_bytes_not_multiple),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-sign-last-not-boolean",
        ("COD-4",),
        "Tensor w (zstd, F32): 'sign_last' is the integer 1, not a boolean.",
        _tampered(sign_last_not_boolean),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-config-unknown-member",
        ("COD-4",),
        "Tensor w (zstd): its configuration has a member 'delta' that spec/codecs.md does not define.",
        _tampered(unknown_member),
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "zstd-expansion-bomb",
        ("COD-4",),
        "Tensor w (zstd): its shape and 'frame_bytes' scaled by 2**36 (the frame count still agrees): hundreds of "
        "TiB claimed from 10 KiB stored, more than zstd can expand; refused before anything is allocated.",
        _bomb,
        base="zstd",
        scope="tensor",
    ),
    Invalid(
        "codec-unknown-encoded",
        ("TEN-14",),
        "Tensor w's chunk is a U8 entry of zstd bytes, its codec renamed 'org.example.zstd2'.",
        _rename_codec,
        base="zstd",
        scope="tensor",
    ),
)
