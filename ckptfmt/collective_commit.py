"""The commit of a checkpoint that several ranks write: the coordinator's and the leaders' roles (spec/commit.md
COM-17..COM-21, COM-24), over the one :class:`~ckptfmt.commit.Committer` and the one exchange, ``decide``.

Roles. The *coordinator* (rank 0) decides: it reads every rank's report, checks it and writes the manifest. A
store's *leader* holds that store's :class:`~ckptfmt.commit.Committer`: with one store every rank sees, the
coordinator alone; with several stores (a memory slot on each node), the lowest rank writing to each.

Call sequence, every rank of ``collective`` together (the style of DCP's ``StorageWriter``):

1. :meth:`CollectiveCommit.start` (or :meth:`SpreadCommit.start`): each leader takes its lock and un-commits an
   existing checkpoint (steps 1 and 2); every rank learns the first failure. A rank gone here makes each leader
   give its lock back (COM-20).
2. Each rank writes its data files.
3. :meth:`~CollectiveCommit.commit` with this rank's report, or :meth:`~CollectiveCommit.fail` with its error.

   - One store: the coordinator's ``plan`` turns every report into the manifest and the files it lists (raising
     fails the save), the coordinator writes it (steps 4-5), and every rank returns the checkpoint id or raises
     the same error. On a failure the coordinator deletes every file a rank reported, and its lock; a rank that
     reported never deletes (COM-19). A coordinator whose exchange fails after its manifest is durable has
     committed (COM-20).
   - Several stores (:class:`SpreadCommit`): each rank reports to its store's leader, which checks its store's
     files against its ranks' reports and passes them on as one message (:mod:`~ckptfmt.store_reports`); the
     coordinator merges every store's reports into the manifest; each leader writes that manifest in its store;
     every rank learns whether every store holds it (COM-24). A failure before the merge: each rank deletes its
     own files, each leader its lock.

:func:`start_commit` chooses a writer's role once: :class:`SoloCommit` (one rank, nothing exchanged),
:class:`CollectiveCommit` or :class:`SpreadCommit`. ``tier.persist.persist_spread`` is the second caller: its
ranks report the files they copied, and its plan checks that every file of the snapshot arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .bases import check_bases_still_there
from .collective import Collective, PeerChannel, decode_status, encode_status
from .commit import Committer
from .decide import decide
from .digests import algorithm_of
from .errors import (
    CheckpointError,
    CollectiveError,
    DigestMismatchError,
    MalformedMessageError,
    MissingFileError,
    SizeMismatchError,
    UsageError,
    error_from_dict,
)
from .manifest import MAX_MANIFEST_BYTES, Manifest
from .manifest_parse import parse_manifest
from .manifest_template import ManifestTemplate
from .plan import RankResult, merge_results
from .plan_cache import PlanCache
from .storage import Store
from .store_reports import leader_of, ranks_of_store, read_store_parts, receive_reports, send_to_leader, store_part
from .tree_digests import file_digest_of

log = logging.getLogger("ckptfmt")

COORDINATOR = 0
RECHECK_BYTES = 1 << 20  # the coordinator re-hashes other ranks' files up to this size before it commits
MAX_STATUS_BYTES = 64 << 10  # a rank's part of the lock round and of the stores' round: an error at most

# The coordinator's step 4: every rank's report (JSON values, in rank order) -> the manifest and the files it
# lists that the ranks wrote. It appends to its second argument each file a rank reported, as it reads them:
# those are the coordinator's to delete if the save fails (COM-19).
Plan = Callable[[Sequence[Any], list[str]], tuple[Manifest, list[str]]]


class CollectiveCommit:
    """The commit of one store that every rank writes to (one run directory, shared). See the module docstring."""

    def __init__(
        self,
        store: Store,
        collective: Collective,
        committer: Committer | None,
        *,
        what: str,
        plan: Plan | None = None,
        max_size: int = MAX_MANIFEST_BYTES,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.collective = collective
        self.plan = plan
        self.what = what
        self.max_size = max_size  # of one rank's report (a rank's records are never more than a manifest)
        self.after = after  # on the coordinator, once committed; its failure is every rank's (nothing is deleted)
        self.checkpoint_id: str | None = None  # on the coordinator, once its manifest is durable
        self._committer = committer
        self._after_done = after is None

    @classmethod
    def start(
        cls,
        store: Store,
        collective: Collective,
        *,
        leader: bool,
        overwrite: bool = False,
        bases: tuple[str, ...] = (),
        before_replace: Callable[[], None] | None = None,
        check_manifest: bool = True,
        **options: Any,
    ) -> CollectiveCommit:
        """Step 1 and 2 on the leader(s); the first failure, as the coordinator saw it, fails every rank."""
        committer: Committer | None = None
        error: CheckpointError | None = None
        if leader:
            try:
                committer = Committer(
                    store,
                    overwrite=overwrite,
                    bases=bases,
                    before_replace=before_replace,
                    check_manifest=check_manifest,
                )
            except CheckpointError as exc:
                error = exc
        started = cls(store, collective, committer, **options)
        try:
            started._started(error)
        except BaseException:
            # A rank is gone, or a leader failed, before the save began (COM-20): give the lock back, or this live
            # process holds it for good, gc keeps it and a retry here is refused. Nothing else was written.
            started.release([])
            raise
        return started

    def _started(self, error: CheckpointError | None) -> None:
        """One store: only the coordinator took a lock, so there is nothing to gather; it tells every rank."""
        mine = encode_status(error) if self.collective.rank == COORDINATOR else None
        decode_status(self.collective.broadcast(mine, src=COORDINATOR))

    def commit(self, report: object, *, written: Sequence[str]) -> str:
        """Steps 3-6 on every rank: this rank's ``report`` (a JSON value or its error) to the coordinator, which
        commits; ``written`` are this rank's files. Returns the checkpoint id on every rank, or raises the same
        error on every rank."""
        reported: list[str] = []
        try:
            decided = decide(
                self.collective,
                report,
                lambda reports: self._coordinate(reports, reported),
                what=self.what,
                max_size=self.max_size,
            )
        except CheckpointError as exc:
            if self.checkpoint_id is not None and self._after_done:
                # Committed, and only telling the other ranks failed (one died after the gather): the checkpoint
                # is whole and durable, so this rank's save succeeded (COM-20).
                log.warning("%s: committed, but a rank did not learn it: %s", self.store.url, exc)
                return self.checkpoint_id
            # On the coordinator, uncommitted: its own files, those the ranks reported and the lock. Any other
            # rank handed its files' records to the coordinator, which may have committed a manifest listing them
            # before the exchange failed (COM-19): they are never deleted here, but by the coordinator or gc.
            self.release([*written, *reported])
            raise
        if not isinstance(decided, str):
            raise MalformedMessageError(f"{self.what}: rank {COORDINATOR} sent no checkpoint id")
        return decided

    def commit_result(self, result: RankResult, *, written: Sequence[str]) -> str:
        """:meth:`commit` with a writer's records as this rank's report."""
        return self.commit(rank_report(result), written=written)

    def fail(self, error: CheckpointError, *, written: Sequence[str]) -> None:
        """This rank's part of a failed save: the other ranks' :meth:`commit` fails too (COM-18). A rank that
        failed before it reported deletes the files it wrote (COM-14); the coordinator deletes the rest."""
        try:
            self.commit(failed_report(error), written=written)
        except CheckpointError:
            pass  # the save is failing anyway; the caller raises its own error
        if self.collective.rank != COORDINATOR:
            _delete(self.store, written)

    def release(self, written: Iterable[str]) -> None:
        """On a leader that has not committed: delete ``written`` and the lock. Elsewhere: nothing."""
        if self._committer is not None:
            committer, self._committer = self._committer, None
            committer.abort(list(dict.fromkeys(written)))

    def _coordinate(self, reports: Sequence[Any], reported: list[str]) -> str:
        """On the coordinator: commit if every rank succeeded (any failure raises, for every rank)."""
        assert self._committer is not None and self.plan is not None
        try:
            manifest, files = self.plan(reports, reported)
            self.checkpoint_id = self._committer.commit(manifest, files)
            self._committer = None
            if self.after is not None:
                self.after()
            self._after_done = True
        except CheckpointError:
            raise
        except Exception as exc:  # every rank waits for an answer: whatever fails here, they get one
            raise CollectiveError(f"the coordinator failed to commit: {exc!r}") from exc
        return self.checkpoint_id


class SpreadCommit(CollectiveCommit):
    """The commit of a checkpoint whose ranks write to several stores (COM-24): ``store`` is this rank's,
    ``store_of_rank`` the store index of every rank. The coordinator merges the writers' reports (``profile``,
    ``metadata``: :func:`~ckptfmt.plan.merge_results`); each leader commits the merged manifest in its store."""

    def __init__(
        self,
        store: Store,
        collective: Collective,
        committer: Committer | None,
        *,
        store_of_rank: Sequence[int],
        profile: str,
        metadata: Mapping[str, str],
        **options: Any,
    ) -> None:
        super().__init__(store, collective, committer, **options)
        self.store_of_rank = tuple(store_of_rank)
        self.profile = profile
        self.metadata = dict(metadata)
        self._store_results: list[RankResult] = []  # on a leader: its store's ranks' records, checked (COM-21)

    def _started(self, error: CheckpointError | None) -> None:
        """Several stores: every leader took a lock; the first failure fails every rank."""
        decide(self.collective, error, _nothing, what=self.what, max_size=MAX_STATUS_BYTES)

    def commit(self, report: object, *, written: Sequence[str]) -> str:
        try:
            merged = decide(
                self.collective, self._part(report), self._merge, what=self.what, max_size=2 * self.max_size
            )
            manifest = _parse_merged(merged)
        except BaseException:
            # nothing was committed anywhere: each rank deletes its own files, each leader its lock
            self._delete_own(written)
            raise
        error: CheckpointError | None = None
        committed: str | None = None
        if self._committer is not None:
            committer, self._committer = self._committer, None
            try:
                # this store's files, checked by this leader before the merge (_part)
                paths = [f.path for r in self._store_results for f in r.files]
                # A file of this checkpoint that another store holds now, left here by an earlier save with another
                # placement (MEM-9): the manifest lists it, at its size, but its bytes are stale. Deleted before the
                # commit, so that no reader of this store ever counts it.
                elsewhere = {f.path for f in manifest.files} - set(paths)
                for path in sorted(committer.old_files.keys() & elsewhere):
                    self.store.delete(path)
                committed = committer.commit(manifest, paths)
            except CheckpointError as exc:
                error = exc
                committer.abort([])  # the lock only: the data files stay for gc or the next rewrite
        outcome = decide(
            self.collective,
            error if error is not None else {"checkpoint_id": committed},
            _one_id,
            what=self.what,
            max_size=MAX_STATUS_BYTES,
        )
        if not isinstance(outcome, str) or (committed is not None and committed != outcome):
            raise CollectiveError(f"the stores committed different manifests: {outcome!r} and {committed!r}")
        return outcome

    def _part(self, report: object) -> object:
        """This rank's contribution to the one gather (module :mod:`~ckptfmt.store_reports`): a rank that does not
        lead sends its report to its leader and contributes nothing (or the error it met); a leader contributes its
        store's reports, once it has read them and checked its store's files against them (COM-21, per store)."""
        rank = self.collective.rank
        leader = leader_of(self.store_of_rank, rank)
        channel = self.collective
        assert isinstance(channel, PeerChannel)  # start_commit checked
        if rank != leader:
            return send_to_leader(channel, report, leader=leader)
        try:
            others = [r for r in ranks_of_store(self.store_of_rank, rank) if r != rank]
            reports = {rank: report, **receive_reports(channel, others, max_size=self.max_size)}
            results = read_reports_of(reports)
            check_visible(self.store, results, leader=rank)
        except CheckpointError as exc:
            return exc
        self._store_results = results
        return store_part(reports)

    def fail(self, error: CheckpointError, *, written: Sequence[str]) -> None:
        try:
            decide(
                self.collective,
                self._part(failed_report(error)),
                self._merge,
                what=self.what,
                max_size=2 * self.max_size,
            )
        except CheckpointError:
            pass  # the save is failing anyway; the caller raises its own error
        self._delete_own(written)

    def _delete_own(self, written: Sequence[str]) -> None:
        if self._committer is not None:
            self.release(written)
        else:
            _delete(self.store, written)

    def _merge(self, parts: Sequence[Any]) -> dict[str, object]:
        """On the coordinator: the manifest every store's leader commits, from the stores' parts. Nothing is
        committed here."""
        try:
            results = read_reports(read_store_parts(parts, self.store_of_rank), [])
            manifest = merge_results(results, profile=self.profile, metadata=self.metadata)
        except CheckpointError:
            raise
        except Exception as exc:  # every rank waits for an answer: whatever fails here, they get one
            raise CollectiveError(f"the coordinator failed to merge: {exc!r}") from exc
        return {"manifest": manifest.to_bytes().decode("utf-8")}


# ------------------------------------------------------------ the writer's commit


class SoloCommit:
    """One process, one rank: the writer is its own coordinator, and nothing is exchanged."""

    def __init__(self, store: Store, committer: Committer, *, profile: str, metadata: Mapping[str, str]) -> None:
        self.store = store
        self.profile = profile
        self.metadata = dict(metadata)
        self._committer = committer

    def commit_result(self, result: RankResult, *, written: Sequence[str], cache: PlanCache | None = None) -> str:
        """Merge ``result`` into the manifest and commit it. With ``cache`` (a writer whose plan repeats), the
        manifest is its template filled when ``result`` fits it (manifest_template.py), and otherwise built as
        always and made the template for the next."""
        try:
            template = cache.template if cache is not None else None
            data = template.render(result, profile=self.profile, metadata=self.metadata) if template else None
            if data is not None:
                return self._committer.commit_bytes(data, [f.path for f in result.files], written)
            manifest = merge_results([result], profile=self.profile, metadata=self.metadata)
            check_bases_still_there(self.store, manifest)
            if cache is not None:
                cache.template = ManifestTemplate.of(manifest, result)
            return self._committer.commit(manifest, written)
        except BaseException:
            self._committer.abort(written)
            raise

    def fail(self, error: CheckpointError, *, written: Sequence[str]) -> None:
        self._committer.abort(written)

    def release(self, written: Iterable[str]) -> None:
        self._committer.abort(list(written))


class HandOver:
    """A rank whose records a commit outside this writer turns into the manifest (a DCP save's ``finish``, on
    the coordinator, which holds the lock): no lock here, nothing exchanged. A rank that fails deletes the files
    it wrote (COM-14); once handed over, they are the committer's."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def commit_result(self, result: RankResult, *, written: Sequence[str]) -> str:
        raise UsageError("this writer's records are committed elsewhere: hand_over() gives them")

    def fail(self, error: CheckpointError, *, written: Sequence[str]) -> None:
        _delete(self.store, written)

    def release(self, written: Iterable[str]) -> None:
        _delete(self.store, written)


