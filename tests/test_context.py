"""Context blobs: the msgpack subset, its two extension types, and RNG states that must restore exactly."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import dtypes
from ckptfmt.context import EXT_BIGINT, EXT_NDARRAY, MAX_DEPTH, decode, encode
from ckptfmt.errors import ContextError, DTypeError

INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1


def round_trip(value: dict[str, Any]) -> dict[str, object]:
    return decode(encode(value))


# ---------------------------------------------------------------- plain values


def test_plain_values_round_trip() -> None:
    value = {
        "nil": None,
        "yes": True,
        "no": False,
        "int": -5,
        "float": 0.1,
        "str": "ünïcödé ✓ 😀",
        "empty_str": "",
        "bin": b"\x00\xff",
        "list": [1, "two", [3.5, None], {"k": []}],
        "map": {"nested": {"deeper": {}}},
    }
    assert round_trip(value) == value


def test_tuples_and_byte_likes_come_back_as_lists_and_bytes() -> None:
    out = round_trip({"t": (1, (2, 3)), "ba": bytearray(b"ab"), "mv": memoryview(b"cd")})
    assert out == {"t": [1, [2, 3]], "ba": b"ab", "mv": b"cd"}


def test_numpy_scalars_become_plain_values() -> None:
    out = round_trip({"i": np.int64(-3), "u": np.uint64(UINT64_MAX), "f": np.float32(0.5), "b": np.bool_(True)})
    assert out == {"i": -3, "u": UINT64_MAX, "f": 0.5, "b": True}
    assert type(out["b"]) is bool


def test_floats_are_written_as_float64() -> None:
    data = encode({"f": 0.1})
    assert b"\xcb" in data and b"\xca" not in data
    assert round_trip({"f": 0.1})["f"] == 0.1


def test_encoding_is_deterministic_whatever_the_key_order() -> None:
    a = {"b": 1, "a": {"y": 2, "x": 3}, "é": 4}
    b = {"é": 4, "a": {"x": 3, "y": 2}, "b": 1}
    assert encode(a) == encode(b)
    assert list(msgpack.unpackb(encode(a), raw=False)) == ["a", "b", "é"]


# ---------------------------------------------------------------- integers and the bigint extension

NATIVE_INTS = [0, 1, -1, INT64_MIN, UINT64_MAX, 1 << 63, -(1 << 31)]
BIG_INTS = [
    UINT64_MAX + 1,
    INT64_MIN - 1,
    1 << 127,
    (1 << 128) - 1,
    -(1 << 127),
    -(1 << 71),
    -(1 << 64),
    (1 << 71),
    (1 << 71) - 1,
    -(1 << 200) + 12345,
    3**200,
]


@pytest.mark.parametrize("value", NATIVE_INTS, ids=str)
def test_ints_in_the_64_bit_range_are_native(value: int) -> None:
    data = encode({"v": value})
    assert msgpack.unpackb(data, raw=False) == {"v": value}  # any msgpack reader sees a plain int
    assert round_trip({"v": value}) == {"v": value}


def minimal_length(value: int) -> int:
    """Bytes of the shortest big-endian two's complement form of ``value``."""
    return ((value if value >= 0 else ~value).bit_length() + 8) // 8


@pytest.mark.parametrize("value", BIG_INTS, ids=str)
def test_big_ints_use_the_bigint_extension(value: int) -> None:
    payloads: list[bytes] = []

    def hook(code: int, payload: bytes) -> object:
        assert code == EXT_BIGINT
        payloads.append(payload)
        return None

    msgpack.unpackb(encode({"v": value}), raw=False, ext_hook=hook)
    (payload,) = payloads
    assert int.from_bytes(payload, "big", signed=True) == value
    assert len(payload) == minimal_length(value)  # the spec says minimal length
    assert round_trip({"v": value}) == {"v": value}


def test_bigint_inside_lists_and_maps() -> None:
    value = {"a": [1 << 100, {"b": -(1 << 100)}]}
    assert round_trip(value) == value


# ---------------------------------------------------------------- the ndarray extension


