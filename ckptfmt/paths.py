"""The path grammar of files inside a checkpoint (spec/paths.md) and name grammars of fields and tensors."""

from __future__ import annotations

import functools
import re

from .errors import UnsafePathError, UsageError

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".writer-lock"
MAX_PATH_BYTES = 1024
MAX_TENSOR_NAME_BYTES = 1024

_SEGMENT = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,254}")
_FIELD = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_segment(text: str) -> bool:
    """One path segment: 1-255 of ``[A-Za-z0-9._-]``, not starting with '.' (so never '.' or '..')."""
    return _SEGMENT.fullmatch(text) is not None


def check_path(path: object, *, where: str = "manifest", absent: str | None = None) -> str:
    """Return ``path`` if it is a safe relative checkpoint path, else raise UnsafePathError.

    Relative, '/'-separated, normalized: no '..', no '.', no empty segment, no leading '.' in any
    segment (hidden names are the writer's temp and lock files), never the manifest itself.
    """
    if not isinstance(path, str):
        # a missing path breaks the record's own rule (``absent``), any other type MAN-7
        requirement = absent if path is None else "MAN-7"
        raise UnsafePathError(f"{where}: a path must be a string, got {type(path).__name__}", requirement=requirement)
    if not path or len(path.encode("utf-8")) > MAX_PATH_BYTES:
        raise UnsafePathError(f"{where}: path must be 1..{MAX_PATH_BYTES} bytes", path=path, requirement="PTH-2")
    for segment in path.split("/"):
        if _SEGMENT.fullmatch(segment) is None:
            raise UnsafePathError(
                f"{where}: segment {segment!r} breaks the path grammar (relative, no '..', no absolute "
                "path, segments of [A-Za-z0-9._-] not starting with '.')",
                path=path,
                requirement="PTH-2",
            )
    if path == MANIFEST_NAME:
        raise UnsafePathError(f"{where}: a data path must not be the manifest itself", path=path, requirement="PTH-2")
    return path


def check_field_name(name: object) -> str:
    if not isinstance(name, str) or _FIELD.fullmatch(name) is None:
        raise UsageError(f"field name {name!r} must match [a-z][a-z0-9_]{{0,63}}")
    return name


def is_field_name(name: object) -> bool:
    return isinstance(name, str) and _FIELD.fullmatch(name) is not None


def tensor_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid tensor name, or None if it is."""
    if not isinstance(name, str):
        return f"a tensor name must be a string, got {type(name).__name__}"
    return _str_name_problem(name)


@functools.lru_cache(maxsize=1 << 16)  # a trainer snapshotting every step checks the same names each time
def _str_name_problem(name: str) -> str | None:
    size = len(name.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_TENSOR_NAME_BYTES:
        return f"a tensor name must be 1..{MAX_TENSOR_NAME_BYTES} bytes"
    if _CONTROL.search(name):
        return "a tensor name must not contain control characters"
    if name == "__metadata__":
        return "'__metadata__' is reserved by safetensors"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "a tensor name must be valid Unicode (no lone surrogates)"
    return None
