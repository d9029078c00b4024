"""The quarantine record of the ``data`` field (spec/fields.md, ``quarantine``): which samples and shards a run left
out of its global sample order, from which step, why, and the values that tripped it.

On disk the record is an array of entry maps::

    "quarantine": [
        {"step": 12, "samples": [3, 17], "reason": "nonfinite", "values": {"loss": NaN}},
        {"step": 30, "samples": [], "shard": "3", "reason": "spike", "values": {"loss": 9.5, "mean": 2.1}},
    ]

A sample (a dataset index, not a position in the order) is in at most one entry, the one that first quarantined it;
a shard likewise, and every entry's shard is also in ``quarantined_shards``. ``values`` are float 64, NaN and the
infinities included: they are what tripped the guard (FLD-7 forbids them in ``config`` only). No module here imports
torch: the format's writer check (:mod:`ckptfmt.fields`) and the samplers share this parse.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from .lazy_import import numpy as np

from .errors import ContextError, UsageError

REASONS = ("nonfinite", "spike", "predicate", "window", "manual")
"""Why an entry was made: a non-finite loss or gradient norm, a loss spike, a user predicate, a window of steps
rolled back and skipped, or an operator's call."""

MAX_VALUES = 64  # values per entry
MAX_TEXT = 256  # characters of a reason, a shard name or a value's name
_MAX_STEP = 1 << 63


@dataclass(frozen=True, slots=True, kw_only=True)
class QuarantineEntry:
    """One quarantine: from ``step`` on, the dataset indices ``samples`` (ascending) and the shard ``shard``, if any,
    are left out of the global order. ``values`` (read-only) are what tripped it, for example
    ``{"loss": nan, "grad_norm": 1e9}``."""

    step: int
    samples: tuple[int, ...] = ()
    shard: str | None = None
    reason: str
    values: Mapping[str, float] = field(default_factory=dict)
    # the data position the entry's samples are left out from: (epoch, position in that epoch's order); None while
    # it waits for the next pass over the data (a quarantine made during one applies from the next)
    since: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def to_dict(self) -> dict[str, Any]:
        """The entry as the ``data`` field stores it."""
        out: dict[str, Any] = {
            "step": self.step,
            "samples": list(self.samples),
            "reason": self.reason,
            "values": dict(self.values),
        }
        if self.shard is not None:
            out["shard"] = self.shard
        if self.since is not None:
            out["from"] = {"epoch": self.since[0], "position": self.since[1]}
        return out

    @classmethod
    def from_dict(cls, value: object, index: int, *, num_samples: int | None = None) -> QuarantineEntry:
        """Parse entry ``index`` of a stored record (hostile input): ContextError naming ``quarantine[index].<member>``.
        ``num_samples``: the dataset's size, which every sample must be below (None: unchecked). Members this
        version does not define are ignored."""
        where = f"quarantine[{index}]"
        if not isinstance(value, Mapping):
            raise _error(f"{where} must be a map")
        step = value.get("step")
        if type(step) is not int or not 0 <= step < _MAX_STEP:
            raise _error(f"{where}.step must be an integer at least 0, got {_show(step)}")
        reason = value.get("reason")
        if not isinstance(reason, str) or not 0 < len(reason) <= MAX_TEXT:
            raise _error(f"{where}.reason must be a non-empty string of at most {MAX_TEXT} characters")
        shard = value.get("shard")
        if shard is not None and (not isinstance(shard, str) or not 0 < len(shard) <= MAX_TEXT):
            raise _error(f"{where}.shard must be a non-empty string of at most {MAX_TEXT} characters")
        samples = _parse_samples(value.get("samples"), f"{where}.samples", num_samples)
        if not samples and shard is None:
            raise _error(f"{where} names no sample and no shard: it quarantines nothing")
        values = value.get("values", {})
        if not isinstance(values, Mapping) or len(values) > MAX_VALUES:
            raise _error(f"{where}.values must be a map of at most {MAX_VALUES} names to floats")
        parsed: dict[str, float] = {}
        for name, number in values.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_TEXT:
                raise _error(f"{where}.values: a name must be a non-empty string of at most {MAX_TEXT} characters")
            if type(number) is not float and type(number) is not int:
                raise _error(f"{where}.values[{name!r}] must be a float, got {_show(number)}")
            parsed[name] = float(number)
        since = value.get("from")
        if since is not None:
            epoch = since.get("epoch") if isinstance(since, Mapping) else None
            position = since.get("position") if isinstance(since, Mapping) else None
            if not isinstance(since, Mapping) or not all(
                type(v) is int and 0 <= v < _MAX_STEP for v in (epoch, position)
            ):
                raise _error(f"{where}.from must be a map of integers epoch and position, each at least 0")
            assert isinstance(epoch, int) and isinstance(position, int)
            since = (epoch, position)
        return cls(step=step, samples=samples, shard=shard, reason=reason, values=parsed, since=since)