@pytest.mark.parametrize("name", dtypes.DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 3), (2, 3, 4)], ids=str)
def test_ndarray_extension_round_trips_every_dtype(name: str, shape: tuple[int, ...]) -> None:
    dtype = dtypes.to_numpy(name)
    count = int(np.prod(shape, dtype=np.int64))
    if name == "BOOL":
        array = (np.arange(count) % 3 == 0).reshape(shape)
    else:
        array = np.arange(count * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    out = round_trip({"a": array})["a"]
    assert isinstance(out, np.ndarray)
    assert out.dtype == dtype and out.shape == shape
    assert out.tobytes() == array.tobytes()
    assert out.flags.writeable


def test_ndarray_extension_payload_is_documented_form() -> None:
    array = np.array([[1, 2, 3]], dtype=np.uint32)
    seen = []

    def hook(code: int, payload: bytes) -> object:
        seen.append((code, msgpack.unpackb(payload, raw=False)))
        return None

    msgpack.unpackb(encode({"a": array}), raw=False, ext_hook=hook)
    assert seen == [(EXT_NDARRAY, ["U32", [1, 3], array.tobytes()])]


def test_ndarray_big_endian_and_non_contiguous_inputs() -> None:
    native = np.arange(12, dtype="<i4").reshape(3, 4)
    out = round_trip({"be": native.astype(">i4"), "t": native.T, "s": native[:, ::2]})
    np.testing.assert_array_equal(out["be"], native)  # type: ignore[arg-type]
    assert out["be"].dtype == np.dtype("<i4")  # type: ignore[union-attr]
    np.testing.assert_array_equal(out["t"], native.T)  # type: ignore[arg-type]
    np.testing.assert_array_equal(out["s"], native[:, ::2])  # type: ignore[arg-type]


def test_bf16_ndarray() -> None:
    array = np.array([1.5, -0.0, np.inf], dtype=ml_dtypes.bfloat16)
    out = round_trip({"a": array})["a"]
    assert out.dtype == ml_dtypes.bfloat16  # type: ignore[union-attr]
    assert out.tobytes() == array.tobytes()  # type: ignore[union-attr]


# ---------------------------------------------------------------- RNG states restore exactly

BIT_GENERATORS = [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, np.random.MT19937]


@pytest.mark.parametrize("bit_generator", BIT_GENERATORS, ids=lambda c: c.__name__)
def test_numpy_bit_generator_state_restores(bit_generator: Callable[..., Any]) -> None:
    gen = np.random.Generator(bit_generator(20260102))
    gen.random(17)  # move off the seed state
    gen.integers(0, 10, size=3)
    state = gen.bit_generator.state
    if bit_generator is np.random.PCG64:
        assert state["state"]["state"] > UINT64_MAX  # really 128-bit
    blob = encode({"generators": {"np": {"kind": "numpy.bit_generator", "state": state}}})
    restored_state = decode(blob)["generators"]["np"]["state"]  # type: ignore[index]
    other = np.random.Generator(bit_generator(0))
    other.bit_generator.state = restored_state
    np.testing.assert_array_equal(other.random(100), gen.random(100))
    np.testing.assert_array_equal(other.integers(0, 1 << 62, size=50), gen.integers(0, 1 << 62, size=50))
    np.testing.assert_array_equal(other.standard_normal(33), gen.standard_normal(33))


def test_pcg64_state_with_buffered_uint32_restores() -> None:
    gen = np.random.Generator(np.random.PCG64(7))
    gen.integers(0, 100, dtype=np.uint32)  # leaves has_uint32 / uinteger set
    state = gen.bit_generator.state
    other = np.random.Generator(np.random.PCG64())
    other.bit_generator.state = round_trip({"s": state})["s"]
    assert (
        other.integers(0, 1 << 31, size=20, dtype=np.uint32).tolist()
        == gen.integers(0, 1 << 31, size=20, dtype=np.uint32).tolist()
    )


def legacy_state(rs: np.random.RandomState) -> dict[str, object]:
    """np.random.get_state()'s legacy tuple as the "numpy.random_state" map of the spec."""
    algorithm, key, pos, has_gauss, cached_gaussian = rs.get_state()
    return {"algorithm": algorithm, "key": key, "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached_gaussian}


def restore_legacy(rs: np.random.RandomState, state: dict[str, Any]) -> None:
    rs.set_state((state["algorithm"], state["key"], state["pos"], state["has_gauss"], state["cached_gaussian"]))


def test_numpy_legacy_random_state_restores() -> None:
    rs = np.random.RandomState(11)
    rs.standard_normal()  # leaves a cached gaussian
    state = legacy_state(rs)
    assert state["has_gauss"] == 1
    restored = round_trip({"s": state})["s"]
    assert restored["key"].dtype == np.uint32 and restored["key"].shape == (624,)  # type: ignore[index]
    other = np.random.RandomState(0)
    restore_legacy(other, restored)  # type: ignore[arg-type]
    np.testing.assert_array_equal(other.standard_normal(20), rs.standard_normal(20))


def test_python_random_state_restores() -> None:
    r = random.Random(99)
    r.gauss(0, 1)  # sets gauss_next
    version, internal, gauss_next = r.getstate()
    restored = round_trip({"s": r.getstate()})["s"]
    assert restored == [version, list(internal), gauss_next]
    other = random.Random()
    other.setstate((restored[0], tuple(restored[1]), restored[2]))  # type: ignore[index]
    assert [other.random() for _ in range(20)] == [r.random() for _ in range(20)]
    assert other.gauss(0, 1) == r.gauss(0, 1)


def test_torch_cpu_rng_state_restores() -> None:
    torch.manual_seed(5)
    torch.rand(3)
    state = torch.get_rng_state()
    restored = round_trip({"s": state.numpy()})["s"]
    expected = torch.rand(10)
    torch.set_rng_state(torch.from_numpy(restored))  # type: ignore[arg-type]
    assert torch.equal(torch.rand(10), expected)


def test_rng_field_through_a_checkpoint(store_url: str) -> None:
    gen = np.random.Generator(np.random.PCG64(3))
    py = random.Random(4)
    rs = np.random.RandomState(5)
    rng = {
        "generators": {
            "numpy": {"kind": "numpy.bit_generator", "state": gen.bit_generator.state},
            "legacy": {"kind": "numpy.random_state", "state": legacy_state(rs)},
            "python": {"kind": "python.random", "state": py.getstate()},
            "torch": {"kind": "torch.cpu", "state": torch.get_rng_state().numpy()},
            "future": {"kind": "jax.key", "state": [1, 2], "note": "unknown kinds are preserved"},
        }
    }
    with ckptfmt.open_writer(store_url, profile="weights") as w:
        w.write_tensors("weights", {})
        w.write_context("rng", rng)
    gens = ckptfmt.open(store_url).read_context("rng")["generators"]
    other = np.random.Generator(np.random.PCG64())
    other.bit_generator.state = gens["numpy"]["state"]  # type: ignore[index]
    np.testing.assert_array_equal(other.random(10), gen.random(10))
    legacy = np.random.RandomState()
    restore_legacy(legacy, gens["legacy"]["state"])  # type: ignore[index]
    np.testing.assert_array_equal(legacy.random_sample(10), rs.random_sample(10))
    v, internal, g = gens["python"]["state"]  # type: ignore[index]
    other_py = random.Random()
    other_py.setstate((v, tuple(internal), g))
    assert other_py.random() == py.random()
    assert gens["future"] == rng["generators"]["future"]  # type: ignore[index]


# ---------------------------------------------------------------- malformed blobs -> ContextError

MALFORMED = {
    "duplicate keys": b"\x82\xa1a\x01\xa1a\x02",
    "nested duplicate keys": b"\x81\xa1m\x82\xa1k\x01\xa1k\x02",
    "unknown ext": msgpack.packb({"a": msgpack.ExtType(5, b"x")}),
    "negative ext": b"\x81\xa1a\xd4\xfb\x00",  # fixext1, type -5
    "timestamp ext": b"\x81\xa1a\xd6\xff\x00\x00\x00\x00",  # type -1, which msgpack decodes itself
    "timestamp ext in a list": b"\x81\xa1a\x91\xd6\xff\x00\x00\x00\x00",
    "truncated": encode({"key": "value", "n": [1, 2, 3]})[:-2],
    "empty": b"",
    "trailing data": encode({"a": 1}) + b"\x01",
    "top-level array": msgpack.packb([1, 2]),
    "top-level int": msgpack.packb(3),
    "top-level str": msgpack.packb("map"),
    "top-level nil": msgpack.packb(None),
    "int key": msgpack.packb({1: 2}),
    "bin key": msgpack.packb({b"k": 2}, use_bin_type=True),
    "invalid utf-8 str": b"\x81\xa1a\xa2\xff\xfe",
    "reserved byte": b"\x81\xa1a\xc1",
    "empty bigint": msgpack.packb({"a": msgpack.ExtType(EXT_BIGINT, b"")}),
    "ndarray wrong length": msgpack.packb(
        {"a": msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["F32", [2], b"\x00" * 7], use_bin_type=True))}
    ),
    "ndarray unknown dtype": msgpack.packb(
        {"a": msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["F4", [2], b"\x00"], use_bin_type=True))}
    ),
    "ndarray negative shape": msgpack.packb(
        {"a": msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["U8", [-1], b""], use_bin_type=True))}
    ),
    "ndarray not a triple": msgpack.packb(
        {"a": msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["U8", [1]], use_bin_type=True))}
    ),
    "ndarray garbage payload": msgpack.packb({"a": msgpack.ExtType(EXT_NDARRAY, b"\xc1")}),
    "too deep": b"\x81\xa1a" * MAX_DEPTH + b"\x80",  # MAX_DEPTH + 1 maps; the top level counts as 1
    "bigint not minimal": msgpack.packb({"a": msgpack.ExtType(EXT_BIGINT, b"\x00" + (1 << 64).to_bytes(9, "big"))}),
    "bigint that fits a native int": msgpack.packb({"a": msgpack.ExtType(EXT_BIGINT, b"\x05")}),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_blobs_raise_context_error(name: str) -> None:
    with pytest.raises(ContextError) as info:
        decode(MALFORMED[name], path="rng/context.msgpack", field="rng")
    assert info.value.path == "rng/context.msgpack" and info.value.field == "rng"


