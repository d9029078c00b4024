"""The codec registry and the zstd codec: round trips, random access by frame, bounded decoding."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zstandard

import ckptfmt
from ckptfmt.codecs import FrameSpan, WriteCodec, get_codec
from ckptfmt.codecs.zstd import FRAME_BYTES, ZstdConfiguration, ZstdOptions, group_bytes, ungroup_bytes
from ckptfmt.errors import DigestMismatchError, IntegrityError, ManifestError, UnsupportedCodecError, UsageError
from ckptfmt.manifest import Codec
from ckptfmt.storage import open_store
from ckptfmt.writer import CheckpointWriter


def _save(
    path: Path, tensors: dict[str, np.ndarray], codec: str | None = "zstd", digest: str = "xxh3-128"
) -> ckptfmt.Checkpoint:
    """Flat digests unless asked: VER-1's versions of codecs are 1.1 and 1.0 without tree digests (1.3)."""
    with CheckpointWriter(open_store(str(path)), profile="weights", codec=codec, digest=digest) as w:
        w.write_tensors("weights", tensors)
    return ckptfmt.open(str(path))


@pytest.mark.parametrize("sign_last", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.uint8])
def test_group_bytes_round_trip(dtype: object, sign_last: bool) -> None:
    a = np.random.default_rng(1).standard_normal(1001).astype(dtype)  # type: ignore[call-overload]
    raw = memoryview(a.tobytes())
    planes = group_bytes(raw, a.itemsize, sign_last=sign_last)
    out = bytearray(len(raw))
    ungroup_bytes(bytes(planes), a.itemsize, memoryview(out), sign_last=sign_last)
    assert bytes(out) == bytes(raw)
    if a.itemsize > 1 and not sign_last:  # the most significant byte of the first element leads
        assert planes[0] == raw[a.itemsize - 1]


def test_sign_last_puts_the_exponent_in_the_high_plane() -> None:
    a = np.array([-1.5, 2.0, -0.0, 3.0e-3], dtype=ml_dtypes.bfloat16)
    bits = a.view(np.uint16)
    planes = bytes(group_bytes(memoryview(a.tobytes()), 2, sign_last=True))
    assert list(planes[:4]) == [int(b >> 7) & 0xFF for b in bits]  # the 8 exponent bits, nothing else
    assert list(planes[4:]) == [int(b & 0x7F) << 1 | int(b >> 15) for b in bits]  # mantissa, then the sign


def test_zstd_checkpoint_round_trip_and_slices(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((1200, 1100)).astype(np.float32),  # > one frame
        "bf16": rng.standard_normal((700, 300)).astype(ml_dtypes.bfloat16),
        "i64": np.arange(5000, dtype=np.int64),
        "tiny": np.float32([1.5, 2.5]),
    }
    ckpt = _save(tmp_path / "c", tensors)
    assert ckpt.format_version == "1.1"
    chunks = {n: t.chunks[0] for n, t in ckpt.fields["weights"].tensors.items()}
    assert {n: c.codec.name for n, c in chunks.items()} == {"f32": "zstd", "bf16": "zstd", "i64": "raw", "tiny": "raw"}
    assert chunks["f32"].codec.configuration is not None
    assert chunks["f32"].codec.configuration["sign_last"] is True
    assert len(chunks["f32"].codec.configuration["frames"]) == -(-tensors["f32"].nbytes // FRAME_BYTES)  # type: ignore[arg-type]
    # encoded and raw chunks never share a data file
    assert chunks["f32"].path != chunks["i64"].path and chunks["f32"].path == chunks["bf16"].path
    got = ckpt.read_tensors("weights")
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), name
    # a slice in the last frame fetches that frame's stored bytes only
    before = ckpt.bytes_read
    part = ckpt.read_slice("weights", "f32", (1190, 3), (4, 5))
    assert np.array_equal(part, tensors["f32"][1190:1194, 3:8])
    frames = chunks["f32"].codec.configuration["frames"]
    assert ckpt.bytes_read - before == frames[-1]  # type: ignore[index]
    assert ckpt.verify().ok
    assert ckpt.read_tensor("weights", "f32", verify=False).tobytes() == tensors["f32"].tobytes()