def start_commit(
    store: Store,
    collective: Collective | None,
    *,
    store_of_rank: Sequence[int] | None,
    profile: str,
    metadata: Mapping[str, str],
    overwrite: bool,
    bases: tuple[str, ...],
    before_replace: Callable[[], None] | None,
    committed_elsewhere: bool = False,
    check_manifest: bool = True,
) -> SoloCommit | CollectiveCommit | HandOver:
    """Step 1 of a writer's commit (spec/commit.md): one rank alone; several ranks and one store every rank sees
    (``store_of_rank`` None), whose coordinator leads; or several stores, each led by the lowest rank writing to
    it; or one rank of several whose records another party commits (``committed_elsewhere``). With overwrite,
    ``before_replace`` is called under the lock before the old checkpoint is un-committed (REF-14); ``bases`` are
    recorded in the lock, so that gc keeps them while this save is at work (REF-13)."""
    if committed_elsewhere:
        return HandOver(store)
    if collective is None:
        committer = Committer(
            store, overwrite=overwrite, bases=bases, before_replace=before_replace, check_manifest=check_manifest
        )
        return SoloCommit(store, committer, profile=profile, metadata=metadata)
    what = f"the save of {store.url}"
    if store_of_rank is not None and not isinstance(collective, PeerChannel):
        raise UsageError(
            "a save over several stores sends each rank's report to its store's leader: its collective must also "
            "be a PeerChannel (send and recv), as ckptfmt.torch's and ThreadCollective are"
        )
    if store_of_rank is None:
        return CollectiveCommit.start(
            store,
            collective,
            leader=collective.rank == COORDINATOR,
            overwrite=overwrite,
            bases=bases,
            before_replace=before_replace,
            check_manifest=check_manifest,
            plan=records_plan(store, profile=profile, metadata=metadata),
            what=what,
        )
    return SpreadCommit.start(
        store,
        collective,
        leader=leader_of(store_of_rank, collective.rank) == collective.rank,
        overwrite=overwrite,
        bases=bases,
        before_replace=before_replace,
        check_manifest=check_manifest,
        store_of_rank=store_of_rank,
        profile=profile,
        metadata=metadata,
        what=what,
    )


