"""The one exception hierarchy of ckptfmt.

Every error the public API raises derives from :class:`CheckpointError` and carries a stable,
machine-readable ``code`` (used by ``ckpt --json`` and by the conformance vectors), plus the
place it concerns: a path inside the checkpoint, a field, a tensor. Where a builtin exception has
the same meaning, the class inherits it too, so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations

from typing import Literal

PathProblem = Literal["name", "symlink", "file_kind"]  # what an UnsafePathError refused


class CheckpointError(Exception):
    """Base class of every error raised by ckptfmt."""

    code = "checkpoint_error"

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        field: str | None = None,
        tensor: str | None = None,
        requirement: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.field = field
        self.tensor = tensor
        self.requirement = requirement
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"file {self.path!r}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        return prefix + self.message

    def locate(
        self, *, path: str | None = None, field: str | None = None, tensor: str | None = None
    ) -> CheckpointError:
        """Fill in where the error happened, if not already known (e.g. a storage error inside a tensor read)."""
        self.path = self.path if self.path is not None else path
        self.field = self.field if self.field is not None else field
        self.tensor = self.tensor if self.tensor is not None else tensor
        self.args = (self._render(),)
        return self

    def to_dict(self) -> dict[str, str]:
        """A JSON-ready description, the shape ``ckpt --json`` reports."""
        out = {"code": self.code, "message": self.message}
        for key in ("path", "field", "tensor", "requirement"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing at all lives at the URL."""

    code = "not_found"


class IncompleteCheckpointError(CheckpointError):
    """Files exist at the URL but no manifest commits them (a crashed or running writer)."""

    code = "incomplete"


class RestoreError(CheckpointError):
    """A restore that can neither restore a checkpoint nor leave the live state as it was (a fresh restore that read
    a refused checkpoint into it)."""

    code = "restore_failed"


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint (or another live writer) already occupies the URL."""

    code = "exists"


class CheckpointLockedError(CheckpointExistsError):
    """Another writer holds the checkpoint's writer lock."""

    code = "locked"


class ManifestError(CheckpointError, ValueError):
    """The manifest is not valid JSON or breaks the schema."""

    code = "invalid_manifest"


class UnsupportedVersionError(ManifestError):
    """The manifest's major format version is not one this reader implements."""

    code = "unsupported_version"


class UnsupportedExtensionError(ManifestError):
    """The manifest uses an extension marked must_understand that this reader does not know."""

    code = "unsupported_extension"


class MissingFieldError(ManifestError):
    """A field that the checkpoint's profile requires is absent (or of the wrong kind)."""

    code = "missing_field"


class FieldNotFoundError(CheckpointError, KeyError):
    """The caller asked for a field or tensor the checkpoint does not have."""

    code = "no_such_field"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self._render()


class ChunkLayoutError(ManifestError):
    """A tensor's chunks leave a gap, overlap, or fall outside the tensor."""

    code = "chunk_layout"


class UnsafePathError(ManifestError):
    """A path breaks the name grammar, escapes the root, or is a symlink or non-regular file.

    ``problem`` says which, for callers that explain it (never read it from the message): ``"name"`` the
    path itself (grammar, escape: PTH-2), ``"symlink"`` a symlink where an entry of the checkpoint belongs,
    refused and never followed (PTH-3), ``"file_kind"`` an entry of the wrong kind: a FIFO, socket, device or
    directory where a regular file belongs, or a file where a directory belongs (PTH-4). One ``code`` for all.
    """

    code = "unsafe_path"

    def __init__(
        self,
        message: str,
        *,
        problem: PathProblem = "name",
        path: str | None = None,
        field: str | None = None,
        tensor: str | None = None,
        requirement: str | None = None,
    ) -> None:
        self.problem: PathProblem = problem
        super().__init__(message, path=path, field=field, tensor=tensor, requirement=requirement)


class UnsupportedCodecError(CheckpointError):
    """A chunk is stored with a codec this reader does not implement."""

    code = "unsupported_codec"


class IntegrityError(CheckpointError):
    """Stored bytes do not match what the manifest says about them."""

    code = "integrity"


class DigestMismatchError(IntegrityError):
    code = "digest_mismatch"


class SizeMismatchError(IntegrityError):
    code = "size_mismatch"


class MissingFileError(IntegrityError, FileNotFoundError):
    """A file that the manifest lists is absent."""

    code = "missing_file"


