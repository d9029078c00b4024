"""References to chunks stored in another checkpoint of the same run (spec/references.md).

An incremental checkpoint records the chunks it did not write again as *references*: chunk records whose
bytes live in a **base**, a sibling checkpoint named by its location (``../<name>``) and its checkpoint id.
The manifest lists them under the ``ckptfmt.references`` extension (``must_understand``: a reader that does
not know it would look for the bytes in the wrong checkpoint), with the size and digest of every base file a
chunk uses. In memory a referenced chunk's ``path`` is *virtual*, ``<location>/<path in the base>`` (own paths
never begin with ``.``, REF-2), so everything keyed by a chunk's path (file checks, the read plan, verify)
works unchanged over a store that routes ``../<name>/`` to the base (:class:`~ckptfmt.storage.routed.RoutedStore`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from . import paths
from .errors import ManifestError

EXTENSION = "ckptfmt.references"
PARENT = "../"


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseFile:
    """A file of a base that a referenced chunk lives in, with the size and digest the base's manifest gives."""

    path: str  # in the base
    size: int
    digest: str

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "digest": self.digest}


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseRecord:
    """One base: where it is (``../<name>``), which checkpoint it must be, and the files of it that are used."""

    location: str
    checkpoint_id: str
    files: tuple[BaseFile, ...]

    @property
    def name(self) -> str:
        """The base's directory name in the run directory."""
        return self.location[len(PARENT) :]

    def virtual(self, path: str) -> str:
        return virtual_path(self.location, path)

    def to_dict(self) -> dict[str, object]:
        return {
            "location": self.location,
            "checkpoint_id": self.checkpoint_id,
            "files": [f.to_dict() for f in self.files],
        }


def virtual_path(location: str, path: str) -> str:
    """The key under which a reader addresses ``path`` of the base at ``location``."""
    return f"{location}/{path}"


def location_of(name: str) -> str:
    return PARENT + name


def check_location(value: object) -> str:
    """``../<segment>``: a sibling in the run directory, never absolute, never further up (REF-3)."""
    if not isinstance(value, str) or not value.startswith(PARENT):
        raise ManifestError(f"base location {value!r} must be '../<name>'", requirement="REF-3")
    name = value[len(PARENT) :]
    if not paths.is_segment(name):
        raise ManifestError(
            f"base location {value!r} must be '../' and one path segment (no '/', no leading '.')",
            requirement="REF-3",
        )
    return value


def referenced_sizes(bases: Iterable[BaseRecord]) -> dict[str, int]:
    """Virtual path -> size, for every base file the manifest lists."""
    return {b.virtual(f.path): f.size for b in bases for f in b.files}


def extension_dict(bases: Iterable[BaseRecord]) -> dict[str, object]:
    return {
        "name": EXTENSION,
        "must_understand": True,
        "configuration": {"bases": [b.to_dict() for b in sorted(bases, key=lambda b: b.location)]},
    }
