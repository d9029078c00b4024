"""read(write(x)) == x, bit for bit: every dtype, odd shapes and layouts, torch inputs, sharded tensors."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import dtypes
from ckptfmt.errors import UsageError

PROVENANCE = {"writer": {"name": "ckptfmt-tests", "version": "1"}, "created_at": "2026-01-02T03:04:05Z"}
HYPOTHESIS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def random_array(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray[Any, Any]:
    """Random bit patterns of dtype ``name`` (NaNs, infinities, subnormals included); bools are 0/1."""
    rng = np.random.default_rng(seed)
    dtype = dtypes.to_numpy(name)
    count = int(np.prod(shape, dtype=np.int64))
    if name == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def bits(array: np.ndarray[Any, Any]) -> bytes:
    a = array.astype(array.dtype.newbyteorder("<")) if array.dtype.byteorder == ">" else array
    return np.ascontiguousarray(a).tobytes()


def assert_identical(actual: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype.newbyteorder("<")
    assert bits(actual) == bits(expected)


def write_fields(url: str, fields: dict[str, dict[str, object]], **options: Any) -> str:
    with ckptfmt.open_writer(url, profile="weights", **options) as w:
        if "weights" not in fields:
            w.write_tensors("weights", {})
        for field, tensors in fields.items():
            w.write_tensors(field, tensors)
        w.write_context("provenance", PROVENANCE)
    assert w.checkpoint_id is not None
    return w.checkpoint_id


# ---------------------------------------------------------------- dtypes and shapes


def test_dtype_table_covers_bf16_and_every_fp8() -> None:
    for name in ("BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "BOOL", "C64"):
        assert name in dtypes.DTYPES


def test_every_dtype_round_trips_bit_for_bit(store_url: str) -> None:
    arrays = {name: random_array(name, (5, 7), seed=i) for i, name in enumerate(dtypes.DTYPES)}
    write_fields(store_url, {"weights": arrays})
    ckpt = ckptfmt.open(store_url)
    for name, expected in arrays.items():
        assert ckpt.tensor("weights", name).dtype == name
        actual = ckpt.read_tensor("weights", name)
        assert actual.dtype == dtypes.to_numpy(name)
        assert_identical(actual, expected)


def test_nan_payloads_survive(store_url: str) -> None:
    # Distinct NaN payloads and a negative zero: a value comparison would miss a change here.
    f32 = np.array([0x7FC00001, 0xFFC00002, 0x7F800001, 0x80000000], dtype=np.uint32).view(np.float32)
    bf16 = np.array([0x7FC1, 0xFFC2, 0x8000], dtype=np.uint16).view(ml_dtypes.bfloat16)
    write_fields(store_url, {"weights": {"f32": f32, "bf16": bf16}})
    ckpt = ckptfmt.open(store_url)
    assert_identical(ckpt.read_tensor("weights", "f32"), f32)
    assert_identical(ckpt.read_tensor("weights", "bf16"), bf16)


@pytest.mark.parametrize("name", dtypes.DTYPES)
def test_zero_d_and_empty_tensors(store_url: str, name: str) -> None:
    tensors = {
        "scalar": random_array(name, (), seed=1),
        "empty": random_array(name, (0,), seed=2),
        "empty3d": random_array(name, (3, 0, 2), seed=3),
    }
    write_fields(store_url, {"weights": tensors})
    ckpt = ckptfmt.open(store_url)
    for tname, expected in tensors.items():
        record = ckpt.tensor("weights", tname)
        assert record.shape == expected.shape
        assert len(record.chunks) == 1
        assert_identical(ckpt.read_tensor("weights", tname), expected)
    assert ckpt.tensor("weights", "empty").chunks[0].nbytes == 0
    assert ckptfmt.verify(store_url).ok


def test_numpy_scalar_is_a_zero_d_tensor(store_url: str) -> None:
    write_fields(store_url, {"weights": {"s": np.float64(1.5)}})
    out = ckptfmt.open(store_url).read_tensor("weights", "s")
    assert out.shape == () and out.dtype == np.float64 and out == 1.5


def test_large_tensor(store_url: str) -> None:
    data = np.frombuffer(np.random.default_rng(0).bytes(64 << 20), dtype=np.float32).reshape(4096, 4096)
    write_fields(store_url, {"weights": {"big": data}})
    out = ckptfmt.open(store_url).read_tensor("weights", "big")
    assert_identical(out, data)


def test_read_tensor_returns_a_writable_array(store_url: str) -> None:
    write_fields(store_url, {"weights": {"w": np.arange(6, dtype=np.int16).reshape(2, 3)}})
    out = ckptfmt.open(store_url).read_tensor("weights", "w")
    assert out.flags.writeable and out.flags.c_contiguous
    out[0, 0] = 42


NON_CONTIGUOUS: dict[str, Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]] = {
    "strided": lambda a: a[::2, 1::3],
    "transposed": lambda a: a.T,
    "reversed": lambda a: a[::-1, ::-1],
    "fortran": np.asfortranarray,
    "column": lambda a: a[:, 2],
}


@pytest.mark.parametrize("layout", NON_CONTIGUOUS)
@pytest.mark.parametrize("name", ["F32", "BF16", "C64", "F8_E4M3", "I64"])
def test_non_contiguous_arrays(store_url: str, layout: str, name: str) -> None:
    base = random_array(name, (6, 9), seed=4)
    view = NON_CONTIGUOUS[layout](base)
    assert not view.flags.c_contiguous or layout == "fortran"
    write_fields(store_url, {"weights": {"v": view}})
    assert_identical(ckptfmt.open(store_url).read_tensor("weights", "v"), np.ascontiguousarray(view))


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i2", ">u4", ">i8", ">c8", ">f2"])
def test_big_endian_arrays_are_stored_little_endian(store_url: str, dtype: str) -> None:
    native = np.arange(-12, 12).reshape(4, 6).astype(dtype.replace(">", "<"))
    big = native.astype(dtype)
    write_fields(store_url, {"weights": {"be": big}})
    ckpt = ckptfmt.open(store_url)
    out = ckpt.read_tensor("weights", "be")
    assert out.dtype == np.dtype(dtype.replace(">", "<"))
    np.testing.assert_array_equal(out, native)
    # what is stored is the little-endian bytes
    chunk = ckpt.tensor("weights", "be").chunks[0]
    stored = ckpt.store.read(chunk.path)[chunk.begin : chunk.end]
    assert stored == native.tobytes()


def test_big_endian_non_contiguous(store_url: str) -> None:
    native = np.arange(40, dtype="<f8").reshape(5, 8)
    big = native.astype(">f8")[::2, ::-3]
    write_fields(store_url, {"weights": {"x": big}})
    np.testing.assert_array_equal(ckptfmt.open(store_url).read_tensor("weights", "x"), native[::2, ::-3])


# ---------------------------------------------------------------- torch in, numpy out

TORCH_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}


def torch_random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def torch_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=str)
def test_torch_tensors_read_back_as_numpy(store_url: str, dtype: torch.dtype) -> None:
    t = torch_random(dtype, (3, 5), seed=7)
    write_fields(store_url, {"weights": {"t": t}})
    ckpt = ckptfmt.open(store_url)
    assert ckpt.tensor("weights", "t").dtype == TORCH_DTYPES[dtype]
    out = ckpt.read_tensor("weights", "t")
    assert isinstance(out, np.ndarray)
    assert out.dtype == dtypes.to_numpy(TORCH_DTYPES[dtype])
    assert out.shape == (3, 5)
    assert out.tobytes() == torch_bits(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_non_contiguous_torch_tensors(store_url: str, dtype: torch.dtype) -> None:
    base = torch_random(dtype, (6, 8), seed=3)
    views = {"transposed": base.t(), "strided": base[::2, 1::3], "narrowed": base.narrow(1, 2, 3)}
    for v in views.values():
        assert not v.is_contiguous()
    write_fields(store_url, {"weights": views})
    ckpt = ckptfmt.open(store_url)
    for name, v in views.items():
        out = ckpt.read_tensor("weights", name)
        assert out.shape == tuple(v.shape)
        assert out.tobytes() == torch_bits(v)


def test_torch_zero_d_and_requires_grad(store_url: str) -> None:
    param = torch.nn.Parameter(torch.randn(4, 2))
    write_fields(store_url, {"weights": {"p": param, "s": torch.tensor(3.5, dtype=torch.bfloat16)}})
    ckpt = ckptfmt.open(store_url)
    assert ckpt.read_tensor("weights", "p").tobytes() == torch_bits(param.detach())
    s = ckpt.read_tensor("weights", "s")
    assert s.shape == () and s.dtype == ml_dtypes.bfloat16 and float(s) == 3.5


# ---------------------------------------------------------------- sharded tensors


def write_chunks(
    url: str,
    full: np.ndarray[Any, Any],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    name: str = "t",
    **options: Any,
) -> None:
    with ckptfmt.open_writer(url, profile="weights", **options) as w:
        for offsets, shape in boxes:
            region = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
            w.write_tensor("weights", name, full[region], global_shape=full.shape, offsets=offsets)
        w.write_context("provenance", PROVENANCE)


def grid(splits: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of a grid; ``splits[d]`` are the cut points of dim d including 0 and the size."""
    per_dim = [[(lo, hi - lo) for lo, hi in itertools.pairwise(cuts)] for cuts in splits]
    return [
        (tuple(o for o, _ in combo), tuple(s for _, s in combo))
        for combo in itertools.product(*per_dim)  # type: ignore[arg-type]
    ]


