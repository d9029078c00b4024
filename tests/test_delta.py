"""Delta chunks: the ``xor-zstd`` codec (spec/delta.md, DLT-1 to DLT-7; issue 44).

The codec round-trips bit-exactly over random bases, targets, dtypes, shapes and frame sizes, on its own and through
a save and a load; a base that is not the checkpoint the delta was taken against is refused, naming the tensor; a
partial read decodes only the frames it needs and the same range of the base; chains stop at MAX_DEPTH; the
manifest lists every base of every chain, so retention keeps them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import codecs
from ckptfmt.codecs import WriteCodec
from ckptfmt.codecs.xor_zstd import MAX_DEPTH, BaseChunk, DeltaSource, XorConfiguration, XorOptions, XorZstdCodec
from ckptfmt.codecs.zstd import ZstdOptions
from ckptfmt.errors import BaseCheckpointError, DigestMismatchError, ManifestError, UnsupportedCodecError, UsageError
from ckptfmt.manifest import Codec
from ckptfmt.run import RunDirectory

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": "bfloat16"}


def _array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    values = rng.standard_normal(shape)
    if dtype == "BF16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16)
    return values.astype(DTYPES[dtype])


def _nudged(rng: np.random.Generator, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` with a few low bits of some elements changed, as a training step changes weights."""
    bits = array.view(f"u{array.dtype.itemsize}").copy()
    mask = rng.random(bits.shape) < 0.5
    bits[mask] ^= np.asarray(rng.integers(0, 16, size=int(mask.sum())), dtype=bits.dtype)
    return bits.view(array.dtype)


def _bits(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}")


def _source(base: bytes) -> DeltaSource:
    chunk = BaseChunk(
        path="weights/r00000-00000.safetensors",
        key="w",
        begin=8,
        end=8 + len(base),
        digest="xxh3-128:" + "0" * 32,
        codec=Codec(),
    )
    return DeltaSource(location="../step-1", chunk=chunk, read=lambda: memoryview(base))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["F32", "F16", "F64", "BF16"]),
    n=st.integers(1, 3000),
    frame_elements=st.integers(1, 700),
    seed=st.integers(0, 2**32 - 1),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_codec_round_trips_bit_exactly_over_random_bases_targets_and_ranges(
    dtype: str, n: int, frame_elements: int, seed: int, cut: tuple[float, float]
) -> None:
    rng = np.random.default_rng(seed)
    base = _array(rng, dtype, (n,))
    target = _nudged(rng, base) if seed % 2 else _array(rng, dtype, (n,))  # close, or unrelated
    itemsize = base.dtype.itemsize
    codec = XorZstdCodec()
    options = XorOptions(zstd=ZstdOptions(frame_bytes=frame_elements * itemsize), source=_source(base.tobytes()))
    encoded = codec.encode(memoryview(target.tobytes()), dtype=dtype, itemsize=itemsize, options=options)
    stored = b"".join(bytes(p) for p in encoded.parts)
    assert encoded.configuration is not None
    record = Codec(name="xor-zstd", configuration=encoded.configuration.to_dict())
    first = min(int(cut[0] * n), n - 1)  # a random run of whole elements, at least one
    count = max(1, int(cut[1] * (n - first)))
    lo, hi = first * itemsize, (first + count) * itemsize
    span = codec.plan_frames(record, stored_size=len(stored), raw_size=n * itemsize, raw_begin=lo, raw_end=hi)
    assert span.raw_begin <= lo and hi <= span.raw_end  # only the frames the range needs
    out = memoryview(bytearray(span.raw_end - span.raw_begin))
    codec.decode_into(record, memoryview(stored)[span.stored_begin : span.stored_end], span, out, itemsize=itemsize)
    xored = np.frombuffer(out, np.uint8) ^ np.frombuffer(base.tobytes()[span.raw_begin : span.raw_end], np.uint8)
    assert xored.tobytes()[lo - span.raw_begin : hi - span.raw_begin] == target.tobytes()[lo:hi]


