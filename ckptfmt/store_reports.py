"""A save over several stores, reported through each store's leader (spec/commit.md COM-24; issue 42).

Every rank of a spread save (a snapshot across nodes' memory slots) used to send its records to the coordinator
itself: one message per rank into rank 0, a thousand nodes of eight ranks, 8,192 messages. Here each rank sends
its report to its store's leader (a peer on its own node), and the leader sends one message for its store:

1. :func:`send_to_leader` (a rank that does not lead), or :func:`receive_reports` and :func:`store_part` (a
   leader): the leader receives its store's reports, reads them as the hostile input they may be, checks that
   every file they list is in its store at its size (COM-21, per store: before the merge now, so that a store
   lacking a file fails the save before any store commits), and makes its store's part: the reports, by rank.
2. The one gather and decision (:func:`~ckptfmt.decide.decide`), whose contributions are the stores' parts (a
   rank that does not lead contributes nothing, or the error it met sending): the coordinator reads each store's
   part with :func:`read_store_parts`, which checks that it covers exactly that store's ranks, and merges.

The bytes into the coordinator stay those of every rank's records: the manifest it merges lists every file, and
every store's leader writes that manifest (COM-24). What falls is the number of messages (ranks to stores) and the
time a rank's records take to reach it (one hop on the node, one message per node across the network).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .collective import PeerChannel
from .errors import CheckpointError, CollectiveError, MalformedMessageError
from .jsonio import load_json

REPORT_TAG = (1 << 31) - 1  # a rank's report to its leader; replica rounds and restore transfers use lower tags


def leader_of(store_of_rank: Sequence[int], rank: int) -> int:
    """The lowest rank writing to ``rank``'s store."""
    return store_of_rank.index(store_of_rank[rank])


def ranks_of_store(store_of_rank: Sequence[int], rank: int) -> list[int]:
    """Every rank writing to ``rank``'s store, in order."""
    mine = store_of_rank[rank]
    return [r for r, s in enumerate(store_of_rank) if s == mine]


def send_to_leader(channel: PeerChannel, report: object, *, leader: int) -> CheckpointError | None:
    """A rank that does not lead: its report (a JSON value) to its leader. Returns the error it met sending, for
    the gather that follows, where it fails the save on every rank (the rank still joins that gather)."""
    try:
        channel.send(
            json.dumps(report, sort_keys=True, separators=(",", ":")).encode("utf-8"), dst=leader, tag=REPORT_TAG
        )
    except CheckpointError as exc:
        return exc
    return None


def receive_reports(channel: PeerChannel, ranks: Sequence[int], *, max_size: int) -> dict[int, object]:
    """A leader: the report of each of ``ranks`` (its store's, without itself), each parsed as hostile input.

    Every report is received before any is judged, so that no honest rank is left blocked in its send; the first
    failure is raised after that, naming its rank."""
    reports: dict[int, object] = {}
    error: CheckpointError | None = None
    for rank in ranks:
        try:
            data = channel.recv(src=rank, tag=REPORT_TAG, max_size=max_size)
            reports[rank] = load_json(data, error=MalformedMessageError, what=f"the report of rank {rank}")
        except CheckpointError as exc:
            error = error or exc.locate(path=f"rank {rank}")
    if error is not None:
        raise error
    return reports


def store_part(reports: dict[int, object]) -> dict[str, object]:
    """A leader's contribution to the gather: its store's reports, by rank."""
    return {"reports": {str(rank): reports[rank] for rank in sorted(reports)}}


def read_store_parts(values: Sequence[Any], store_of_rank: Sequence[int]) -> list[object]:
    """The coordinator: every rank's report, in rank order, from the stores' parts (``values`` in rank order).

    A leader's part must hold the reports of exactly its store's ranks; any other rank contributes nothing. A
    part that breaks this is refused naming the rank that sent it: a leader may not speak for another store."""
    if len(values) != len(store_of_rank):
        raise CollectiveError(f"{len(values)} parts for {len(store_of_rank)} ranks")
    reports: list[object] = [None] * len(store_of_rank)
    for rank, value in enumerate(values):
        if leader_of(store_of_rank, rank) != rank:
            if value is not None:
                raise MalformedMessageError(f"rank {rank} does not lead its store, yet sent a part of the reports")
            continue
        part = value.get("reports") if isinstance(value, dict) and set(value) == {"reports"} else None
        expected = [str(r) for r in ranks_of_store(store_of_rank, rank)]
        if not isinstance(part, dict) or sorted(part, key=_as_rank) != expected:
            raise MalformedMessageError(
                f"rank {rank} leads the store of ranks {', '.join(expected)}, and sent a part that does not hold "
                "exactly their reports"
            )
        for key, report in part.items():
            reports[int(key)] = report
    return reports


def _as_rank(key: str) -> int:
    return int(key) if key.isdigit() else -1
