"""The restore every rank agrees on, from whatever the live nodes' memory holds (spec/memory.md, MEM-11, MEM-12).

Call sequence (every rank, together)::

    agreed = AgreedRestore(tier, collective=..., channel=..., nodes=..., ...)
    for option in agreed.options():            # complete checkpoints in memory, newest first
        fetched = agreed.fetch(option, needed) # the files this node lacks, sent by the nodes that have them
        ...read the checkpoint through fetched.store (every chunk's digest checked), agree, apply...

Planned hierarchically, so that what reaches the coordinator grows with the nodes, never with their files:

1. each node's leader lists its holdings (:func:`~.holdings.node_holdings`: each manifest hashes to its id, each
   step is its manifest's binding's) and sends the coordinator one completeness summary per checkpoint
   (:func:`~.summary.summarize`: ranges of writer ranks it holds whole);
2. the coordinator chooses the complete checkpoints (:func:`~.summary.choose`), a summary counting for the node of
   the leader that sent it, and broadcasts them with the map of which node holds which writer ranks;
3. their manifests: the coordinator reads them from its own node's memory, or asks one holder's leader for each it
   lacks; each must hash to its id, bind its step and run, and list the writer ranks the nodes agreed on;
4. at :meth:`fetch`, each rank sends the writer ranks its reads need (ranges); the coordinator broadcasts each
   node's union; every rank then plans every node's fetches alike (:func:`~.summary.plan_fetches`), and the ranks
   named move each writer rank's files whole, the holder reading them from its own node's memory.

A transfer that fails (a damaged byte, a peer gone, a holder that lied) is reported; the caller then makes every
rank pass over the option together. Every exchange goes through :func:`~ckptfmt.decide.decide`: a message is
hostile input (bounded parse, strict records, the rank named in the error), so a malformed one fails every rank at
once instead of leaving the others waiting out their timeout. A rank reads and writes only directories directly
under its own node's memory directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..collective import Collective, PeerChannel
from ..decide import MAX_DECISION, decide
from ..errors import CheckpointError, CollectiveError, DigestMismatchError, MalformedMessageError, UnsafePathError
from ..manifest import Manifest, checkpoint_id
from ..manifest_parse import parse_manifest
from ..storage.base import FileInfo, Store
from ..storage.overlay import OverlayStore
from ..storage.slot import SlotStore
from .binding import SlotBinding, normalize_run_url
from .holdings import FETCH_PREFIX, PEER_PREFIX, Holding, check_checkpoint_id, node_holdings
from .nodes import NodeMap
from .replica import ROUND_TAGS
from .restore_messages import MemoryOption, RestoreMessages, held_doc, parse_options
from .ring import SLOT_PREFIX, MemoryTier, private_dir_problem
from .summary import (
    Completeness,
    Ranges,
    choose,
    holders_of,
    minus,
    plan_fetches,
    rank_groups,
    summarize,
    to_ranges,
)
from .wire import receive_files, send_files

__all__ = ["AgreedRestore", "Fetch", "Fetched", "HeldStore", "MemoryOption"]

log = logging.getLogger("ckptfmt")

# A leader's summaries: a few ranges of writer ranks for each checkpoint its node holds (a handful), never files.
MAX_SUMMARY_BYTES = 1 << 20
MAX_NEEDS_BYTES = 64 << 10  # one rank's needs: ranges of writer ranks
FETCH_ID_CHARS = 16  # of the checkpoint id's hex digits, in the name of its fetch directory
# the directories a holding may be, directly under a node's memory directory of the run
_HOLDING_DIR = re.compile(rf"{SLOT_PREFIX}\d+|{PEER_PREFIX}\d+-\d+|{FETCH_PREFIX}[0-9a-f]{{{FETCH_ID_CHARS}}}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetch:
    """One writer rank's files of a checkpoint, sent whole by rank ``src`` (on a node that holds them) to rank
    ``dst`` (on a node whose ranks need them and that lacks them)."""

    writer: int  # OTHER: the files no rank's name claims
    src: int
    dst: int


@dataclass(slots=True, kw_only=True)
class Fetched:
    """What :meth:`AgreedRestore.fetch` gathered on this rank."""

    store: OverlayStore
    fetches: tuple[Fetch, ...]
    bytes_moved: int  # between nodes, over every rank
    seconds: float
    labels: dict[str, str] = field(default_factory=dict)  # path -> where a fetched file came from

    def sources(self) -> dict[str, str]:
        """Each file this rank read -> where from: ``memory`` (this node's slot), ``peer-copy`` (a replica another
        node sent this node), ``peer:rank R`` (sent at this restore by rank R of another node)."""
        return {p: self.labels.get(p, label) for p, label in sorted(self.store.sources.items())}


class HeldStore(SlotStore):
    """A holding's directory as a restore reads it: only the files its holding counts are listed, so a stale file
    beside them (a rank's file an earlier placement left in a slot, MEM-9) never answers for the checkpoint in an
    overlay, which reads only what its layers list."""

    def __init__(self, root: str | os.PathLike[str], files: Iterable[str]) -> None:
        super().__init__(root)
        self.held = frozenset(files)

    def list(self) -> dict[str, int]:
        if not self.held:
            return {}
        return {p: s for p, s in super().list().items() if p in self.held}

    def list_detail(self) -> dict[str, FileInfo]:
        if not self.held:
            return {}
        return {p: i for p, i in super().list_detail().items() if p in self.held}


class AgreedRestore:
    def __init__(
        self,
        tier: MemoryTier,
        *,
        collective: Collective | None,
        channel: PeerChannel | None,
        nodes: NodeMap,
        node: str,
        run_id: str,
        run_dir: str,
        rank: int,
    ) -> None:
        self.tier = tier
        self.collective = collective
        self.channel = channel
        self.nodes = nodes
        self.node = node
        self.run_id = run_id
        self.run_dir = run_dir
        self.rank = rank
        self._messages = RestoreMessages(nodes)
        self._ranks = self._messages.ranks  # each node's ranks, lowest first
        self._mine: list[Holding] = []  # this node's holdings, as this rank listed them
        self._manifests: dict[str, bytes] = {}  # of this node's holdings, each hashing to its id
        self._held: dict[str, dict[str, Ranges]] = {}  # option's id -> node -> writer ranks it holds whole
        self._steps: list[tuple[int, str]] = []  # the options' (step, id)
        self._writers: dict[str, Ranges] = {}  # the coordinator's: each chosen checkpoint's writers, as agreed

    @property
    def held(self) -> list[dict[str, object]]:
        """What each live node holds of each complete checkpoint: writer ranks, as ranges (after :meth:`options`)."""
        steps = {cid: step for step, cid in self._steps}
        return [
            {"node": node, "step": steps[cid], "checkpoint_id": cid, "ranks": [list(r) for r in ranges]}
            for cid, by_node in self._held.items()
            for node, ranges in by_node.items()
        ]

    # ---------------------------------------------------------------- the options

    def options(self) -> list[MemoryOption]:
        """The complete checkpoints in the live nodes' memory, newest step first (a collective call).

        A leader's summaries that do not parse fail the call on every rank, at once, with a
        :class:`~ckptfmt.errors.CollectiveError` naming the rank (the caller then passes over the memory options);
        a checkpoint whose summaries or manifest do not check out is left out, with a warning naming the ranks."""
        leader = self.nodes.leader(self.node) == self.rank
        mine: object = None
        if leader:
            self.clean_up()  # files fetched by an earlier restore that died: nobody reads them now
            try:
                mine = self._summaries()
            except CheckpointError as exc:
                mine = exc
        chosen = decide(self.collective, mine, self._choose, what="the memory options", max_size=MAX_SUMMARY_BYTES)
        if not leader:  # listed after the leader's clean-up, which ended before its summaries were sent
            self._list_mine()
        steps, held, ask = self._messages.parse_choice(chosen)
        asked = [cid for cid, rank in ask.items() if rank == self.rank and cid in self._manifests]
        decision = decide(
            self.collective,
            {cid: self._manifests[cid].decode("utf-8") for cid in asked},
            lambda values: self._with_manifests(steps, values),
            what="the memory options' manifests",
            max_size=MAX_DECISION,
        )
        options = parse_options(decision, steps)
        self._steps = [(o.step, o.checkpoint_id) for o in options]
        self._held = {o.checkpoint_id: held[o.checkpoint_id] for o in options}
        return options

    def _list_mine(self) -> None:
        self._mine, self._manifests = node_holdings(
            self.tier, node=self.node, run_id=self.run_id, run_dir=self.run_dir, slot_count=self.tier.slot_count
        )

    def _summaries(self) -> object:
        """This node's completeness summaries (its leader's part of :meth:`options`)."""
        self._list_mine()
        groups = {cid: rank_groups(data) for cid, data in self._manifests.items()}
        return {"summaries": [c.to_dict() for c in summarize(self._mine, groups)]}

    def _choose(self, values: Sequence[object]) -> object:
        """The coordinator's choice, from each node's summaries, and whom to ask for the manifests it lacks."""
        summaries = self._bear_out(self._messages.parse_summaries(values))
        claims: dict[str, dict[tuple[int, Ranges], list[str]]] = {}
        for node, cs in summaries.items():
            for c in cs:
                claims.setdefault(c.checkpoint_id, {}).setdefault((c.step, c.writers), []).append(node)
        for cid, claimed in claims.items():
            if len(claimed) > 1:
                log.warning(
                    "the nodes' leaders disagree on checkpoint %s, which is passed over: %s",
                    cid,
                    "; ".join(
                        f"{self._ranks_of(nodes)} claim step {step}, writer ranks {list(map(list, writers))[:4]}"
                        for (step, writers), nodes in claimed.items()
                    ),
                )
        found = choose(summaries)
        self._writers = {cid: next(iter(claims[cid]))[1] for _, cid in found}
        ask: dict[str, int] = {}
        for _, cid in found:
            if cid not in self._manifests:
                holder = min((n for n, cs in summaries.items() for c in cs if c.checkpoint_id == cid), key=self._order)
                ask[cid] = self._ranks[holder][0]
        return {
            "chosen": [[step, cid] for step, cid in found],
            "held": {cid: held_doc(summaries, cid) for _, cid in found},
            "ask": ask,
        }

    def _bear_out(self, summaries: Mapping[str, Sequence[Completeness]]) -> dict[str, list[Completeness]]:
        """The summaries, less those of a checkpoint whose manifest the coordinator's node holds that claim another
        step than its binding's or other writer ranks than it lists (a claim it cannot check now waits for the
        manifest: :meth:`_with_manifests`)."""
        truth: dict[str, tuple[int, Ranges]] = {}
        for cid, data in self._manifests.items():
            try:
                step = SlotBinding.from_metadata(parse_manifest(data).metadata).step
            except CheckpointError:
                continue
            truth[cid] = (step, to_ranges(rank_groups(data)))
        out: dict[str, list[Completeness]] = {}
        for node, cs in summaries.items():
            out[node] = []
            for c in cs:
                known = truth.get(c.checkpoint_id)
                if known is not None and known != (c.step, c.writers):
                    log.warning(
                        "%s claims step %d for %s, its manifest's binding says step %d (or lists other writer ranks): "
                        "its summary of it is refused",
                        self._ranks_of([node]),
                        c.step,
                        c.checkpoint_id,
                        known[0],
                    )
                    continue
                out[node].append(c)
        return out

    def _order(self, node: str) -> int:
        return self._ranks[node][0]

    def _ranks_of(self, nodes: Iterable[str]) -> str:
        return ", ".join(f"rank {self._ranks[n][0]} (node {n[:80]!r})" for n in nodes)

    def _with_manifests(self, steps: Sequence[tuple[int, str]], values: Sequence[object]) -> object:
        """The coordinator's options: each chosen checkpoint with its manifest (its own, or the one it asked a holder
        for), left out unless the manifest hashes to its id, binds its step and run, and has the agreed writers."""
        sent: dict[str, bytes] = {}
        for rank, value in enumerate(values):
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise MalformedMessageError(f"rank {rank} sent manifests that are not an object of strings")
            for cid, text in value.items():
                data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is no manifest: its hash fails
                if checkpoint_id(data) != cid:
                    log.warning(
                        "rank %d sent a manifest for %s that hashes to %s: refused", rank, cid[:80], checkpoint_id(data)
                    )
                    continue
                sent.setdefault(cid, data)
        options = []
        for step, cid in steps:
            data = self._manifests.get(cid, sent.get(cid))
            problem = (
                "no manifest that hashes to its id came"
                if data is None
                else self._manifest_problem(data, step, self._writers.get(cid, ()))
            )
            if problem is not None:
                log.warning("memory step %d (%s) is passed over: %s", step, cid, problem)
                continue
            assert data is not None
            options.append([step, cid, data.decode("utf-8")])
        return options

    def _manifest_problem(self, data: bytes, step: int, writers: Ranges) -> str | None:
        """Why a chosen checkpoint's manifest does not bear out what the nodes' leaders claimed of it, or None."""
        try:
            binding = SlotBinding.from_metadata(parse_manifest(data).metadata)
        except CheckpointError as exc:
            return f"its manifest is not a memory snapshot's: {exc}"
        foreign = binding.foreign_to(run_id=self.run_id, node=None)
        if foreign is None and normalize_run_url(binding.run_dir) != normalize_run_url(self.run_dir):
            foreign = f"written for run directory {binding.run_dir!r}"
        if foreign is not None:
            return foreign
        if binding.step != step:
            return f"the nodes' leaders claim step {step}, its manifest's binding says step {binding.step}"
        if to_ranges(rank_groups(data)) != writers:
            return "its manifest's writer ranks are not those the nodes' leaders counted"
        return None

    # ---------------------------------------------------------------- gathering the files

    def fetch(self, option: MemoryOption, needed: set[str]) -> Fetched:
        """Gather on this node the files of ``option`` that its ranks need (a collective call). A transfer that fails
        on any rank fails the call on every rank, with that rank's error (so all pass over ``option`` together)."""
        started = time.perf_counter()
        groups: dict[int, dict[str, int]] = {}
        fetch_dir = ""
        mine: object
        try:
            _option_manifest(option)
            groups = rank_groups(option.manifest_bytes)
            fetch_dir = self._fetch_dir(option.checkpoint_id)
            writer_of = {p: w for w, files in groups.items() for p in files}
            mine = [list(r) for r in to_ranges(writer_of[p] for p in needed if p in writer_of)]
        except CheckpointError as exc:
            mine = exc
        needs = self._messages.parse_needs(
            decide(
                self.collective,
                mine,
                self._messages.node_needs,
                what=f"the needs of the restore of step {option.step}",
                max_size=MAX_NEEDS_BYTES,
            )
        )
        fetches = self._plan(option.checkpoint_id, needs)
        error: CheckpointError | None = None
        for index, fetch in enumerate(fetches):
            if self.rank not in (fetch.src, fetch.dst):
                continue
            try:
                self._move(index, fetch, option, groups.get(fetch.writer, {}), fetch_dir)
            except CheckpointError as exc:
                error = error or exc
                log.warning(
                    "restore of step %d: writer rank %d's files could not be moved: %s", option.step, fetch.writer, exc
                )
        self.agree(error)  # every transfer of every node done, or the same error everywhere
        labels: dict[str, str] = {}
        arrived: set[str] = set()
        for fetch in fetches:
            if self.nodes.nodes[fetch.dst] == self.node:
                for path in groups.get(fetch.writer, {}):
                    labels[path] = f"peer:rank {fetch.src}"
                    arrived.add(path)
        sizes = {p: size for files in groups.values() for p, size in files.items()}
        layers: list[tuple[str, Store]] = []
        for holding in self._holdings_of(option.checkpoint_id):
            problem = self.own_dir_problem(holding.path)
            if problem is not None:
                log.warning("restore of step %d: %r not read: %s", option.step, holding.path[:200], problem)
                continue
            # a file here at another size than the manifest's, or one fetched whole with its writer rank's, is read
            # from where it counts as held
            files = [p for p, size in holding.files.items() if sizes.get(p) == size and p not in arrived]
            layers.append(("memory" if holding.kind == "slot" else "peer-copy", HeldStore(holding.path, files)))
        # only what arrived at this restore: anything else in the directory is no file of this fetch
        layers.append(("fetched", HeldStore(fetch_dir, arrived if private_dir_problem(fetch_dir) is None else ())))
        return Fetched(
            store=OverlayStore(layers),
            fetches=tuple(fetches),
            bytes_moved=sum(sum(groups.get(f.writer, {}).values()) for f in fetches),
            seconds=time.perf_counter() - started,
            labels=labels,
        )

    def _holdings_of(self, ckpt_id: str) -> list[Holding]:
        """This node's holdings of ``ckpt_id``: its slot first, then the copies it keeps."""
        return sorted((h for h in self._mine if h.checkpoint_id == ckpt_id), key=lambda h: (h.kind != "slot", h.path))

    def _plan(self, ckpt_id: str, needs: Mapping[str, Ranges]) -> list[Fetch]:
        """Every node's fetches, alike on every rank: for each node, the writer ranks its ranks need that it does not
        hold whole, each from a node that does (:func:`~.summary.plan_fetches`), sent by that node's ranks in turn and
        received by the needing node's ranks in turn."""
        held = self._held.get(ckpt_id, {})
        # the broadcast map, as summary.holders_of reads it (only the held ranges count)
        holders = holders_of(
            {n: [Completeness(checkpoint_id=ckpt_id, step=0, writers=(), held=r)] for n, r in held.items()}, ckpt_id
        )
        fetches: list[Fetch] = []
        turn = 0
        for node, receivers in self._ranks.items():
            lacking = minus(needs.get(node, ()), [held.get(node, ())])  # only these are ever expanded to ranks
            plan = plan_fetches(node, (r for a, b in lacking for r in range(a, b)), holders)
            for writer, source in sorted(plan.items()):
                senders = self._ranks[source]
                fetches.append(
                    Fetch(writer=writer, src=senders[turn % len(senders)], dst=receivers[turn % len(receivers)])
                )
                turn += 1
        return fetches

    def _fetch_dir(self, ckpt_id: str) -> str:
        """Where this node receives files of ``ckpt_id``: a name made of the id's hex digits (checked first), directly
        under this node's memory directory; refused when something not this user's directory is there."""
        digits = check_checkpoint_id(ckpt_id, "the option").partition(":")[2]
        path = os.path.join(self.tier.root, f"{FETCH_PREFIX}{digits[:FETCH_ID_CHARS]}")
        problem = self.own_dir_problem(path)
        if problem not in (None, "absent"):
            raise UnsafePathError(f"the directory to fetch into {problem}", path=path)
        return path

    def own_dir_problem(self, path: str) -> str | None:
        """Why ``path`` is not a directory this rank may read or write for a restore, or None (``"absent"`` when it is
        one that does not exist): it must be a slot, peer copy or fetch directory directly under this node's memory
        directory of the run (``tier.root``), and no symlink nor another user's."""
        name = os.path.basename(path)
        if _HOLDING_DIR.fullmatch(name) is None:
            return f"is not named as a slot, peer copy or fetch directory ({name[:80]!r})"
        if os.path.realpath(os.path.dirname(path)) != os.path.realpath(self.tier.root):
            return f"is not in this node's memory directory {str(self.tier.root)!r}"
        return private_dir_problem(path)

    def _source_dir(self, ckpt_id: str, files: Mapping[str, int]) -> tuple[str, str | None]:
        """The directory of this node's memory that holds every one of ``files`` at its size, or why there is none."""
        problem = "no holding of this node has them all at the manifest's sizes"
        for holding in self._holdings_of(ckpt_id):
            if all(holding.files.get(p) == size for p, size in files.items()):
                problem = self.own_dir_problem(holding.path) or ""
                if not problem:
                    return holding.path, None
        return "", problem

    def _move(self, index: int, fetch: Fetch, option: MemoryOption, files: Mapping[str, int], fetch_dir: str) -> None:
        if self.channel is None:
            raise CollectiveError("no channel to move files between nodes")
        tag = ROUND_TAGS + index
        paths = sorted(files)
        if not paths:
            raise MalformedMessageError(f"writer rank {fetch.writer} wrote no file of step {option.step}")
        if fetch.src == self.rank:
            source, problem = self._source_dir(option.checkpoint_id, files)
            refusal = (
                UnsafePathError(f"writer rank {fetch.writer}'s files not sent: {problem}", path=paths[0])
                if problem is not None
                else None
            )
            # a refused source is still answered (an abort before its first byte): the receiver is not left waiting
            send_files(
                self.channel,
                dst=fetch.dst,
                tag=tag,
                source=SlotStore(source or self.tier.root),
                manifest_bytes=option.manifest_bytes,
                paths=paths,
                still_valid=lambda: refusal,
            )
            return
        if private_dir_problem(fetch_dir) == "absent":
            os.makedirs(fetch_dir, mode=0o700, exist_ok=True)
        problem = self.own_dir_problem(fetch_dir)
        if problem is not None:  # made here, or checked by _fetch_dir: only a race with this user gets here
            raise UnsafePathError(f"the directory to fetch into {problem}", path=fetch_dir)
        received = receive_files(
            self.channel,
            src=fetch.src,
            tag=tag,
            destination=SlotStore(fetch_dir),
            max_paths=len(paths),
            expect_id=option.checkpoint_id,
        )
        if sorted(f.path for f in received.files) != paths:
            raise CollectiveError(f"rank {fetch.src} sent other files than writer rank {fetch.writer}'s", path=paths[0])

    def clean_up(self) -> None:
        """Delete the files fetched from other nodes (this node's leader, once every rank has read them: after the
        vote that follows the read). They have no manifest, so no restore would take them as a holding."""
        if self.nodes.leader(self.node) != self.rank:
            return
        try:
            names = [n for n in os.listdir(self.tier.root) if n.startswith(FETCH_PREFIX)]
        except OSError:
            return
        for name in names:
            path = os.path.join(self.tier.root, name)
            if private_dir_problem(path) is None:  # never through a link planted there
                shutil.rmtree(path, ignore_errors=True)

    def agree(self, error: CheckpointError | None) -> None:
        """Raise on every rank one error naming every rank that failed, if any did (a collective call)."""
        decide(self.collective, error, lambda _: None, what="the restore's transfers")


def _option_manifest(option: MemoryOption) -> Manifest:
    """The manifest of ``option``, which must hash to its checkpoint id."""
    check_checkpoint_id(option.checkpoint_id, "the option")
    found = checkpoint_id(option.manifest_bytes)
    if found != option.checkpoint_id:
        raise DigestMismatchError(f"the option's manifest hashes to {found}, not to {option.checkpoint_id}")
    return parse_manifest(option.manifest_bytes)