def test_encoder_and_decoder_agree_on_the_depth_limit() -> None:
    value: dict[str, Any] = {}
    for _ in range(MAX_DEPTH - 1):  # MAX_DEPTH maps in all
        value = {"a": value}
    assert round_trip(value) == value  # the deepest value the encoder accepts decodes
    with pytest.raises(ContextError):
        encode({"a": value})
    assert MALFORMED["too deep"] == b"\x81\xa1a" + encode(value)  # ... and one level more is refused


def nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


UNENCODABLE: dict[str, object] = {
    "set": {"s": {1, 2}},
    "object": {"o": object()},
    "complex": {"c": 1j},
    "int key": {"m": {1: "x"}},
    "too deep": {"a": nested_lists(MAX_DEPTH)},
}


@pytest.mark.parametrize("name", UNENCODABLE)
def test_unencodable_values_raise_context_error(name: str) -> None:
    with pytest.raises(ContextError):
        encode(UNENCODABLE[name])  # type: ignore[arg-type]


@pytest.mark.parametrize("array", [np.zeros(2, dtype="datetime64[s]"), np.array(["x"])], ids=repr)
def test_arrays_without_a_safetensors_dtype_raise_dtype_error(array: np.ndarray[Any, Any]) -> None:
    with pytest.raises(DTypeError):
        encode({"a": array})