def test_zstd_compresses_floats(tmp_path: Path) -> None:
    a = (np.random.default_rng(2).standard_normal(1 << 20) * 0.02).astype(np.float32)
    ckpt = _save(tmp_path / "c", {"w": a})
    assert ckpt.fields["weights"].tensors["w"].chunks[0].nbytes < 0.9 * a.nbytes


def test_raw_save_is_version_1_0(tmp_path: Path) -> None:
    ckpt = _save(tmp_path / "c", {"w": np.ones(5000, np.float32)}, codec=None)
    assert ckpt.format_version == "1.0"
    assert ckpt.fields["weights"].tensors["w"].chunks[0].codec.name == "raw"


def test_write_codec_parse() -> None:
    assert WriteCodec.parse("zstd:3") == WriteCodec(name="zstd", options=ZstdOptions(level=3))
    assert WriteCodec.parse(None).name == "raw"
    with pytest.raises(UsageError):
        WriteCodec.parse("lz4")
    with pytest.raises(UsageError):
        WriteCodec.parse("zstd:x")
    with pytest.raises(UsageError, match="takes no options"):  # (before the codecs' own options: accepted, ignored)
        WriteCodec.parse("raw:3")


def test_zstd_configuration_round_trip_and_refusals() -> None:
    config = ZstdConfiguration(frame_bytes=4096, frames=(100, 50), bytegroup=True, sign_last=True, level=3)
    assert config.to_dict() == {
        "bytegroup": True,
        "frame_bytes": 4096,
        "frames": [100, 50],
        "sign_last": True,
        "level": 3,
    }
    assert ZstdConfiguration.from_dict(config.to_dict()) == config
    good = config.to_dict()
    for member, value in (("frame_bytes", 0), ("frames", [0]), ("bytegroup", 1), ("sign_last", "yes"), ("delta", 1)):
        with pytest.raises(ManifestError, match=member) as info:
            ZstdConfiguration.from_dict({**good, member: value})
        assert info.value.requirement == "COD-4"
    assert ZstdConfiguration.from_dict({**good, "level": "x"}).level is None  # informative: never refused


def _rewrite_manifest(path: Path, edit: object) -> None:
    doc = json.loads((path / "manifest.json").read_text())
    edit(doc)  # type: ignore[operator]
    (path / "manifest.json").write_text(json.dumps(doc))


def _chunk(doc: dict, name: str) -> dict:  # type: ignore[type-arg]
    return doc["fields"]["weights"]["tensors"][name]["chunks"][0]  # type: ignore[no-any-return]


def test_unknown_codec_refuses_that_tensor_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal(5000).astype(np.float32), "b": rng.standard_normal(5000).astype(np.float32)}
    _save(tmp_path / "c", tensors)
    _rewrite_manifest(tmp_path / "c", lambda d: _chunk(d, "a")["codec"].update(name="org.example.lz9"))
    ckpt = ckptfmt.open(str(tmp_path / "c"))
    with pytest.raises(UnsupportedCodecError) as info:
        ckpt.read_tensor("weights", "a")
    assert info.value.tensor == "a" and info.value.requirement == "TEN-14"
    assert ckpt.read_tensor("weights", "b").tobytes() == tensors["b"].tobytes()


def test_bad_frame_index_is_refused(tmp_path: Path) -> None:
    _save(tmp_path / "c", {"a": np.random.default_rng(4).standard_normal(5000).astype(np.float32)})
    _rewrite_manifest(tmp_path / "c", lambda d: _chunk(d, "a")["codec"]["configuration"]["frames"].append(1))
    with pytest.raises(ManifestError) as info:
        ckptfmt.open(str(tmp_path / "c")).read_tensor("weights", "a")
    assert info.value.requirement == "COD-4" and info.value.tensor == "a"