def parse_record(
    value: object, *, quarantined_shards: Iterable[str], num_samples: int | None = None
) -> tuple[QuarantineEntry, ...]:
    """The stored ``quarantine`` member, checked as a whole (hostile input; ContextError naming the member): entries
    well formed, no sample and no shard in two entries, every entry's shard in ``quarantined_shards``."""
    if not isinstance(value, list):
        raise _error("quarantine must be an array of entries")
    # Each entry names a new sample or a new shard, so a longer record cannot be valid: refused before parsing it.
    if num_samples is not None and len(value) > 2 * num_samples:
        raise _error(f"quarantine has {len(value)} entries, more than {2 * num_samples} can be distinct")
    entries = tuple(QuarantineEntry.from_dict(v, i, num_samples=num_samples) for i, v in enumerate(value))
    shards = set(quarantined_shards)
    seen_shards: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.shard is not None:
            if entry.shard in seen_shards:
                raise _error(f"quarantine[{i}].shard {entry.shard!r} is in an earlier entry too")
            if entry.shard not in shards:
                raise _error(f"quarantine[{i}].shard {entry.shard!r} is not in quarantined_shards")
            seen_shards.add(entry.shard)
    every = samples_of(entries)
    total = sum(len(e.samples) for e in entries)
    if len(every) != total:
        seen: set[int] = set()
        for i, entry in enumerate(entries):
            again = seen.intersection(entry.samples)
            if again:
                raise _error(f"quarantine[{i}].samples: sample {min(again)} is in an earlier entry too")
            seen.update(entry.samples)
    return entries


def samples_of(entries: Sequence[QuarantineEntry]) -> np.ndarray[Any, Any]:
    """Every sample the entries name, ascending, once each (int64)."""
    parts = [np.asarray(e.samples, dtype=np.int64) for e in entries if e.samples]
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)


def new_entry(
    *,
    step: object,
    reason: object,
    values: Mapping[str, object] | None,
    samples: Sequence[int] = (),
    shard: str | None = None,
) -> QuarantineEntry:
    """An entry from a caller's arguments (UsageError for what a writer must not write, spec/fields.md FLD-13):
    ``reason`` one of :data:`REASONS`, values real numbers (kept as float 64, NaN and infinities too)."""
    if type(step) is not int or not 0 <= step < _MAX_STEP:
        raise UsageError(f"step must be an integer at least 0, got {_show(step)}")
    if reason not in REASONS:
        raise UsageError(f"reason must be one of {', '.join(REASONS)}; got {reason!r}")
    parsed: dict[str, float] = {}
    for name, number in (values or {}).items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TEXT:
            raise UsageError(f"a value's name must be a non-empty string of at most {MAX_TEXT} characters")
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            raise UsageError(f"value {name!r} must be a real number (a tensor: pass .item()), got {_show(number)}")
        parsed[name] = float(number)
    if len(parsed) > MAX_VALUES:
        raise UsageError(f"at most {MAX_VALUES} values per entry")
    assert isinstance(step, int) and isinstance(reason, str)
    return QuarantineEntry(step=step, samples=tuple(samples), shard=shard, reason=reason, values=parsed)


def writer_problem(value: object, quarantined_shards: object) -> str | None:
    """Why a ``quarantine`` member breaks what a writer must write (FLD-13), or None."""
    shards = quarantined_shards if isinstance(quarantined_shards, list) else []
    try:
        entries = parse_record(value, quarantined_shards=[s for s in shards if isinstance(s, str)])
    except ContextError as exc:
        return exc.message
    for i, (entry, stored) in enumerate(zip(entries, value if isinstance(value, list) else [], strict=True)):
        if entry.reason not in REASONS:
            return f"quarantine[{i}].reason must be one of {', '.join(REASONS)}, got {entry.reason!r}"
        if "samples" not in stored or "values" not in stored:
            return f"quarantine[{i}] must have 'samples' and 'values' (either may be empty)"
        if any(type(v) is not float for v in stored["values"].values()):
            return f"quarantine[{i}].values must be floats"
    return None


def _parse_samples(value: object, where: str, num_samples: int | None) -> tuple[int, ...]:
    if not isinstance(value, list) or (num_samples is not None and len(value) > num_samples):
        bound = "" if num_samples is None else f" of at most {num_samples}"
        raise _error(f"{where} must be an array{bound} of dataset indices")
    if not all(type(v) is int for v in value):
        raise _error(f"{where} must hold integers only")
    high = _MAX_STEP if num_samples is None else num_samples
    if not all(0 <= v < high for v in value):
        raise _error(f"{where} holds an index outside [0, {num_samples if num_samples is not None else '2^63'})")
    if any(a >= b for a, b in itertools.pairwise(value)):
        raise _error(f"{where} must be ascending, each index once")
    return tuple(value)


def _error(message: str) -> ContextError:
    return ContextError(message, field="data")


def _show(value: object) -> str:
    return repr(value) if value is None or isinstance(value, (bool, int, float)) else type(value).__name__
