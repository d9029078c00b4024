"""The library's version, at the bottom of the house: the writer and provenance record it, the package face
re-exports it, and none of them has to import the face for it."""

from __future__ import annotations

__version__ = "0.1.0"  # as pyproject.toml's [project] version
