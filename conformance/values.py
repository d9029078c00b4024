"""The writer-input format: a canonical description plus the bytes it summarizes (conformance/README.md).

A writer input is the canonical description in which every tensor object and every ``$ndarray``
object also has a ``data`` member (lowercase hex of the little-endian C-order bytes), and a tensor
object may have ``chunks`` hints. Removing those members gives the expected description.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ckptfmt import dtypes

TENSOR_EXTRAS = ("data", "chunks")


class InputError(ValueError):
    """A writer input that does not follow the format."""


def _no_float(text: str) -> object:
    raise InputError(f"a writer input has no JSON floats (got {text}); floats are written {{'$float': ...}}")


def load(text: str | bytes) -> dict[str, Any]:
    doc = json.loads(text, parse_float=_no_float, parse_constant=_no_float)
    if not isinstance(doc, dict):
        raise InputError("a writer input is a JSON object")
    return doc


def parse_float(text: str) -> float:
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf, "-0": -0.0}
    if text in special:
        return special[text]
    return float(text)


def array_from(entry: dict[str, Any]) -> np.ndarray[Any, Any]:
    """The array of a tensor object or ``$ndarray`` object that carries ``data``."""
    dtype = dtypes.to_numpy(entry["dtype"])
    shape = tuple(int(d) for d in entry["shape"])
    return np.frombuffer(bytes.fromhex(entry["data"]), dtype=dtype).reshape(shape).copy()


def to_context(value: object) -> object:
    """The Python value (as ckptfmt encodes it) of a JSON context value of a writer input."""
    if isinstance(value, list):
        return [to_context(v) for v in value]
    if not isinstance(value, dict):
        return value  # null, bool, int, str
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key == "$bin":
            return bytes.fromhex(inner)
        if key == "$bigint":
            return int(inner)
        if key == "$float":
            return parse_float(inner)
        if key == "$ndarray":
            return array_from(inner)
        if key == "$map":
            return {k: to_context(v) for k, v in inner.items()}
        if key.startswith("$"):
            raise InputError(f"unknown tag {key!r}")
    return {k: to_context(v) for k, v in value.items()}


def _strip_context(value: object) -> object:
    if isinstance(value, list):
        return [_strip_context(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and "$ndarray" in value:
        return {"$ndarray": {k: v for k, v in value["$ndarray"].items() if k != "data"}}
    if len(value) == 1 and "$map" in value:
        return {"$map": {k: _strip_context(v) for k, v in value["$map"].items()}}
    return {k: _strip_context(v) for k, v in value.items()}


def expected_description(writer_input: dict[str, Any]) -> dict[str, Any]:
    """The description a reader must return for a checkpoint written from ``writer_input``."""
    fields: dict[str, Any] = {}
    for name, field in writer_input["fields"].items():
        out: dict[str, Any] = {"kind": field["kind"]}
        if "tensors" in field:
            out["tensors"] = {
                t: {k: v for k, v in entry.items() if k not in TENSOR_EXTRAS} for t, entry in field["tensors"].items()
            }
        if "context" in field:
            out["context"] = _strip_context(field["context"])
        fields[name] = out
    return {
        "format_version": writer_input["format_version"],
        "profile": writer_input["profile"],
        "metadata": dict(writer_input.get("metadata", {})),
        "fields": fields,
    }