@pytest.mark.parametrize("value", [[1], "x", 3, None], ids=repr)
def test_encode_needs_a_map(value: object) -> None:
    with pytest.raises(ContextError):
        encode(value)  # type: ignore[arg-type]


# ---------------------------------------------------------------- property: decode(encode(x)) == x

KEYS = st.text(max_size=8)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 200), max_value=1 << 200)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_random_maps_round_trip(value: dict[str, Any]) -> None:
    data = encode(value)
    assert decode(data) == value
    assert encode(decode(data)) == data  # and re-encoding is stable


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("2024-02-29T00:00:00Z", True),
        ("2000-02-29T23:59:59.999999999Z", True),
        ("0000-02-29T00:00:00Z", True),  # year 0000 is RFC 3339, and a leap year
        ("9999-12-31T23:59:59Z", True),
        ("2016-12-31T23:59:60Z", False),  # a leap second: refused (spec/fields.md)
        ("2025-02-29T00:00:00Z", False),
        ("1900-02-29T00:00:00Z", False),
        ("2025-04-31T00:00:00Z", False),
        ("2025-01-00T00:00:00Z", False),
        ("2025-00-01T00:00:00Z", False),
        ("2025-01-01T24:00:00Z", False),
        ("2025-01-01T00:60:00Z", False),
        ("\u0662\u0660\u0662\u0665-01-01T00:00:00Z", False),  # non-ASCII digits
        ("2025-01-01T00:00:00.Z", False),
    ],
)
def test_created_at_ranges(value: str, ok: bool) -> None:
    from ckptfmt.fields import check_standard_field

    provenance = {"writer": {"name": "x", "version": "1"}, "created_at": value}
    if ok:
        check_standard_field("provenance", provenance)
    else:
        with pytest.raises(ckptfmt.ContextError):
            check_standard_field("provenance", provenance)


@pytest.mark.parametrize(
    ("field", "value", "requirement"),
    [
        ("rng", {"generators": []}, "FLD-2"),
        ("rng", {"generators": {"g": ["k", None]}}, "FLD-3"),
        ("rng", {"generators": {"g": {"kind": 1, "state": None}}}, "FLD-3"),
        ("rng", {"generators": {"g": {"kind": "org.example"}}}, "FLD-4"),
        ("rng", {"generators": {"g": {"kind": "torch.cpu", "state": b"\x00"}}}, "RNG-4"),
        ("data", {"global_sample_offset": 0}, "FLD-5"),
        ("data", {"epoch": 0, "global_sample_offset": -1}, "FLD-6"),
        ("config", {"config": [], "hash": "x"}, "FLD-7"),
        ("config", {"config": {}, "hash": 1}, "FLD-8"),
        ("config", {"config": {}, "hash": "sha256:" + "0" * 64}, "FLD-9"),
        ("topology", {"world_size": 0}, "FLD-10"),
        ("provenance", {"created_at": "2025-01-01T00:00:00Z"}, "FLD-11"),
        ("provenance", {"writer": {"name": "x", "version": "1"}, "created_at": "2025"}, "FLD-12"),
    ],
)
def test_standard_field_refusals_name_their_requirement(field: str, value: dict[str, Any], requirement: str) -> None:
    from ckptfmt.fields import check_standard_field

    with pytest.raises(ckptfmt.ContextError) as info:
        check_standard_field(field, value)
    assert info.value.requirement == requirement and info.value.field == field
