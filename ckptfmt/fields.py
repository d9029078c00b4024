"""Content rules of the standard context fields (spec/fields.md), checked whenever the field is present."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from .canonical import config_hash
from .errors import ConfigHashMismatchError, ContextError

_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ContextError(message, field=field)


def check_rng(value: Mapping[str, object]) -> None:
    generators = value.get("generators")
    _require(isinstance(generators, dict), "rng", "'generators' must be a map of generator name to state")
    assert isinstance(generators, dict)
    for name, gen in generators.items():
        _require(
            isinstance(gen, dict) and isinstance(gen.get("kind"), str) and "state" in gen,
            "rng",
            f"generator {name!r} must be a map with a string 'kind' and a 'state'",
        )


def check_data(value: Mapping[str, object]) -> None:
    for key in ("epoch", "global_sample_offset"):
        _require(_is_count(value.get(key)), "data", f"{key!r} must be a non-negative integer")
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


def check_config(value: Mapping[str, object]) -> None:
    config = value.get("config")
    stored = value.get("hash")
    _require(isinstance(config, dict), "config", "'config' must be a map")
    _require(isinstance(stored, str), "config", "'hash' must be a string 'sha256:<hex>'")
    actual = config_hash(config)
    if actual != stored:
        raise ConfigHashMismatchError(f"stored hash {stored} but the config hashes to {actual}", field="config")


def check_topology(value: Mapping[str, object]) -> None:
    world = value.get("world_size")
    _require(type(world) is int and world >= 1, "topology", "'world_size' must be a positive integer")


def check_provenance(value: Mapping[str, object]) -> None:
    writer = value.get("writer")
    _require(
        isinstance(writer, dict) and isinstance(writer.get("name"), str) and isinstance(writer.get("version"), str),
        "provenance",
        "'writer' must be a map with string 'name' and 'version'",
    )
    created = value.get("created_at")
    _require(
        isinstance(created, str) and _RFC3339.fullmatch(created) is not None,
        "provenance",
        "'created_at' must be an RFC 3339 timestamp",
    )


CHECKS: dict[str, Callable[[Mapping[str, object]], None]] = {
    "rng": check_rng,
    "data": check_data,
    "config": check_config,
    "topology": check_topology,
    "provenance": check_provenance,
}


def check_standard_field(name: str, value: Mapping[str, object]) -> None:
    """Raise ContextError if a standard field's content breaks its rules; other fields pass."""
    check = CHECKS.get(name)
    if check is not None:
        check(value)