def rank_report(result: RankResult) -> dict[str, object]:
    """A rank's report of what it wrote, as the coordinator's plan reads it."""
    return {"result": result.to_bytes().decode("utf-8")}


def failed_report(error: CheckpointError) -> dict[str, object]:
    """A rank's report that it failed. A value, not decide's error: the coordinator still reads the other ranks'
    reports, to delete their files (COM-19: it alone may)."""
    return {"error": error.to_dict()}


def records_plan(store: Store, *, profile: str, metadata: Mapping[str, str]) -> Plan:
    """The writer's plan: every rank's records checked against ``store`` (COM-21) and merged into the manifest."""

    def plan(reports: Sequence[Any], reported: list[str]) -> tuple[Manifest, list[str]]:
        results = read_reports(reports, reported)
        check_visible(store, results)
        manifest = merge_results(results, profile=profile, metadata=metadata)
        check_bases_still_there(store, manifest)
        return manifest, [f.path for r in results for f in r.files]

    return plan


def read_reports(reports: Sequence[Any], reported: list[str]) -> list[RankResult]:
    """Every rank's records; the first failure (a rank's own, or a malformed report) is raised once every file a
    rank reported is in ``reported``, for the coordinator to delete."""
    results: list[RankResult] = []
    error: CheckpointError | None = None
    for rank, report in enumerate(reports):
        try:
            results.append(rank_result(rank, report))
        except CheckpointError as exc:
            error = error or exc.locate(path=f"rank {rank}")
    reported.extend(f.path for r in results for f in r.files)
    if error is not None:
        raise error
    return results


