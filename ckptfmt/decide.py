"""Every rank decides together: the one gather, decide, broadcast of ckptfmt (STYLE 16 and 17).

Each rank contributes a JSON value, or the :class:`~ckptfmt.errors.CheckpointError` it failed with. The
coordinator treats every contribution as hostile input: a length over ``max_size`` is refused before it is
allocated, and the bytes are parsed by the bounded JSON reader. It decides only when every rank succeeded; a
decision that raises (a malformed contribution included) becomes an error. Every rank then returns the same
decision, or raises the same error, which names every failing rank. No rank is left waiting out a timeout
because the coordinator met something it did not expect.

Call sequence (every rank of ``collective``, together)::

    decision = decide(collective, mine, lambda values: ..., what="the memory options")

``collective=None`` is one rank: ``decide`` is applied to ``[mine]`` alone, with the same checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .collective import Collective
from .errors import CheckpointError, CollectiveError, MalformedMessageError, error_from_dict
from .jsonio import load_json

COORDINATOR = 0
MAX_CONTRIBUTION = 64 << 20  # one rank's part, unless the call says otherwise
MAX_DECISION = 256 << 20


def decide(
    collective: Collective | None,
    mine: object,
    decide_fn: Callable[[Sequence[Any]], object],
    *,
    what: str,
    max_size: int = MAX_CONTRIBUTION,
    coordinator: int = COORDINATOR,
) -> Any:
    """The coordinator's ``decide_fn`` of every rank's ``mine`` (JSON values, in rank order), on every rank.

    ``mine`` may be a :class:`CheckpointError` (this rank failed): then nothing is decided and every rank raises
    one error naming each failing rank (the first failure's class and code). ``decide_fn`` runs on the
    coordinator only, over values that passed the bounded parse; anything it raises, a builtin ``KeyError`` or
    ``TypeError`` on a malformed value included, is turned into a :class:`CollectiveError` that every rank raises
    (:class:`~ckptfmt.errors.MalformedMessageError` for the builtin ones; a ``decide_fn`` that checks values
    raises that itself, naming the rank).
    """
    contribution = _encode(mine)
    if collective is None:
        return _decode(_verdict([contribution], decide_fn, what=what, max_size=max_size), what=what, rank=coordinator)
    verdict: bytes | None = None
    try:
        gathered = collective.gather(contribution, dst=coordinator, max_size=max_size)
    except CollectiveError as exc:
        if collective.rank != coordinator:
            raise
        # still broadcast: the others learn it now, instead of each waiting out its timeout
        verdict = _encode(_prefixed(exc, what))
    else:
        if gathered is not None:
            verdict = _verdict(gathered, decide_fn, what=what, max_size=max_size)
    decision = collective.broadcast(verdict, src=coordinator)
    return _decode(decision, what=f"the decision on {what}", max_size=MAX_DECISION, rank=coordinator)


def _encode(value: object) -> bytes:
    doc = {"error": value.to_dict()} if isinstance(value, CheckpointError) else {"ok": value}
    return json.dumps(doc, sort_keys=True, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _decode(data: bytes, *, what: str, rank: int, max_size: int = MAX_DECISION) -> Any:
    """The ``ok`` value of one rank's message, or raise the error it carries (or a malformed one)."""
    if len(data) > max_size:
        raise CollectiveError(f"rank {rank} sent {what} of {len(data):,} bytes; at most {max_size:,} are accepted")
    doc = load_json(data, error=MalformedMessageError, what=f"{what} from rank {rank}")
    if isinstance(doc, dict) and set(doc) == {"ok"}:
        return doc["ok"]
    if isinstance(doc, dict) and set(doc) == {"error"} and isinstance(doc["error"], dict):
        reported = doc["error"]
        if all(isinstance(k, str) and isinstance(v, str) for k, v in reported.items()):
            raise error_from_dict(reported)
    raise MalformedMessageError(f"{what} from rank {rank} is neither a value nor an error")


def _verdict(
    gathered: Sequence[bytes], decide_fn: Callable[[Sequence[Any]], object], *, what: str, max_size: int
) -> bytes:
    values: list[Any] = []
    failures: list[tuple[int, CheckpointError]] = []
    for rank, data in enumerate(gathered):
        try:
            values.append(_decode(data, what=what, max_size=max_size, rank=rank))
        except CheckpointError as exc:
            failures.append((rank, exc))
    if failures:
        return _encode(_combined(failures, what=what))
    try:
        return _encode(decide_fn(values))
    except CheckpointError as exc:
        return _encode(exc)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, AssertionError, RecursionError) as exc:
        return _encode(MalformedMessageError(f"{what}: a rank sent a malformed message ({type(exc).__name__}: {exc})"))


def _combined(failures: Sequence[tuple[int, CheckpointError]], *, what: str) -> CheckpointError:
    """One error for every failing rank: the first one's class, code and place; every rank's message."""
    first = failures[0][1]
    doc = first.to_dict()
    parts = [f"rank {rank}: {exc.message if i == 0 else exc}" for i, (rank, exc) in enumerate(failures)]
    doc["message"] = f"{what}: " + "; ".join(parts)
    return error_from_dict(doc)


def _prefixed(error: CheckpointError, what: str) -> CheckpointError:
    doc = error.to_dict()
    doc["message"] = f"{what}: {error.message}"
    return error_from_dict(doc)
