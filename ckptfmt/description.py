"""The canonical description of a checkpoint's content (conformance/README.md).

What a conforming reader returns, with tensors reduced to dtype, shape and a SHA-256 of their bytes
and context values written as JSON: ``ckpt dump`` prints it, the conformance runner compares it.
Computing it verifies the whole checkpoint first (every file's size and digest, every header, every
chunk digest, every context blob).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .canonical import format_number
from .dtypes import from_numpy
from .errors import CheckpointError, ContextError
from .reader import open_checkpoint
from .verify import Problem

TAG = "$"


class VerificationError(CheckpointError):
    """Full verification found a problem; ``code`` is the code of the first problem reported."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(
            problem.message,
            path=problem.path,
            field=problem.field,
            tensor=problem.tensor,
            requirement=problem.requirement,
        )
        self.code = problem.code


def refusal_line(exc: CheckpointError) -> str:
    """The first line of stderr of a refusal under the strict protocol (conformance/README.md).

    ``TEN-17: [chunk_layout] ...``: the requirement ID the reader refused on, then the error; an error
    that names no requirement starts with its code instead, which the strict runner counts as a
    refusal for the wrong reason (every refusal of the reference reader is meant to name its rule).
    """
    text = " ".join(str(exc).split())  # one line, whatever the message holds
    if exc.requirement is None:
        return f"[{exc.code}] {text}"
    return f"{exc.requirement}: [{exc.code}] {text}"


def sha256(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def float_text(value: float) -> str:
    """The ECMAScript form of a finite float; ``-0``, ``NaN``, ``Infinity``, ``-Infinity`` otherwise."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0 and math.copysign(1.0, value) < 0:
        return "-0"
    return format_number(value)


def array_description(array: np.ndarray[Any, Any]) -> dict[str, object]:
    """dtype, shape and the SHA-256 of the little-endian C-order bytes of an array."""
    data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
    return {"dtype": from_numpy(array.dtype), "shape": list(array.shape), "digest": sha256(data)}


_MAX_BIGINT_BITS = 8192  # 2,467 decimal digits, far below Python's 4,300-digit str() limit


def context_json(value: object) -> object:
    """A decoded context value as JSON; msgpack types JSON lacks become one-member ``$`` objects."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if -(1 << 63) <= value < (1 << 64):
            return value
        if value.bit_length() > _MAX_BIGINT_BITS:
            # Python refuses str() of an int of more than 4300 digits (and it would take quadratic time)
            raise ContextError(
                f"a bigint of {value.bit_length()} bits is too large to describe in decimal "
                f"(this reader describes at most {_MAX_BIGINT_BITS} bits)"
            )
        return {"$bigint": str(value)}
    if isinstance(value, float):
        return {"$float": float_text(value)}
    if isinstance(value, bytes):
        return {"$bin": value.hex()}
    if isinstance(value, np.ndarray):
        return {"$ndarray": array_description(value)}
    if isinstance(value, list):
        return [context_json(item) for item in value]
    if isinstance(value, Mapping):
        members = {str(k): context_json(v) for k, v in value.items()}
        if len(members) == 1 and next(iter(members)).startswith(TAG):
            return {"$map": members}  # so that a map is never mistaken for a tagged value
        return members
    raise TypeError(f"{type(value).__name__} is not a context value")


def canonical_description(url: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> dict[str, object]:
    """The canonical description of the checkpoint at ``url``; raises the first problem found."""
    with open_checkpoint(url, options) as ckpt:
        report = ckpt.verify()
        if not report.ok:
            raise VerificationError(report.problems[0])
        fields: dict[str, object] = {}
        for name, record in ckpt.fields.items():
            entry: dict[str, object] = {"kind": record.kind}
            if record.kind == "tensors":
                entry["tensors"] = {
                    tname: array_description(ckpt.read_tensor(name, tname)) for tname in ckpt.tensor_names(name)
                }
            if record.context is not None:
                entry["context"] = context_json(ckpt.read_context(name))
            fields[name] = entry
        return {
            "format_version": ckpt.format_version,
            "profile": ckpt.profile,
            "metadata": dict(ckpt.manifest.metadata),
            "fields": fields,
        }
