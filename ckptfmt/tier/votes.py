"""Small pieces of the memory tier's decisions of every rank (:func:`ckptfmt.decide.decide`): a peer's value checked
as the hostile input it may be, and a rank's failure turned into what it contributes to a decision."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import CheckpointError, CollectiveError, MalformedMessageError, StorageError


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def one_bool(what: str, combine: Callable[[list[bool]], bool]) -> Callable[[Sequence[object]], bool]:
    """A decision over one boolean from every rank (a rank that sends anything else is named)."""

    def decide_fn(values: Sequence[object]) -> bool:
        for rank, value in enumerate(values):
            if not isinstance(value, bool):
                raise MalformedMessageError(f"rank {rank} sent {str(value)[:40]} as {what}, not a boolean")
        return combine([bool(v) for v in values])

    return decide_fn


def as_error(exc: BaseException, rank: int) -> CheckpointError:
    """What a rank contributes to a decision when its part failed: a CheckpointError (an OSError, a bug's raw
    error wrapped, naming the rank)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return StorageError(f"rank {rank}: {exc}")
    return CollectiveError(f"rank {rank} failed: {exc!r}")