def test_frame_declaring_more_than_stated_is_refused_before_decoding() -> None:
    codec = get_codec("zstd")
    # a bomb: 64 MiB of zeros in a few KiB, its header declaring that size
    bomb = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(64 << 20))
    config = Codec(name="zstd", configuration={"frame_bytes": 4096, "frames": [len(bomb)], "bytegroup": False})
    span = codec.plan_frames(config, stored_size=len(bomb), raw_size=4096, raw_begin=0, raw_end=4096)
    with pytest.raises(IntegrityError) as info:
        codec.decode_into(config, memoryview(bomb), span, memoryview(bytearray(4096)), itemsize=1)
    assert "declares 67108864" in info.value.message


def test_frame_without_checksum_or_with_trailing_bytes_is_refused() -> None:
    codec = get_codec("zstd")
    data = bytes(range(256)) * 16
    for frame in (
        zstandard.ZstdCompressor(write_checksum=False).compress(data),
        zstandard.ZstdCompressor(write_checksum=True).compress(data) + b"\0",
    ):
        config = Codec(name="zstd", configuration={"frame_bytes": 4096, "frames": [len(frame)], "bytegroup": False})
        span = codec.plan_frames(config, stored_size=len(frame), raw_size=4096, raw_begin=0, raw_end=4096)
        with pytest.raises(IntegrityError):
            codec.decode_into(config, memoryview(frame), span, memoryview(bytearray(4096)), itemsize=1)


