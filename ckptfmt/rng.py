"""Capture and restore random generators in the encodings of spec/fields.md (the ``rng`` field).

Framework-free kinds live here (Python's ``random``, numpy's legacy global state and numpy
``Generator``/``BitGenerator`` objects); torch generators are captured by ``ckptfmt.torch``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import ContextError

PYTHON = "python.random"
NUMPY_LEGACY = "numpy.random_state"
NUMPY_BIT_GENERATOR = "numpy.bit_generator"


def capture_python(rnd: random.Random | None = None) -> dict[str, object]:
    version, internal, gauss_next = (rnd or random).getstate()
    return {"kind": PYTHON, "state": [version, list(internal), gauss_next]}


def capture_numpy_legacy(state: np.random.RandomState | None = None) -> dict[str, object]:
    algorithm, key, pos, has_gauss, cached = (state or np.random).get_state(legacy=True)
    return {
        "kind": NUMPY_LEGACY,
        "state": {
            "algorithm": algorithm,
            "key": np.asarray(key, dtype=np.uint32),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def capture_numpy_generator(gen: np.random.Generator | np.random.BitGenerator) -> dict[str, object]:
    bit_generator = gen.bit_generator if isinstance(gen, np.random.Generator) else gen
    return {"kind": NUMPY_BIT_GENERATOR, "state": bit_generator.state}


def capture_default(generators: Mapping[str, np.random.Generator] | None = None) -> dict[str, object]:
    """The ``rng`` field for Python's and numpy's global generators plus any named numpy Generators."""
    out: dict[str, object] = {"python": capture_python(), "numpy": capture_numpy_legacy()}
    for name, gen in (generators or {}).items():
        out[name] = capture_numpy_generator(gen)
    return {"generators": out}


def _state(entry: object, kind: str, name: str) -> Any:
    if not isinstance(entry, Mapping) or entry.get("kind") != kind:
        raise ContextError(f"generator {name!r} is not of kind {kind!r}", field="rng")
    return entry["state"]


def restore_python(entry: Mapping[str, object], rnd: random.Random | None = None, name: str = "python") -> None:
    state = _state(entry, PYTHON, name)
    try:
        version, internal, gauss_next = state
        (rnd or random).setstate((version, tuple(internal), gauss_next))
    except (TypeError, ValueError) as exc:
        raise ContextError(f"generator {name!r}: invalid {PYTHON} state: {exc}", field="rng") from exc


def restore_numpy_legacy(
    entry: Mapping[str, object], state: np.random.RandomState | None = None, name: str = "numpy"
) -> None:
    value = _state(entry, NUMPY_LEGACY, name)
    try:
        key = np.asarray(value["key"], dtype=np.uint32)
        target = state or np.random
        target.set_state((value["algorithm"], key, value["pos"], value["has_gauss"], value["cached_gaussian"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ContextError(f"generator {name!r}: invalid {NUMPY_LEGACY} state: {exc}", field="rng") from exc


def restore_numpy_generator(
    entry: Mapping[str, object], gen: np.random.Generator | np.random.BitGenerator, name: str = "generator"
) -> None:
    value = _state(entry, NUMPY_BIT_GENERATOR, name)
    bit_generator = gen.bit_generator if isinstance(gen, np.random.Generator) else gen
    try:
        bit_generator.state = value
    except (KeyError, TypeError, ValueError) as exc:
        raise ContextError(f"generator {name!r}: invalid {NUMPY_BIT_GENERATOR} state: {exc}", field="rng") from exc


def restore_default(
    rng_field: Mapping[str, object], generators: Mapping[str, np.random.Generator] | None = None
) -> None:
    """Restore what :func:`capture_default` captured; every named generator must be present."""
    entries = rng_field.get("generators")
    if not isinstance(entries, Mapping):
        raise ContextError("'generators' must be a map", field="rng")
    for required in ("python", "numpy", *(generators or {})):
        if required not in entries:
            raise ContextError(f"generator {required!r} is missing from the checkpoint", field="rng")
    restore_python(entries["python"])
    restore_numpy_legacy(entries["numpy"])
    for name, gen in (generators or {}).items():
        restore_numpy_generator(entries[name], gen, name)
