"""Content rules of the standard context fields (spec/fields.md), checked whenever the field is present."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

from .canonical import config_hash
from .errors import ConfigHashMismatchError, ContextError
from .quarantine import writer_problem

_CREATED_AT = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?Z")
_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _is_created_at(value: object) -> bool:
    """RFC 3339 date-time in UTC, uppercase T and Z only, ASCII digits, valid field ranges (FLD-12).

    Checked by hand rather than with ``datetime``: year 0000 is valid RFC 3339 (datetime starts at 1),
    and ``\\d`` would admit non-ASCII digits. Second 60 (a leap second) is refused, as spec/fields.md says.
    """
    match = _CREATED_AT.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return False
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    if not 1 <= month <= 12 or hour > 23 or minute > 59 or second > 59:
        return False
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    return 1 <= day <= _DAYS[month - 1] + (month == 2 and leap)


def _rng_state_problem(kind: str, gen: Mapping[str, object]) -> str | None:
    """Why a generator record of a known kind has a malformed state (RNG-1..5); unknown kinds pass (RNG-6)."""
    state = gen.get("state")
    if kind == "python.random":
        # tuples too: a writer checks random.getstate() itself, which encodes with tuples as arrays
        ok = (
            isinstance(state, (list, tuple))
            and len(state) == 3
            and type(state[0]) is int
            and isinstance(state[1], (list, tuple))
            and len(state[1]) == 625
            and all(type(v) is int for v in state[1])
            and (state[2] is None or isinstance(state[2], float))
        )
        return None if ok else "state must be [int version, 625 ints, float or nil]"
    if kind == "numpy.random_state":
        ok = (
            isinstance(state, dict)
            and state.get("algorithm") == "MT19937"
            and isinstance(state.get("key"), np.ndarray)
            and state["key"].dtype == np.dtype("<u4")
            and state["key"].shape == (624,)
            and all(type(state.get(k)) is int for k in ("pos", "has_gauss"))
            and isinstance(state.get("cached_gaussian"), float)
        )
        return None if ok else "state must be {algorithm: 'MT19937', key: U32[624], pos, has_gauss, cached_gaussian}"
    if kind == "numpy.bit_generator":
        ok = isinstance(state, dict) and isinstance(state.get("bit_generator"), str)
        return None if ok else "state must be a map with a str 'bit_generator'"
    if kind in ("torch.cpu", "torch.cuda"):
        if not (isinstance(state, np.ndarray) and state.dtype == np.uint8):
            return "state must be an ndarray of U8"
        if kind == "torch.cuda" and type(gen.get("device")) is not int:
            return "a torch.cuda generator needs an int 'device'"
    return None


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _require(ok: bool, field: str, message: str, requirement: str | None = None) -> None:
    if not ok:
        raise ContextError(message, field=field, requirement=requirement)


_RNG_RULES = {
    "python.random": "RNG-1",
    "numpy.random_state": "RNG-2",
    "numpy.bit_generator": "RNG-3",
    "torch.cpu": "RNG-4",
    "torch.cuda": "RNG-5",
}


def check_rng(value: Mapping[str, object]) -> None:
    generators = value.get("generators")
    _require(isinstance(generators, dict), "rng", "'generators' must be a map of generator name to state", "FLD-2")
    assert isinstance(generators, dict)
    for name, gen in generators.items():
        _require(
            isinstance(gen, dict) and isinstance(gen.get("kind"), str),
            "rng",
            f"generator {name!r} must be a map with a string 'kind' and a 'state'",
            "FLD-3",
        )
        _require("state" in gen, "rng", f"generator {name!r} must be a map with a string 'kind' and a 'state'", "FLD-4")
        problem = _rng_state_problem(gen["kind"], gen)
        if problem:
            raise ContextError(
                f"generator {name!r} of kind {gen['kind']!r}: {problem}",
                field="rng",
                requirement=_RNG_RULES.get(gen["kind"]),
            )


def check_data(value: Mapping[str, object]) -> None:
    for key, rule in (("epoch", "FLD-5"), ("global_sample_offset", "FLD-6")):
        _require(_is_count(value.get(key)), "data", f"{key!r} must be a non-negative integer", rule)
    quarantined = value.get("quarantined_shards", [])
    _require(
        isinstance(quarantined, list) and all(isinstance(s, str) for s in quarantined),
        "data",
        "'quarantined_shards' must be an array of strings",
    )
    offsets = value.get("shard_offsets", {})
    _require(
        isinstance(offsets, dict) and all(_is_count(v) for v in offsets.values()),
        "data",
        "'shard_offsets' must map shard names to non-negative integers",
    )


def check_data_written(value: Mapping[str, object]) -> None:
    """What a writer must give the optional ``quarantine`` member (spec/fields.md): a reader stays lenient toward it
    (FLD-1's rule for optional members), the sampler that resumes from it checks it again against its dataset."""
    if "quarantine" in value:
        problem = writer_problem(value["quarantine"], value.get("quarantined_shards", []))
        _require(problem is None, "data", f"'quarantine': {problem}")


def _is_json(value: object) -> bool:
    """Nil, bool, int in the msgpack range, finite float, str, array and map only: no bin, no ext (FLD-7)."""
    if isinstance(value, np.generic):  # a writer's config may hold numpy scalars; they encode as their item
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, int):
        return -(1 << 63) <= value < (1 << 64)  # outside: decoded from a bigint ext value
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, Mapping):
        return all(_is_json(v) for v in value.values())
    return False  # bytes (bin), numpy arrays (ndarray ext)


def check_config(value: Mapping[str, object]) -> None:
    config = value.get("config")
    stored = value.get("hash")
    _require(isinstance(config, dict), "config", "'config' must be a map", "FLD-7")
    _require(_is_json(config), "config", "'config' must hold no bin, no ext value and no NaN or infinity", "FLD-7")
    _require(isinstance(stored, str), "config", "'hash' must be a string 'sha256:<hex>'", "FLD-8")
    actual = config_hash(config)
    if actual != stored:
        raise ConfigHashMismatchError(
            f"stored hash {stored} but the config hashes to {actual}", field="config", requirement="FLD-9"
        )


def check_topology(value: Mapping[str, object]) -> None:
    world = value.get("world_size")
    _require(type(world) is int and world >= 1, "topology", "'world_size' must be a positive integer", "FLD-10")


def check_provenance(value: Mapping[str, object]) -> None:
    writer = value.get("writer")
    _require(
        isinstance(writer, dict) and isinstance(writer.get("name"), str) and isinstance(writer.get("version"), str),
        "provenance",
        "'writer' must be a map with string 'name' and 'version'",
        "FLD-11",
    )
    _require(
        _is_created_at(value.get("created_at")),
        "provenance",
        "'created_at' must be an RFC 3339 UTC timestamp like 2025-01-01T00:00:00Z",
        "FLD-12",
    )


CHECKS: dict[str, Callable[[Mapping[str, object]], None]] = {
    "rng": check_rng,
    "data": check_data,
    "config": check_config,
    "topology": check_topology,
    "provenance": check_provenance,
}


def check_standard_field(name: str, value: Mapping[str, object], *, writing: bool = False) -> None:
    """Raise ContextError if a standard field's content breaks its rules; other fields pass. ``writing``: also the
    rules on optional members that only a writer is held to (a reader leaves those alone)."""
    check = CHECKS.get(name)
    if check is not None:
        check(value)
    if writing and name == "data":
        check_data_written(value)
