"""Canonical JSON (spec/config-hash.md) and the config hash.

A config's hash must be recomputable in any language, so its canonical form is RFC 8785 (JCS)
with two deliberate differences: keys sort by code point (Python's and UTF-8 byte order, where JCS
sorts UTF-16 units; the two agree below U+10000) and integers are written exactly, so a 64-bit seed
does not lose digits through a double.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from decimal import Decimal

from .errors import ContextError

CONFIG_HASH_ALGORITHM = "sha256"


def format_number(value: float) -> str:
    """ECMAScript Number::toString of a finite double (the JCS number form)."""
    if not math.isfinite(value):
        raise ContextError(f"{value!r} has no canonical JSON form (NaN and Infinity are not allowed)")
    if value == 0:
        return "0"
    if value < 0:
        return "-" + format_number(-value)
    _sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    assert isinstance(exponent, int)
    exponent += len(digit_tuple) - len(digits)  # account for stripped zeros
    k = len(digits)
    n = exponent + k  # value == 0.digits * 10**n
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + digits
    e = n - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def _emit(value: object, out: list[str], where: str) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(format_number(value))
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ContextError(f"{where}: string is not valid Unicode") from None
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, Mapping):
        out.append("{")
        keys = list(value.keys())
        for key in keys:
            if not isinstance(key, str):
                raise ContextError(f"{where}: map keys must be strings, got {type(key).__name__}")
        for i, key in enumerate(sorted(keys)):
            if i:
                out.append(",")
            _emit(key, out, where)
            out.append(":")
            _emit(value[key], out, f"{where}.{key}")
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _emit(item, out, f"{where}[{i}]")
        out.append("]")
    else:
        # numpy scalars are common in configs; anything else has no JSON form
        item = getattr(value, "item", None)
        if callable(item) and type(value).__module__ == "numpy":
            _emit(item(), out, where)
            return
        raise ContextError(f"{where}: {type(value).__name__} has no canonical JSON form")


def canonical_json(value: object) -> bytes:
    """The canonical JSON bytes of a JSON-representable value."""
    out: list[str] = []
    _emit(value, out, "$")
    return "".join(out).encode("utf-8")


def config_to_dict(config: object) -> dict[str, object]:
    """A config given as a mapping or a dataclass instance, as a plain dict."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise ContextError(f"a config must be a mapping or a dataclass instance, got {type(config).__name__}")


def config_hash(config: object) -> str:
    """``sha256:<hex>`` of the canonical JSON of a config (mapping or dataclass)."""
    data = canonical_json(config_to_dict(config))
    return f"{CONFIG_HASH_ALGORITHM}:{hashlib.sha256(data).hexdigest()}"


def manifest_bytes(document: Mapping[str, object]) -> bytes:
    """Canonical bytes of a manifest: sorted keys, no whitespace, UTF-8, and (by schema) no floats."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
