"""Reading a store's manifest bytes: the one place that says why there is no committed checkpoint here.

Below the reader and the bases (which both need a manifest's bytes before they can parse or trust it), and
below the memory tier, which reads a slot's manifest to learn which checkpoint it holds.
"""

from __future__ import annotations

from .errors import CheckpointNotFoundError, IncompleteCheckpointError, MissingFileError, UnsafePathError
from .manifest import MAX_MANIFEST_BYTES
from .paths import MANIFEST_NAME
from .storage import Store


def read_manifest_bytes(store: Store) -> bytes:
    """The manifest's bytes, or the error that says why there is no committed checkpoint here."""
    try:
        return store.read(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES)
    except UnsafePathError as exc:  # a symlink, FIFO, directory... where manifest.json should be
        raise UnsafePathError(exc.message, path=MANIFEST_NAME, requirement="MAN-25") from exc
    except MissingFileError:
        present = [p for p in store.list() if p != MANIFEST_NAME]
        if present:
            raise IncompleteCheckpointError(
                f"{len(present)} file(s) but no manifest commits them: a writer crashed or is still running",
                path=store.url,
                requirement="COM-15",
            ) from None
        raise CheckpointNotFoundError("no checkpoint here", path=store.url) from None