def test_uneven_1d_chunks(store_url: str) -> None:
    full = np.arange(11, dtype=np.int32)
    write_chunks(store_url, full, [((10,), (1,)), ((3,), (7,)), ((0,), (3,))])
    ckpt = ckptfmt.open(store_url)
    record = ckpt.tensor("weights", "t")
    assert record.shape == (11,)
    assert [c.offsets for c in record.chunks] == [(0,), (3,), (10,)]
    np.testing.assert_array_equal(ckpt.read_tensor("weights", "t"), full)
    np.testing.assert_array_equal(ckpt.read_slice("weights", "t", (2,), (6,)), full[2:8])
    np.testing.assert_array_equal(ckpt.read_slice("weights", "t", (10,), (1,)), full[10:])


@pytest.mark.parametrize("target", [1 << 30, 100, 1])
def test_2d_grid_of_uneven_chunks(store_url: str, target: int) -> None:
    full = random_array("BF16", (7, 10), seed=5)
    boxes = grid([[0, 2, 7], [0, 3, 4, 10]])
    write_chunks(store_url, full, boxes[::-1], target_file_size=target)
    ckpt = ckptfmt.open(store_url)
    record = ckpt.tensor("weights", "t")
    assert len(record.chunks) == 6
    assert {(c.offsets, c.shape) for c in record.chunks} == set(boxes)
    if target == 1:
        assert len({c.path for c in record.chunks}) == 6
    assert_identical(ckpt.read_tensor("weights", "t"), full)
    regions = [
        ((0, 0), (7, 10)),  # everything
        ((0, 0), (2, 3)),  # exactly one chunk
        ((1, 2), (3, 5)),  # across all four inner boundaries
        ((6, 9), (1, 1)),  # one element
        ((3, 0), (4, 10)),  # a band of rows
        ((0, 3), (7, 1)),  # the one-wide column chunk
        ((5, 5), (0, 3)),  # empty
    ]
    for offsets, shape in regions:
        expected = full[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
        assert_identical(ckpt.read_slice("weights", "t", offsets, shape), expected)
    assert ckptfmt.verify(store_url).ok


def test_sharded_chunks_are_stored_under_distinct_keys(store_url: str) -> None:
    full = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_chunks(store_url, full, grid([[0, 3], [0, 1, 4]]))
    chunks = ckptfmt.open(store_url).tensor("weights", "t").chunks
    assert sorted(c.key for c in chunks) == ["t@0,0", "t@0,1"]


def test_read_slice_outside_the_tensor_is_a_usage_error(store_url: str) -> None:
    write_chunks(store_url, np.zeros((4, 4), np.float32), grid([[0, 2, 4], [0, 4]]))
    ckpt = ckptfmt.open(store_url)
    for offsets, shape in [((3, 0), (2, 1)), ((0,), (1,)), ((-1, 0), (1, 1))]:
        with pytest.raises(UsageError):
            ckpt.read_slice("weights", "t", offsets, shape)


def test_empty_sharded_tensor(store_url: str) -> None:
    full = np.zeros((0, 5), np.float16)
    write_chunks(store_url, full, [((0, 0), (0, 5))])
    out = ckptfmt.open(store_url).read_tensor("weights", "t")
    assert out.shape == (0, 5) and out.dtype == np.float16


# ---------------------------------------------------------------- target file size


def test_target_file_size_splits_a_field_over_several_files(store_url: str) -> None:
    tensors = {f"t{i:02d}": np.full(250, i, dtype=np.float32) for i in range(10)}  # 1000 bytes each
    tensors["huge"] = np.arange(1000, dtype=np.float32)  # 4000 bytes: bigger than the target
    write_fields(store_url, {"weights": tensors, "other": {"x": np.ones(3, np.int8)}}, target_file_size=2500)
    ckpt = ckptfmt.open(store_url)
    by_file: dict[str, list[str]] = {}
    for name, record in ckpt.fields["weights"].tensors.items():
        (chunk,) = record.chunks
        by_file.setdefault(chunk.path, []).append(name)
    assert len(by_file) == 6  # two 1000-byte tensors per file, and the big one alone
    assert ["huge"] in by_file.values()
    for path, names in by_file.items():
        assert path.startswith("weights/")
        data_bytes = sum(ckpt.tensor("weights", n).nbytes for n in names)
        assert data_bytes <= 2500 or len(names) == 1
    # fields never share a file
    other = {c.path for t in ckpt.fields["other"].tensors.values() for c in t.chunks}
    assert other.isdisjoint(by_file) and all(p.startswith("other/") for p in other)
    for name, expected in tensors.items():
        np.testing.assert_array_equal(ckpt.read_tensor("weights", name), expected)
    assert ckptfmt.verify(store_url).ok


# ---------------------------------------------------------------- property tests

FIELD_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: n not in ("provenance", "rng", "data", "config", "topology")
)
TENSOR_NAMES = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12).filter(
    lambda n: n != "__metadata__"
)
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    name = draw(st.sampled_from(dtypes.DTYPES))
    shape = draw(SHAPES)
    return random_array(name, shape, seed=draw(st.integers(0, 2**32 - 1)))


