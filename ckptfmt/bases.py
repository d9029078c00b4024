"""Opening the base of a referencing checkpoint, after checking it is the checkpoint that was referenced.

A reader trusts a base for exactly what the referencing manifest says of it (spec/references.md): it is the
sibling ``../<name>`` (REF-3), its manifest hashes to the recorded checkpoint id (REF-7), and it stores every
referenced file itself, at the recorded size and digest (REF-8). Anything else is a
:class:`~ckptfmt.errors.BaseCheckpointError` naming both checkpoints; chunk digests are then checked as for the
checkpoint's own files, against the referencing manifest's records.
"""

from __future__ import annotations

import os

from .errors import BaseCheckpointError, CheckpointError, UnsafePathError
from .manifest import Manifest, checkpoint_id
from .manifest_io import read_manifest_bytes
from .manifest_parse import parse_manifest
from .references import BaseRecord
from .storage import Store


def find_base(manifest: Manifest, location: str) -> BaseRecord:
    for base in manifest.bases:
        if base.location == location:
            return base
    raise BaseCheckpointError(f"no base {location!r} in the manifest", requirement="REF-6")


def _same_root(a: Store, b: Store) -> bool:
    """Whether two stores are one root: one directory (its identity, whatever path names it) on a local
    file system (REF-15), one URL elsewhere."""
    if a.capabilities.local and b.capabilities.local:
        try:
            return os.path.samefile(a.url, b.url)
        except OSError:  # one is gone: not the same (REF-7 then refuses the missing one)
            return False
    return a.url.rstrip("/") == b.url.rstrip("/")


def open_base(own: Store, manifest: Manifest, location: str, *, referrer: str) -> Store:
    """The store of base ``location`` of the checkpoint in ``own`` (``referrer``: its id, for messages)."""
    base = find_base(manifest, location)
    try:
        store = own.sibling(base.name)
    except UnsafePathError as exc:
        if exc.problem != "symlink":
            raise BaseCheckpointError(
                f"checkpoint {own.url} references {location}, which cannot be opened: {exc}",
                path=location,
                requirement="REF-7",
            ) from exc
        raise BaseCheckpointError(
            f"checkpoint {own.url} references {location}, which is a symbolic link: {exc}",
            path=location,
            requirement="REF-16",
        ) from exc
    except CheckpointError as exc:
        raise BaseCheckpointError(
            f"checkpoint {own.url} references {location}, which cannot be opened: {exc}",
            path=location,
            requirement="REF-7",
        ) from exc
    where = f"checkpoint {own.url} ({referrer[:19]}…) references {location} = {store.url} ({base.checkpoint_id})"
    if _same_root(store, own):
        raise BaseCheckpointError(f"{where}, which is itself", path=location, requirement="REF-7")
    try:
        data = read_manifest_bytes(store)
    except CheckpointError as exc:
        store.close()
        raise BaseCheckpointError(f"{where}, which is gone: {exc}", path=location, requirement="REF-7") from exc
    found = checkpoint_id(data)
    if found != base.checkpoint_id:
        store.close()
        raise BaseCheckpointError(
            f"{where}, which was replaced: the checkpoint there is {found}", path=location, requirement="REF-7"
        )
    try:
        stored = {f.path: f for f in parse_manifest(data).files}
    except CheckpointError as exc:  # (the id matched: a manifest only a newer reader understands)
        store.close()
        raise BaseCheckpointError(
            f"{where}, whose manifest is refused: {exc}", path=location, requirement="REF-17"
        ) from exc
    for record in base.files:
        own_record = stored.get(record.path)
        if own_record is None or (own_record.size, own_record.digest) != (record.size, record.digest):
            store.close()
            raise BaseCheckpointError(
                f"{where}, which does not itself store {record.path!r} at {record.size} bytes and digest "
                f"{record.digest} (a reference must name the checkpoint that stores the bytes)",
                path=location,
                requirement="REF-8",
            )
    return store


def check_bases_still_there(store: Store, manifest: Manifest) -> None:
    """Before a referencing checkpoint commits: each base is still the checkpoint that was referenced.

    A writer reads its base before it takes its lock; a gc that planned in between could have deleted it (the
    lock names the bases only from then on, REF-13). A manifest committed over a vanished base would be refused
    by every reader (REF-7): the save fails instead, and nothing is committed.
    """
    for base in manifest.bases:
        try:
            found = checkpoint_id(read_manifest_bytes(store.sibling(base.name)))
        except CheckpointError as exc:
            raise BaseCheckpointError(
                f"the base {base.location} vanished while this save was at work: {exc}; nothing was committed",
                path=base.location,
                requirement="REF-7",
            ) from exc
        if found != base.checkpoint_id:
            raise BaseCheckpointError(
                f"the base {base.location} was replaced while this save was at work (now {found}); nothing was "
                "committed",
                path=base.location,
                requirement="REF-7",
            )