def read_reports_of(reports: Mapping[int, object]) -> list[RankResult]:
    """:func:`read_reports` of some ranks' reports (a store's), by rank; the first failure raised, naming its rank."""
    results: list[RankResult] = []
    for rank in sorted(reports):
        try:
            results.append(rank_result(rank, reports[rank]))
        except CheckpointError as exc:
            raise exc.locate(path=f"rank {rank}") from None
    return results


def rank_result(rank: int, report: object) -> RankResult:
    """A rank's report, read as the hostile input it may be: a CheckpointError naming the rank, never a raw one."""
    if not isinstance(report, dict):
        raise MalformedMessageError(f"rank {rank} sent a report that is not an object")
    if "error" in report:
        reported = report["error"]
        if not isinstance(reported, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in reported.items()
        ):
            raise MalformedMessageError(f"rank {rank} reported a malformed error")
        raise error_from_dict(reported)
    raw = report.get("result")
    if not isinstance(raw, str):
        raise CollectiveError(f"rank {rank} reported success without its result")
    result = RankResult.from_bytes(raw.encode("utf-8"))
    if result.rank != rank:
        raise CollectiveError(f"rank {rank} reported the result of rank {result.rank}")
    return result


def check_visible(store: Store, results: Sequence[RankResult], *, leader: int = COORDINATOR) -> None:
    """Every file a rank reported is there, at its size, for the coordinator (spec/commit.md COM-21).

    Ranks whose storage is not shared (a per-node local directory) each write successfully, and a manifest
    committed from their reports alone would list files the coordinator's storage does not hold. One
    listing, not one request per file (a thousand ranks' files on an object store).
    """
    present = store.list()
    for result in results:
        for record in result.files:
            size = present.get(record.path)
            if size is None:
                raise MissingFileError(
                    f"rank {result.rank} wrote it, but the coordinator does not see it: do all ranks write to "
                    "the same storage?",
                    path=record.path,
                    requirement="COM-21",
                )
            if size != record.size:
                raise SizeMismatchError(
                    f"is {size} bytes for the coordinator, rank {result.rank} reported {record.size}",
                    path=record.path,
                    requirement="COM-21",
                )
            if result.rank != leader and size <= RECHECK_BYTES:
                # Small files (context blobs, small data files) cost a read each: their digests are checked too.
                # Larger data files' digests are the ranks' word; re-reading them would double a save's I/O.
                got = file_digest_of(algorithm_of(record.digest), store.read(record.path, max_size=RECHECK_BYTES))
                if got != record.digest:
                    raise DigestMismatchError(
                        f"hashes to {got} for the coordinator, rank {result.rank} reported {record.digest}",
                        path=record.path,
                        requirement="COM-21",
                    )


def _nothing(_: Sequence[Any]) -> None:
    return None


def _one_id(values: Sequence[Any]) -> str:
    """The checkpoint id every store's leader committed (the others report None): one, or the save fails."""
    ids: set[str] = set()
    for rank, value in enumerate(values):
        if not isinstance(value, dict) or not isinstance(value.get("checkpoint_id"), (str, type(None))):
            raise MalformedMessageError(f"rank {rank} sent a malformed commit status")
        if value["checkpoint_id"]:
            ids.add(value["checkpoint_id"])
    if len(ids) != 1:
        raise CollectiveError(f"the stores committed different manifests: {sorted(ids)}")
    return ids.pop()


def _parse_merged(merged: object) -> Manifest:
    if not isinstance(merged, dict) or not isinstance(merged.get("manifest"), str):
        raise MalformedMessageError(f"rank {COORDINATOR} sent a malformed merged manifest")
    return parse_manifest(merged["manifest"].encode("utf-8"))


def _delete(store: Store, paths: Iterable[str]) -> None:
    """Best effort: stop at the first storage failure (what is left is an incomplete checkpoint that gc removes)."""
    try:
        for path in paths:
            store.delete(path)
    except CheckpointError:
        pass