def fresh(base: str) -> str:
    """A new sub-root of a fixture root: one per hypothesis example."""
    return f"{base}/ex-{uuid.uuid4().hex}"


@HYPOTHESIS
@given(
    fields=st.dictionaries(FIELD_NAMES, st.dictionaries(TENSOR_NAMES, arrays(), max_size=4), min_size=1, max_size=3),
    target=st.sampled_from([1, 64, 1 << 30]),
)
def test_random_fields_round_trip(store_url: str, fields: dict[str, dict[str, Any]], target: int) -> None:
    url = fresh(store_url)
    write_fields(url, fields, target_file_size=target)
    ckpt = ckptfmt.open(url)
    for field, tensors in fields.items():
        assert set(ckpt.tensor_names(field)) == set(tensors)
        for name, expected in tensors.items():
            assert_identical(ckpt.read_tensor(field, name), expected)


Box = tuple[tuple[int, ...], tuple[int, ...]]


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A shape and a random guillotine tiling of it (not necessarily a grid)."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))

    def split(offsets: tuple[int, ...], size: tuple[int, ...], depth: int) -> list[Box]:
        cuttable = [d for d in range(len(size)) if size[d] > 1]
        if depth == 0 or not cuttable or not draw(st.booleans()):
            return [(offsets, size)]
        d = draw(st.sampled_from(cuttable))
        cut = draw(st.integers(1, size[d] - 1))
        lo_size = (*size[:d], cut, *size[d + 1 :])
        hi_off = (*offsets[:d], offsets[d] + cut, *offsets[d + 1 :])
        hi_size = (*size[:d], size[d] - cut, *size[d + 1 :])
        return split(offsets, lo_size, depth - 1) + split(hi_off, hi_size, depth - 1)

    boxes = split((0,) * len(shape), shape, 4)
    return shape, draw(st.permutations(boxes))


@HYPOTHESIS
@given(
    tiling=tilings(),
    name=st.sampled_from(dtypes.DTYPES),
    target=st.sampled_from([1, 40, 1 << 30]),
    data=st.data(),
)
def test_random_chunkings_round_trip(
    store_url: str, tiling: tuple[tuple[int, ...], list[Box]], name: str, target: int, data: st.DataObject
) -> None:
    shape, boxes = tiling
    url = fresh(store_url)
    full = random_array(name, shape, seed=data.draw(st.integers(0, 2**32 - 1)))
    write_chunks(url, full, boxes, target_file_size=target)
    ckpt = ckptfmt.open(url)
    assert len(ckpt.tensor("weights", "t").chunks) == len(boxes)
    assert_identical(ckpt.read_tensor("weights", "t"), full)
    offsets = tuple(data.draw(st.integers(0, g)) for g in shape)
    size = tuple(data.draw(st.integers(0, g - o)) for g, o in zip(shape, offsets, strict=True))
    region = tuple(slice(o, o + s) for o, s in zip(offsets, size, strict=True))
    assert_identical(ckpt.read_slice("weights", "t", offsets, size), full[region])
