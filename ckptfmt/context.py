"""Context blobs: the msgpack subset of spec/context.md.

Two extension types carry what msgpack cannot: integers beyond 64 bits (numpy's PCG64 state) and
n-dimensional arrays (numpy's legacy MT19937 key, torch RNG byte states). Everything a decoder
can throw becomes a :class:`ContextError` naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

from . import dtypes
from .errors import CheckpointError, ContextError

EXT_BIGINT = 1
EXT_NDARRAY = 2
MAX_DEPTH = 64
MAX_BLOB_BYTES = 1 << 30
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1


def _bigint_payload(value: int) -> bytes:
    # minimal two's complement: a negative v needs as many bits as ~v (= -v - 1) plus the sign bit
    magnitude = value if value >= 0 else ~value
    return value.to_bytes((magnitude.bit_length() + 8) // 8, "big", signed=True)


def _prepare(value: object, where: str, depth: int) -> object:
    """Turn a Python value into msgpack-native objects, map keys sorted for deterministic bytes."""
    if depth > MAX_DEPTH:
        raise ContextError(f"{where}: nesting deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str, float, bytes)):
        return value
    if isinstance(value, int):
        if _INT_MIN <= value <= _INT_MAX:
            return int(value)
        return msgpack.ExtType(EXT_BIGINT, _bigint_payload(int(value)))
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, Mapping):
        items = []
        for key in value:
            if not isinstance(key, str):
                raise ContextError(f"{where}: map keys must be strings, got {type(key).__name__} {key!r}")
            items.append((key, _prepare(value[key], f"{where}.{key}", depth + 1)))
        items.sort(key=lambda kv: kv[0])
        return dict(items)
    if isinstance(value, (list, tuple)):
        return [_prepare(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, np.ndarray):
        name = dtypes.from_numpy(value.dtype)
        data = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
        payload = msgpack.packb([name, list(value.shape), data], use_bin_type=True)
        return msgpack.ExtType(EXT_NDARRAY, payload)
    if isinstance(value, np.generic):
        return _prepare(value.item(), where, depth)
    raise ContextError(f"{where}: {type(value).__name__} cannot be stored in a context blob")


def encode(value: Mapping[str, object], *, where: str = "context") -> bytes:
    """Encode a map as a context blob; deterministic for equal inputs."""
    if not isinstance(value, Mapping):
        raise ContextError(f"{where}: a context must be a mapping, got {type(value).__name__}")
    prepared = _prepare(value, "$", 1)
    try:
        return msgpack.packb(prepared, use_bin_type=True, use_single_float=False)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ContextError(f"{where}: cannot encode: {exc}") from exc


def _decode_ndarray(payload: bytes) -> np.ndarray[Any, Any]:
    try:
        parts = msgpack.unpackb(payload, raw=False, use_list=True)
    except Exception as exc:  # trailing bytes, truncation, 0xc1...: not "exactly one MessagePack array"
        message, _ = _explain(exc)
        raise _bad(f"ndarray payload is not one MessagePack array: {message}", "CTX-12") from exc
    if not (isinstance(parts, list) and len(parts) == 3):
        raise _bad("ndarray extension must hold [dtype, shape, data]", "CTX-12")
    name, shape, data = parts
    if not isinstance(name, str) or not isinstance(data, bytes) or not isinstance(shape, list):
        raise _bad("ndarray extension must hold [str dtype, shape array, bin data]", "CTX-12")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _bad("ndarray shape must be non-negative integers", "CTX-12")
    if name not in dtypes.ITEMSIZE:
        raise _bad(f"ndarray dtype {name!r} is not in the dtype table", "CTX-12")
    dtype = dtypes.to_numpy(name)
    problem = dtypes.shape_size_problem(shape, dtype.itemsize)
    if problem:  # the bounds of TEN-23, which the array libraries that build it also have
        raise _bad(f"ndarray {problem}", "CTX-14")
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(data):
        raise _bad(f"ndarray of {name}{shape} needs {count * dtype.itemsize} bytes, has {len(data)}", "CTX-12")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _ext_hook(code: int, payload: bytes) -> object:
    if code == EXT_BIGINT:
        value = int.from_bytes(payload, "big", signed=True)
        if not payload or payload != _bigint_payload(value):
            raise _bad("bigint extension payload is not minimal-length two's complement", "CTX-11")
        if _INT_MIN <= value <= _INT_MAX:
            raise _bad("bigint extension holds a value that fits a msgpack int", "CTX-11")
        return value
    if code == EXT_NDARRAY:
        return _decode_ndarray(payload)
    raise _bad(f"unknown msgpack extension type {code}", "CTX-3")


def _reject_timestamp(value: object) -> None:
    # msgpack decodes extension type -1 (timestamp) itself, never calling ext_hook
    if isinstance(value, msgpack.Timestamp):
        raise _bad("unknown msgpack extension type -1 (timestamp)", "CTX-3")


def _pairs_hook(pairs: list[tuple[object, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise _bad(f"map key of type {type(key).__name__} is not a string", "CTX-5")
        if key in out:
            raise _bad(f"duplicate map key {key!r}", "CTX-6")
        _reject_timestamp(value)
        out[key] = value
    return out


def _list_hook(items: list[object]) -> list[object]:
    for item in items:
        _reject_timestamp(item)
    return items


def _depth(value: object, depth: int = 1) -> int:
    """Nesting depth; the top-level map counts as 1 (CTX-7)."""
    if depth > MAX_DEPTH:
        return depth
    if isinstance(value, dict):
        return max((_depth(v, depth + 1) for v in value.values()), default=depth)
    if isinstance(value, list):
        return max((_depth(v, depth + 1) for v in value), default=depth)
    return depth


def decode(data: bytes, *, path: str | None = None, field: str | None = None) -> dict[str, object]:
    """Decode a context blob; any malformation raises ContextError naming the file and field."""
    if len(data) > MAX_BLOB_BYTES:
        raise ContextError(f"blob of {len(data)} bytes exceeds {MAX_BLOB_BYTES}", path=path, field=field)
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,  # checked by _pairs_hook, to report it in our words
            object_pairs_hook=_pairs_hook,
            list_hook=_list_hook,
            ext_hook=_ext_hook,
        )
    except CheckpointError as exc:
        raise ContextError(
            f"invalid msgpack: {exc.message}", path=path, field=field, requirement=exc.requirement
        ) from exc
    except Exception as exc:  # msgpack raises ExtraData, FormatError, StackError, ValueError, ...
        message, requirement = _explain(exc)
        raise ContextError(f"invalid msgpack: {message}", path=path, field=field, requirement=requirement) from exc
    if not isinstance(value, dict):
        raise ContextError(
            f"top level must be a map, got {type(value).__name__}", path=path, field=field, requirement="CTX-1"
        )
    if _depth(value) > MAX_DEPTH:
        raise ContextError(f"nesting deeper than {MAX_DEPTH}", path=path, field=field, requirement="CTX-7")
    return value


def _bad(message: str, requirement: str) -> ContextError:
    return ContextError(message, requirement=requirement)


def _explain(exc: Exception) -> tuple[str, str | None]:
    """msgpack's own exceptions, in the words (and requirement IDs) of spec/context.md."""
    if isinstance(exc, msgpack.ExtraData):
        return "bytes after the top-level object", "CTX-2"
    if isinstance(exc, msgpack.StackError):
        return f"nesting deeper than {MAX_DEPTH} (msgpack's own stack limit)", "CTX-7"
    if isinstance(exc, msgpack.FormatError):
        return "a type byte that starts no MessagePack object (the reserved byte 0xc1)", "CTX-13"
    if isinstance(exc, UnicodeDecodeError):
        return f"a str that is not valid UTF-8: {exc}", "CTX-4"
    if isinstance(exc, ValueError) and ("incomplete" in str(exc) or "exceeds max_" in str(exc)):
        # msgpack bounds every length and count by the bytes left, so a huge one reads as truncation
        return f"truncated: a length or count runs past the end of the blob ({exc})", "CTX-13"
    return f"{type(exc).__name__}: {exc}", None
