"""ckptfmt.decide: every rank returns the coordinator's decision or raises the same error, naming the ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from rank_threads import run_ranks

from ckptfmt.collective import ThreadCollective
from ckptfmt.decide import decide
from ckptfmt.errors import (
    CollectiveError,
    DigestMismatchError,
    MalformedMessageError,
    MessageTooLargeError,
)

# A long timeout: a rank left waiting would hang the test past it, so every outcome below is reached by
# the coordinator's broadcast, never by a timeout (the errors' messages say which).
TIMEOUT = 120.0


def total(values: Sequence[Any]) -> int:
    return sum(int(v) for v in values)


def test_every_rank_gets_the_decision() -> None:
    out = run_ranks(3, lambda _, c: decide(c, c.rank + 1, total, what="a sum"), TIMEOUT)
    assert out == [6, 6, 6]


def test_one_rank_alone() -> None:
    assert decide(None, 5, total, what="a sum") == 5
    with pytest.raises(CollectiveError, match="a sum: rank 0: nope"):
        decide(None, CollectiveError("nope"), total, what="a sum")


def test_failing_ranks_are_all_named_with_the_first_failure_s_class() -> None:
    def body(_: int, c: ThreadCollective) -> Any:
        mine: object = c.rank
        if c.rank == 1:
            mine = DigestMismatchError("bad bytes", path="weights/x.safetensors")
        if c.rank == 2:
            mine = CollectiveError("peer gone")
        return decide(c, mine, total, what="the restore")

    out = run_ranks(3, body, TIMEOUT)
    for exc in out:
        assert isinstance(exc, DigestMismatchError)
        assert exc.path == "weights/x.safetensors"
        assert "rank 1: bad bytes" in str(exc) and "rank 2: peer gone" in str(exc)


def test_a_malformed_contribution_fails_every_rank_at_once_with_a_checkpoint_error() -> None:
    def needs_objects(values: Sequence[Any]) -> int:
        return sum(v["n"] for v in values)  # a string value raises TypeError here

    out = run_ranks(
        3, lambda _, c: decide(c, "x" if c.rank == 2 else {"n": 1}, needs_objects, what="the holdings"), TIMEOUT
    )
    for exc in out:
        assert isinstance(exc, MalformedMessageError)
        assert "the holdings" in str(exc) and "malformed" in str(exc)
        assert "within" not in str(exc)  # not a timeout


def test_a_decide_function_names_the_rank_it_refuses() -> None:
    def checked(values: Sequence[Any]) -> int:
        for rank, v in enumerate(values):
            if not isinstance(v, int):
                raise MalformedMessageError(f"rank {rank} sent {type(v).__name__}, not an integer")
        return total(values)

    out = run_ranks(2, lambda _, c: decide(c, [1] if c.rank == 1 else 1, checked, what="a count"), TIMEOUT)
    assert all(isinstance(e, MalformedMessageError) and "rank 1 sent list" in str(e) for e in out)


def test_hostile_bytes_are_refused_by_the_bounded_reader() -> None:
    deep = "[" * 10_000 + "]" * 10_000

    # rank 1 bypasses the encoder: what a buggy or lying process would put on the wire
    def body(_: int, c: ThreadCollective) -> Any:
        if c.rank == 1:
            c.gather(('{"ok":' + deep + "}").encode(), dst=0)
            return c.broadcast(None, src=0)
        return decide(c, 0, total, what="the options")

    out = run_ranks(2, body, TIMEOUT)
    assert isinstance(out[0], MalformedMessageError) and "rank 1" in str(out[0]) and "nests deeper" in str(out[0])
    assert b"nests deeper" in out[1]  # the verdict rank 1 received is that refusal


def test_an_oversized_contribution_is_refused_before_it_is_parsed() -> None:
    out = run_ranks(
        3, lambda _, c: decide(c, "y" * (4096 if c.rank == 2 else 1), len, what="a list", max_size=1024), TIMEOUT
    )
    for exc in out:
        assert isinstance(exc, MessageTooLargeError)
        assert "rank 2" in str(exc) and "a list" in str(exc)