class BaseCheckpointError(IntegrityError):
    """A checkpoint that references chunks of another (its base) cannot use it: the base is missing, was
    replaced, or does not itself store the files referenced (spec/references.md)."""

    code = "base_checkpoint"


class SafetensorsHeaderError(IntegrityError):
    """A data file's safetensors header is malformed or disagrees with the manifest."""

    code = "safetensors_header"


class ContextError(CheckpointError, ValueError):
    """A context blob is not valid msgpack of the allowed subset, or breaks its field's schema."""

    code = "invalid_context"


class ConfigHashMismatchError(ContextError):
    code = "config_hash_mismatch"


class DTypeError(CheckpointError, TypeError):
    """An array's dtype has no safetensors equivalent, or a dtype name is unknown."""

    code = "dtype"


class UsageError(CheckpointError, ValueError):
    """The caller used the API wrongly (bad name, writer already closed, shape mismatch...)."""

    code = "usage"


class ReferencedCheckpointError(UsageError):
    """Deleting or replacing a checkpoint that other checkpoints reference (spec/references.md REF-13, REF-14):
    they would no longer be restorable. The message names them."""

    code = "referenced_checkpoint"


class StorageError(CheckpointError, OSError):
    """The storage backend failed (I/O error, permission, network); chained from the original."""

    code = "storage"


class SourceFormatError(CheckpointError, ValueError):
    """A checkpoint in another format (Hugging Face, PyTorch .pt, DCP) is malformed, or unsafe to load."""

    code = "invalid_source"


class ResumeMismatchError(CheckpointError):
    """Resuming under a different config, code commit or dataset than the checkpoint was written with."""

    code = "resume_mismatch"


class CollectiveError(CheckpointError):
    """A multi-rank save or load failed on some rank, or a rank did not answer in time; every rank raises it."""

    code = "collective"


class MessageTooLargeError(CollectiveError):
    """A peer announced a message longer than its receiver accepts; refused before anything was allocated."""

    code = "message_too_large"


class MalformedMessageError(CollectiveError):
    """A peer's message does not parse or does not have the shape its receiver expects; it names the rank."""

    code = "malformed_message"


class HealRefusedError(CollectiveError):
    """A replica group's heal from a peer was refused: the peer could not send the checkpoint at the step asked
    for, or what it sent did not check out (a damaged or lying sender). It names the sender; nothing it sent was
    loaded."""

    code = "heal_refused"


class MemoryCapacityError(CheckpointError):
    """The memory tier's slots do not fit in the memory directory (spec/memory.md MEM-9)."""

    code = "memory_capacity"


class SourceChangedError(CheckpointError, RuntimeError):
    """A parameter or optimizer state tensor changed in place while a snapshot of it was being copied (an async
    save, a memory snapshot): the snapshot would mix two training states under valid digests, so it is refused and
    not committed. Between a save and the next ``optimizer.step()`` only ``step()`` may change them. Names the field
    and tensor. A ``RuntimeError`` as torch's own "modified by an inplace operation" is."""

    code = "source_changed"


def error_from_dict(doc: dict[str, str]) -> CheckpointError:
    """Rebuild an error from :meth:`CheckpointError.to_dict` (how one rank's failure reaches every rank)."""
    classes: dict[str, type[CheckpointError]] = {}
    pending: list[type[CheckpointError]] = [CheckpointError]
    while pending:
        cls = pending.pop()
        classes.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    cls = classes.get(doc.get("code", ""), CollectiveError)
    return cls(
        str(doc.get("message", "")),
        path=doc.get("path"),
        field=doc.get("field"),
        tensor=doc.get("tensor"),
        requirement=doc.get("requirement"),
    )


__all__ = [
    "BaseCheckpointError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "ChunkLayoutError",
    "CollectiveError",
    "ConfigHashMismatchError",
    "ContextError",
    "DTypeError",
    "DigestMismatchError",
    "FieldNotFoundError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "ManifestError",
    "HealRefusedError",
    "MalformedMessageError",
    "MemoryCapacityError",
    "MessageTooLargeError",
    "MissingFieldError",
    "MissingFileError",
    "ReferencedCheckpointError",
    "RestoreError",
    "ResumeMismatchError",
    "SafetensorsHeaderError",
    "SizeMismatchError",
    "SourceChangedError",
    "SourceFormatError",
    "StorageError",
    "UnsafePathError",
    "UnsupportedCodecError",
    "UnsupportedExtensionError",
    "UnsupportedVersionError",
    "UsageError",
    "error_from_dict",
]