def _save(
    path: Path,
    tensors: dict[str, np.ndarray[Any, Any]],
    *,
    codec: object,
    base: Path | None = None,
    digest: str = "xxh3-128-tree",
) -> str:
    with ckptfmt.open_writer(path, profile="weights", codec=codec, base=base, digest=digest) as w:  # type: ignore[arg-type]
        w.write_tensors("weights", tensors)
    assert w.checkpoint_id is not None
    return w.checkpoint_id


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(["F32", "BF16", "F16", "F64"]),
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    frame_elements=st.integers(1, 400),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_delta_save_loads_bit_exactly(
    tmp_path: Path, dtype: str, shape: tuple[int, ...], frame_elements: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    run = Path(tempfile.mkdtemp(dir=tmp_path))  # an example hypothesis replays gets a directory of its own
    first = _array(rng, dtype, (64, 64))  # 4 KiB and more: encoded
    second = {"big": _nudged(rng, first), "any": _array(rng, dtype, shape)}
    itemsize = first.dtype.itemsize
    codec = WriteCodec(name="xor-zstd", options=XorOptions(zstd=ZstdOptions(frame_bytes=frame_elements * itemsize)))
    _save(run / "step-1", {"big": first, "any": _array(rng, dtype, shape)}, codec="zstd")
    _save(run / "step-2", second, codec=codec, base=run / "step-1")
    with ckptfmt.open(run / "step-2") as ckpt:
        assert ckpt.tensor("weights", "big").chunks[0].codec.name == "xor-zstd"
        for name, array in second.items():
            assert np.array_equal(_bits(ckpt.read_tensor("weights", name)), _bits(array))


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray[Any, Any]]]:
    """step-1 (zstd) and step-2 (xor-zstd against it): w in frames of 4 KiB in both, b unchanged, n integers (raw)."""
    rng = np.random.default_rng(7)
    w = _array(rng, "F32", (256, 64))
    frames = WriteCodec(name="zstd", options=ZstdOptions(frame_bytes=4096))
    _save(tmp_path / "step-1", {"w": w, "b": np.arange(2048, dtype=np.float32), "n": np.arange(8)}, codec=frames)
    second = {"w": _nudged(rng, w), "b": np.arange(2048, dtype=np.float32), "n": np.arange(8) + 1}
    small = WriteCodec(name="xor-zstd", options=XorOptions(zstd=ZstdOptions(frame_bytes=4096)))
    _save(tmp_path / "step-2", second, codec=small, base=tmp_path / "step-1")
    return tmp_path, second