def test_a_planned_span_carries_its_parsed_configuration_to_the_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_frames parses and checks the configuration once; decode_into uses what it parsed (a chunk read
    in many pieces is not parsed again per piece), and parses the record itself for a span it did not plan."""
    codec = get_codec("zstd")
    raw = np.random.default_rng(6).standard_normal(3 * 1024).astype(np.float32)
    encoded = codec.encode(memoryview(raw).cast("B"), dtype="F32", itemsize=4, options=ZstdOptions(frame_bytes=4096))
    stored = b"".join(bytes(p) for p in encoded.parts)
    assert encoded.configuration is not None
    record = Codec(name="zstd", configuration=encoded.configuration.to_dict())
    parsed = []
    original = ZstdConfiguration.from_dict.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        ZstdConfiguration, "from_dict", classmethod(lambda cls, c: parsed.append(1) or original(cls, c))
    )
    span = codec.plan_frames(record, stored_size=len(stored), raw_size=raw.nbytes, raw_begin=4096, raw_end=8192)
    part = memoryview(stored)[span.stored_begin : span.stored_end]
    out = bytearray(span.raw_end - span.raw_begin)
    codec.decode_into(record, part, span, memoryview(out), itemsize=4)
    assert bytes(out) == raw.tobytes()[4096:8192] and len(parsed) == 1
    bare = FrameSpan(stored_begin=span.stored_begin, stored_end=span.stored_end, raw_begin=4096, raw_end=8192)
    codec.decode_into(record, part, bare, memoryview(out), itemsize=4)
    assert bytes(out) == raw.tobytes()[4096:8192] and len(parsed) == 2


def test_verify_checks_codecs_and_frames(tmp_path: Path) -> None:
    a = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    _save(tmp_path / "c", {"a": a, "b": a + 1})
    assert ckptfmt.verify(str(tmp_path / "c")).ok
    _rewrite_manifest(tmp_path / "c", lambda d: _chunk(d, "a")["codec"].update(name="org.example.lz9"))
    report = ckptfmt.verify(str(tmp_path / "c"))
    assert [(p.code, p.tensor) for p in report.problems] == [("unsupported_codec", "a")]
    _rewrite_manifest(tmp_path / "c", lambda d: _chunk(d, "a")["codec"].update(name="zstd"))
    _rewrite_manifest(tmp_path / "c", lambda d: _chunk(d, "b")["codec"]["configuration"].update(frame_bytes=4096))
    report = ckptfmt.verify(str(tmp_path / "c"), quick=True)
    assert [(p.requirement, p.tensor) for p in report.problems] == [("COD-4", "b")]


VECTORS = Path(__file__).parent.parent / "conformance" / "vectors"


@pytest.mark.parametrize("name", sorted(p.name for p in VECTORS.glob("invalid/zstd-*")))
def test_verify_reports_each_invalid_zstd_vector(name: str, tmp_path: Path) -> None:
    expected = json.loads((VECTORS / "invalid" / name / "expected.json").read_text())
    report = ckptfmt.verify(str(VECTORS / "invalid" / name / "checkpoint"))
    assert [(p.requirement, p.tensor) for p in report.problems] == [(expected["requirements"][0], "w")]
    # every other tensor still reads
    ckpt = ckptfmt.open(str(VECTORS / "invalid" / name / "checkpoint"))
    for other in ckpt.tensor_names("weights"):
        if other != "w":
            ckpt.read_tensor("weights", other)


def test_mmap_read_is_zero_copy_and_read_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    tensors = {"w": rng.standard_normal((300, 200)).astype(np.float32), "h": np.arange(6, dtype=np.int16)}
    ckpt = _save(tmp_path / "raw", tensors, codec=None)
    mapped = ckpt.read_tensor("weights", "w", mmap=True)
    assert not mapped.flags.writeable and mapped.base is not None
    assert mapped.tobytes() == tensors["w"].tobytes()
    with pytest.raises(ValueError):
        mapped[0, 0] = 1.0
    # a compressed tensor is read as usual: writable
    zckpt = _save(tmp_path / "z", tensors)
    copy = zckpt.read_tensor("weights", "w", mmap=True)
    assert copy.flags.writeable and copy.tobytes() == tensors["w"].tobytes()


def test_mmap_read_checks_the_digest(tmp_path: Path) -> None:
    a = np.random.default_rng(7).standard_normal(4096).astype(np.float32)
    ckpt = _save(tmp_path / "c", {"w": a}, codec=None)
    chunk = ckpt.fields["weights"].tensors["w"].chunks[0]
    data = tmp_path / "c" / chunk.path
    raw = bytearray(data.read_bytes())
    raw[chunk.begin + 5] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(DigestMismatchError) as info:
        ckptfmt.open(str(tmp_path / "c")).read_tensor("weights", "w", mmap=True)
    assert info.value.tensor == "w"


def test_ckpt_convert_codec_re_encodes_and_refuses_other_formats(tmp_path: Path) -> None:
    from cli_helpers import run_cli

    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((256, 64), dtype=np.float32), "ids": np.arange(100, dtype=np.int64)}
    src, dst = tmp_path / "src", tmp_path / "dst"
    with ckptfmt.open_writer(src, profile="weights") as w:
        w.write_tensors("weights", tensors)
    ran = run_cli("convert", str(src), str(dst), "--to", "ckptfmt", "--codec", "zstd", "--json")
    assert ran.exit_code == 0, ran.stderr
    ckpt = ckptfmt.open(dst)
    assert ckpt.tensor("weights", "w").chunks[0].codec.name == "zstd"
    assert ckpt.tensor("weights", "ids").chunks[0].codec.name == "raw"  # integers are stored raw
    assert all(np.array_equal(ckpt.read_tensor("weights", n), t) for n, t in tensors.items())
    assert ckpt.verify().ok
    back = run_cli("convert", str(dst), str(tmp_path / "raw"), "--to", "ckptfmt", "--codec", "raw")
    assert back.exit_code == 0, back.stderr
    assert ckptfmt.open(tmp_path / "raw").format_version == "1.3"  # tree digests, the default
    wrong = run_cli("convert", str(src), str(tmp_path / "hf"), "--to", "hf", "--codec", "zstd")
    assert wrong.exit_code == 2 and "re-encodes a ckptfmt checkpoint" in wrong.stderr