def test_a_delta_chunk_is_smaller_and_says_format_1_3(run: tuple[Path, dict[str, np.ndarray[Any, Any]]]) -> None:
    """DLT-7, and what the codec is for: a nudged tensor stores far less as a delta than alone."""
    root, tensors = run
    with ckptfmt.open(root / "step-1") as one, ckptfmt.open(root / "step-2") as two:
        assert two.format_version == "1.3"
        assert two.tensor("weights", "w").chunks[0].nbytes < 0.7 * one.tensor("weights", "w").chunks[0].nbytes
    # DLT-7 apart from tree digests (which say 1.3 by themselves, TRE-1): with flat digests, zstd is 1.1
    _save(root / "flat-1", tensors, codec="zstd", digest="xxh3-128")
    nudged = {k: v + np.ones_like(v) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    _save(root / "flat-2", nudged, codec="xor-zstd", base=root / "flat-1", digest="xxh3-128")
    with ckptfmt.open(root / "flat-1") as one, ckptfmt.open(root / "flat-2") as two:
        assert (one.format_version, two.format_version) == ("1.1", "1.3")
        assert two.tensor("weights", "w").chunks[0].codec.name == "xor-zstd"


def test_a_replaced_base_is_refused_naming_the_tensor(run: tuple[Path, dict[str, np.ndarray[Any, Any]]]) -> None:
    """DLT-5 with REF-7: the base there now is another checkpoint (same names, same shapes): never XORed."""
    root, _ = run
    shutil.rmtree(root / "step-1")
    rng = np.random.default_rng(8)
    other = {"w": _array(rng, "F32", (256, 64)), "b": np.zeros(2048, np.float32), "n": np.arange(8)}
    _save(root / "step-1", other, codec="zstd")
    with ckptfmt.open(root / "step-2") as ckpt, pytest.raises(BaseCheckpointError) as info:
        ckpt.read_tensor("weights", "w")
    assert info.value.requirement == "REF-7" and info.value.tensor == "w" and "replaced" in info.value.message


def test_a_base_chunk_that_is_not_the_recorded_one_is_refused(
    run: tuple[Path, dict[str, np.ndarray[Any, Any]]],
) -> None:
    """DLT-4: the configuration's digest of the base chunk is checked before the XOR."""
    root, _ = run
    manifest = root / "step-2" / "manifest.json"
    text = manifest.read_text()
    with ckptfmt.open(root / "step-2") as ckpt:
        config = ckpt.tensor("weights", "w").chunks[0].codec.configuration
        assert config is not None
        digest = XorConfiguration.from_dict(config).chunk.digest
    manifest.write_text(text.replace(digest, digest[:-1] + ("0" if digest[-1] != "0" else "1")))
    with ckptfmt.open(root / "step-2") as ckpt, pytest.raises(DigestMismatchError) as info:
        ckpt.read_tensor("weights", "w")
    assert info.value.requirement == "DLT-4" and info.value.tensor == "w"


def test_a_partial_read_decodes_only_its_frames_and_the_same_range_of_the_base(
    run: tuple[Path, dict[str, np.ndarray[Any, Any]]],
) -> None:
    root, saved = run
    with ckptfmt.open(root / "step-2") as ckpt:
        rows = ckpt.read_slice("weights", "w", (100, 0), (3, 64))  # 768 bytes: one frame of 4 KiB
        assert np.array_equal(_bits(rows), _bits(saved["w"][100:103]))
        partial = ckpt.bytes_read
        whole = ckpt.read_tensor("weights", "w")
        assert np.array_equal(_bits(whole), _bits(saved["w"]))
        assert partial < (ckpt.bytes_read - partial) / 8  # 2 frames of 16 read, of the delta and of the base


def test_chains_end_at_max_depth_with_a_keyframe(tmp_path: Path) -> None:
    """DLT-3 on the writer's side: a delta of a chunk already MAX_DEPTH deep is written whole (zstd)."""
    rng = np.random.default_rng(3)
    w = _array(rng, "BF16", (64, 64))
    _save(tmp_path / "s00", {"w": w}, codec="zstd")
    saved = {}
    for k in range(1, MAX_DEPTH + 3):
        w = _nudged(rng, w)
        saved[k] = w
        _save(tmp_path / f"s{k:02d}", {"w": w}, codec="xor-zstd", base=tmp_path / f"s{k - 1:02d}")
    names = []
    for k, array in saved.items():
        with ckptfmt.open(tmp_path / f"s{k:02d}") as ckpt:
            names.append(ckpt.tensor("weights", "w").chunks[0].codec.name)
            assert np.array_equal(_bits(ckpt.read_tensor("weights", "w")), _bits(array))
            bases = [b.location for b in ckpt.manifest.bases]
        assert len(bases) == (k if k <= MAX_DEPTH else k - MAX_DEPTH - 1)  # DLT-6: every base of the chain
    assert names == ["xor-zstd"] * MAX_DEPTH + ["zstd", "xor-zstd"]


def test_a_delta_checkpoint_records_every_base_of_its_chain_and_retention_keeps_them(tmp_path: Path) -> None:
    """DLT-6: the base records list the whole chain, so a gc that keeps the newest keeps every base it needs."""
    rng = np.random.default_rng(4)
    w = _array(rng, "F32", (64, 64))
    names = [ckptfmt.run.checkpoint_name(step) for step in range(4)]  # type: ignore[attr-defined]
    _save(tmp_path / names[0], {"w": w}, codec="zstd")
    for k in range(1, 4):
        w = _nudged(rng, w)
        _save(tmp_path / names[k], {"w": w}, codec="xor-zstd", base=tmp_path / names[k - 1])
    with ckptfmt.open(tmp_path / names[3]) as ckpt:
        assert [b.name for b in ckpt.manifest.bases] == names[:3]
    rd = RunDirectory(tmp_path)
    assert rd.gc(keep_last=1) == []
    with ckptfmt.open(tmp_path / names[3]) as ckpt:
        assert np.array_equal(ckpt.read_tensor("weights", "w"), w)


def test_a_reader_without_the_codec_refuses_only_the_delta_tensors(
    run: tuple[Path, dict[str, np.ndarray[Any, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What makes the codec fit a minor version: a 1.2 reader refuses the tensors that use it (TEN-14), no more."""
    root, saved = run
    monkeypatch.delitem(codecs._REGISTRY, "xor-zstd")
    with ckptfmt.open(root / "step-2") as ckpt:
        with pytest.raises(UnsupportedCodecError) as info:
            ckpt.read_tensor("weights", "w")
        assert info.value.requirement == "TEN-14" and info.value.tensor == "w"
        assert ckpt.tensor("weights", "n").chunks[0].codec.name == "raw"
        assert np.array_equal(ckpt.read_tensor("weights", "n"), saved["n"])


def test_malformed_and_too_deep_configurations_are_refused() -> None:
    """DLT-1 and DLT-3, checked before anything is allocated or read."""
    base = bytes(4096)
    encoded = XorZstdCodec().encode(
        memoryview(bytes(range(256)) * 16), dtype="F32", itemsize=4, options=XorOptions(source=_source(base))
    )
    assert encoded.configuration is not None
    good = encoded.configuration.to_dict()
    stored = encoded.nbytes

    def plan(config: dict[str, Any]) -> None:
        XorZstdCodec().plan_frames(
            Codec(name="xor-zstd", configuration=config), stored_size=stored, raw_size=4096, raw_begin=0, raw_end=4096
        )

    plan(good)
    for broken in (
        {k: v for k, v in good.items() if k != "chunk"},
        {**good, "base": 3},
        {**good, "chunk": {**good["chunk"], "range": [9, 8]}},  # type: ignore[dict-item]
        {**good, "chunk": {**good["chunk"], "digest": "md5:00"}},  # type: ignore[dict-item]
        {**good, "chunk": {**good["chunk"], "range": [8, 4000]}},  # type: ignore[dict-item]  (not 4096 raw bytes)
        {**good, "mystery": 1},
        {**good, "chunk": {**good["chunk"], "blocks": {"size": 4096, "digests": ""}}},  # type: ignore[dict-item]
    ):
        with pytest.raises(ManifestError) as info:
            plan(broken)
        assert info.value.requirement == "DLT-1", broken
    deep = dict(good)
    for _ in range(MAX_DEPTH):
        deep = {**good, "chunk": {**good["chunk"], "codec": {"name": "xor-zstd", "configuration": deep}}}  # type: ignore[dict-item]
    with pytest.raises(ManifestError) as info:
        plan(deep)
    assert info.value.requirement == "DLT-3"


def test_xor_zstd_needs_a_base(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="base="):
        ckptfmt.open_writer(tmp_path / "c", profile="weights", codec="xor-zstd")


def test_materialize_refuses_deltas_rather_than_copy_them_without_their_base(
    run: tuple[Path, dict[str, np.ndarray[Any, Any]]],
) -> None:
    from ckptfmt.materialize import materialize

    root, _ = run
    with pytest.raises(UsageError, match="deltas"):
        materialize(root / "step-2", root / "copy")
    assert not (root / "copy" / "manifest.json").exists()


def test_a_delta_of_a_chunk_the_base_references_names_the_checkpoint_that_stores_it(tmp_path: Path) -> None:
    """step-2 references step-1's raw w (unchanged); step-3's delta of w is taken against step-1's chunk, where the
    bytes are, and names step-1 (DLT-6); b is sharded in two chunks, each a delta of its own base chunk."""
    rng = np.random.default_rng(5)
    w, b = _array(rng, "F32", (64, 64)), _array(rng, "F16", (80, 64))

    def save(path: Path, w: np.ndarray[Any, Any], b: np.ndarray[Any, Any], **options: Any) -> None:
        with ckptfmt.open_writer(path, profile="weights", **options) as writer:
            writer.write_tensor("weights", "w", w)
            for lo in (0, 40):
                writer.write_tensor("weights", "b", b[lo : lo + 40], global_shape=(80, 64), offsets=(lo, 0))

    save(tmp_path / "step-1", w, b)
    save(tmp_path / "step-2", w, _nudged(rng, b), base=tmp_path / "step-1")
    w3, b3 = _nudged(rng, w), _nudged(rng, b)
    save(tmp_path / "step-3", w3, b3, base=tmp_path / "step-2", codec="xor-zstd")
    with ckptfmt.open(tmp_path / "step-3") as ckpt:
        (chunk,) = ckpt.tensor("weights", "w").chunks
        assert chunk.codec.configuration is not None and chunk.codec.configuration["base"] == "../step-1"
        assert [c.codec.name for c in ckpt.tensor("weights", "b").chunks] == ["xor-zstd", "xor-zstd"]
        assert [b.location for b in ckpt.manifest.bases] == ["../step-1", "../step-2"]
        assert np.array_equal(_bits(ckpt.read_tensor("weights", "w")), _bits(w3))
        assert np.array_equal(_bits(ckpt.read_tensor("weights", "b")), _bits(b3))
        assert np.array_equal(_bits(ckpt.read_slice("weights", "b", (30, 0), (20, 64))), _bits(b3[30:50]))
        assert ckpt.verify().ok


def test_a_chunk_without_the_same_chunk_in_the_base_is_a_keyframe(tmp_path: Path) -> None:
    """Another shape, another chunking or a tensor new since the base: written in zstd, as without a base."""
    rng = np.random.default_rng(6)
    _save(tmp_path / "step-1", {"w": _array(rng, "F32", (64, 64))}, codec="zstd", digest="xxh3-128")
    second = {"w": _array(rng, "F32", (64, 32)), "new": _array(rng, "F32", (64, 64))}
    _save(tmp_path / "step-2", second, codec="xor-zstd", base=tmp_path / "step-1", digest="xxh3-128")
    with ckptfmt.open(tmp_path / "step-2") as ckpt:
        assert {n: r.chunks[0].codec.name for n, r in ckpt.field("weights").tensors.items()} == {
            "w": "zstd",
            "new": "zstd",
        }
        assert ckpt.manifest.bases == () and ckpt.format_version != "1.3"
        for name, array in second.items():
            assert np.array_equal(ckpt.read_tensor("weights", name), array)


def test_a_partial_read_over_a_raw_base_checks_only_the_base_blocks_it_reads(tmp_path: Path) -> None:
    """DLT-4 with BLK-5: a raw keyframe with block digests (64 KiB, the default) is read over the blocks a slice
    touches; a byte flipped in another block is never read, one in a block read is caught."""
    rng = np.random.default_rng(9)
    w = _array(rng, "F32", (1024, 64))  # 256 KiB: 4 blocks
    _save(tmp_path / "step-1", {"w": w}, codec=None)
    w2 = _nudged(rng, w)
    small = WriteCodec(name="xor-zstd", options=XorOptions(zstd=ZstdOptions(frame_bytes=4096)))
    _save(tmp_path / "step-2", {"w": w2}, codec=small, base=tmp_path / "step-1")
    with ckptfmt.open(tmp_path / "step-2") as ckpt:
        config = ckpt.tensor("weights", "w").chunks[0].codec.configuration
        assert config is not None and "blocks" in config["chunk"]  # type: ignore[operator]
    with ckptfmt.open(tmp_path / "step-1") as base:
        begin = base.tensor("weights", "w").chunks[0].begin
    data = tmp_path / "step-1" / "weights" / "r00000-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[begin + 200 * 1024] ^= 1  # in block 3 (rows 800..)
    data.write_bytes(bytes(raw))  # (the file's own digest no longer matches: a verify would say so)
    with ckptfmt.open(tmp_path / "step-2") as ckpt:
        rows = ckpt.read_slice("weights", "w", (10, 0), (4, 64))  # block 0 only
        assert np.array_equal(_bits(rows), _bits(w2[10:14]))
        assert ckpt.bytes_read < 64 * 1024 + 2 * 4096
        with pytest.raises(DigestMismatchError) as info:
            ckpt.read_slice("weights", "w", (810, 0), (4, 64))
        assert info.value.requirement == "BLK-5" and info.value.tensor == "w"


def test_a_delta_of_a_base_chunk_of_several_tree_pieces_checks_its_tree_digest(tmp_path: Path) -> None:
    """DLT-4 under tree digests (1.3's default): a base chunk larger than one 64 KiB piece has a tree chunk digest,
    which the delta's reader recomputes over the base's stored bytes (it once took it for a flat one and refused)."""
    rng = np.random.default_rng(15)
    first = _array(rng, "F32", (300, 200))  # 240,000 bytes: four pieces
    _save(tmp_path / "step-1", {"w": first}, codec="zstd")
    second = _nudged(rng, first)
    _save(tmp_path / "step-2", {"w": second}, codec="xor-zstd", base=tmp_path / "step-1")
    with ckptfmt.open(tmp_path / "step-1") as base:
        assert base.tensor("weights", "w").chunks[0].digest.startswith("xxh3-128-tree:")
    with ckptfmt.open(tmp_path / "step-2") as ckpt:
        chunk = ckpt.tensor("weights", "w").chunks[0]
        assert chunk.codec.name == "xor-zstd"
        assert np.array_equal(_bits(ckpt.read_tensor("weights", "w")), _bits(second))
    assert ckptfmt.verify(str(tmp_path / "step-2")).ok
