"""The restore every rank agrees on, from whatever the live nodes' memory holds (spec/memory.md, MEM-11, MEM-12).

Call sequence (every rank, together)::

    agreed = AgreedRestore(tier, collective=..., channel=..., nodes=..., ...)
    for option in agreed.options():            # complete checkpoints in memory, newest first
        fetched = agreed.fetch(option, needed) # the files this node lacks, sent by the nodes that have them
        ...read the checkpoint through fetched.store (every chunk's digest checked), agree, apply...

Each node's leader lists its holdings (:func:`~.holdings.node_holdings`); the coordinator decides from the
lists alone which checkpoints are complete and which rank sends which file to which node, and every rank
follows the same plan. A transfer that fails (a damaged byte, a peer gone) is reported; the caller then makes
every rank pass over the option together.

Every exchange goes through :func:`~ckptfmt.decide.decide`: a leader's list is hostile input (bounded parse,
strict records, the rank named in the error), so a malformed one fails every rank at once instead of leaving
the others waiting out their timeout. What a list claims is checked against the bytes it names: a manifest must
hash to its checkpoint id, a holding's step is its manifest's binding's, a node speaks only for itself (through
its leader), and a rank reads and writes only directories directly under its own node's memory directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..collective import Collective, PeerChannel
from ..decide import COORDINATOR, MAX_DECISION, decide
from ..errors import CheckpointError, CollectiveError, DigestMismatchError, MalformedMessageError, UnsafePathError
from ..manifest import Manifest, checkpoint_id
from ..manifest_parse import parse_manifest
from ..storage.base import FileInfo, Store
from ..storage.overlay import OverlayStore
from ..storage.slot import SlotStore
from .binding import SlotBinding, normalize_run_url
from .holdings import (
    FETCH_PREFIX,
    PEER_PREFIX,
    Holding,
    Transfer,
    check_checkpoint_id,
    complete,
    node_holdings,
    own_files,
    plan_transfers,
)
from .nodes import NodeMap
from .replica import ROUND_TAGS
from .ring import SLOT_PREFIX, MemoryTier, private_dir_problem
from .wire import receive_files, send_files

log = logging.getLogger("ckptfmt")

# A leader's report: its holdings and their manifests (a few), so at most what a decision may carry.
MAX_REPORT = MAX_DECISION
FETCH_ID_CHARS = 16  # of the checkpoint id's hex digits, in the name of its fetch directory
# the directories a holding may be, directly under a node's memory directory of the run
_HOLDING_DIR = re.compile(rf"{SLOT_PREFIX}\d+|{PEER_PREFIX}\d+-\d+|{FETCH_PREFIX}[0-9a-f]{{{FETCH_ID_CHARS}}}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOption:
    """A checkpoint whose every file some live node's memory holds."""

    step: int
    checkpoint_id: str
    manifest_bytes: bytes


@dataclass(slots=True, kw_only=True)
class Fetched:
    """What :meth:`AgreedRestore.fetch` gathered on this rank."""

    store: OverlayStore
    transfers: tuple[Transfer, ...]
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
        self._holdings: list[Holding] = []  # every node's, as the coordinator accepted them; broadcast with the options

    @property
    def held(self) -> list[Holding]:
        """The holdings of the complete checkpoints, on every live node (after :meth:`options`)."""
        return list(self._holdings)

    # ---------------------------------------------------------------- the options

    def options(self) -> list[MemoryOption]:
        """The complete checkpoints in the live nodes' memory, newest step first (a collective call).

        A leader's list that does not parse fails the call on every rank, at once, with a
        :class:`~ckptfmt.errors.CollectiveError` naming the rank (the caller then passes over the memory options);
        a holding that parses but does not check out is left out, with a warning naming the rank."""
        mine: object = {"holdings": [], "manifests": {}}
        if self.nodes.leader(self.node) == self.rank:
            self.clean_up()  # files fetched by an earlier restore that died: nobody reads them now
            try:
                mine = self._report()
            except CheckpointError as exc:
                mine = exc
        decision = decide(self.collective, mine, self._choose, what="the memory options", max_size=MAX_REPORT)
        options, self._holdings = _parse_options(decision)
        return options

    def _report(self) -> object:
        """This node's holdings and their manifests (its leader's part of :meth:`options`)."""
        holdings, manifests = node_holdings(
            self.tier, node=self.node, run_id=self.run_id, run_dir=self.run_dir, slot_count=self.tier.slot_count
        )
        return {
            "holdings": [h.to_dict() for h in holdings],
            "manifests": {k: v.decode("utf-8") for k, v in manifests.items()},
        }

    def _choose(self, reports: Sequence[object]) -> object:
        """The coordinator's decision: every complete checkpoint, from the holdings that check out."""
        parsed = [_parse_report(report, rank) for rank, report in enumerate(reports)]  # all, before any is used
        manifests: dict[str, bytes] = {}
        for rank, (_, sent) in enumerate(parsed):
            for ckpt_id, text in sent.items():
                data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is no manifest: its hash fails
                if checkpoint_id(data) != ckpt_id:
                    log.warning(
                        "rank %d sent a manifest for %s that hashes to %s: refused", rank, ckpt_id, checkpoint_id(data)
                    )
                    continue
                manifests.setdefault(ckpt_id, data)
        bindings: dict[str, SlotBinding | str] = {}
        accepted: list[Holding] = []
        for rank, (holdings, _) in enumerate(parsed):
            for holding in holdings:
                checked = self._checked(holding, rank, manifests, bindings)
                if isinstance(checked, str):
                    log.warning(
                        "rank %d reported a holding of %s at %r that is refused: %s",
                        rank,
                        holding.checkpoint_id,
                        holding.path[:200],
                        checked,
                    )
                else:
                    accepted.append(checked)
        chosen = complete(accepted, manifests)
        ids = {c for _, c in chosen}
        return {
            "options": [[step, cid, manifests[cid].decode("utf-8")] for step, cid in chosen],
            "holdings": [h.to_dict() for h in accepted if h.checkpoint_id in ids],
        }

    def _checked(
        self, holding: Holding, rank: int, manifests: Mapping[str, bytes], bindings: dict[str, SlotBinding | str]
    ) -> Holding | str:
        """``holding`` as the coordinator takes it (a slot's files cut to its node's share), or why it is refused."""
        if self.nodes.nodes[rank] != holding.node or self.nodes.leader(holding.node) != rank:
            return f"rank {rank} is not the leader of node {holding.node[:80]!r}, only that node's leader speaks for it"
        data = manifests.get(holding.checkpoint_id)
        if data is None:
            return "no manifest that hashes to its checkpoint id came with it"
        if holding.checkpoint_id not in bindings:
            try:
                binding = SlotBinding.from_metadata(parse_manifest(data).metadata)
            except CheckpointError as exc:
                bindings[holding.checkpoint_id] = f"its manifest is not a memory snapshot's: {exc}"
            else:
                foreign = binding.foreign_to(run_id=self.run_id, node=None)
                if foreign is None and normalize_run_url(binding.run_dir) != normalize_run_url(self.run_dir):
                    foreign = f"written for run directory {binding.run_dir!r}"
                bindings[holding.checkpoint_id] = foreign if foreign is not None else binding
        known = bindings[holding.checkpoint_id]
        if isinstance(known, str):
            return known
        if holding.step != known.step:
            return f"it claims step {holding.step}, its manifest's binding says step {known.step}"
        if holding.kind == "slot":
            return replace(holding, files=own_files(known, holding.node, holding.files))
        return holding

    # ---------------------------------------------------------------- gathering the files

    def fetch(self, option: MemoryOption, needed: set[str]) -> Fetched:
        """Gather on this node the files of ``option`` that its ranks need (a collective call). A transfer that fails
        on any rank fails the call on every rank, with that rank's error (so all pass over ``option`` together)."""
        started = time.perf_counter()
        manifest: Manifest | None = None
        fetch_dir = ""
        mine: object
        try:
            manifest = _option_manifest(option)
            fetch_dir = self._fetch_dir(option.checkpoint_id)
            mine = sorted(needed)
        except CheckpointError as exc:
            mine = exc
        plan = decide(
            self.collective,
            mine,
            lambda needs: self._plan(manifest, option.checkpoint_id, needs),
            what=f"the plan of the restore of step {option.step}",
        )
        assert manifest is not None  # else this rank's error failed the decision
        transfers = self._checked_plan(plan, manifest, option.checkpoint_id)
        error: CheckpointError | None = None
        for index, transfer in enumerate(transfers):
            if self.rank not in (transfer.src, transfer.dst):
                continue
            try:
                self._move(index, transfer, option, fetch_dir)
            except CheckpointError as exc:
                error = error or exc
                log.warning("restore of step %d: %s could not be moved: %s", option.step, transfer.path, exc)
        self.agree(error)  # every transfer of every node done, or the same error everywhere
        labels: dict[str, str] = {}
        arrived: dict[str, int] = {}
        for transfer in transfers:
            if self.nodes.nodes[transfer.dst] == self.node:
                labels[transfer.path] = f"peer:rank {transfer.src}"
                arrived[transfer.path] = transfer.size
        layers: list[tuple[str, Store]] = []
        mine_held = sorted(
            (h for h in self._holdings if h.node == self.node and h.checkpoint_id == option.checkpoint_id),
            key=lambda h: (h.kind != "slot", h.path),
        )
        for holding in mine_held:
            problem = self.own_dir_problem(holding.path)
            if problem is not None:
                log.warning("restore of step %d: %r not read: %s", option.step, holding.path[:200], problem)
                continue
            layers.append(("memory" if holding.kind == "slot" else "peer-copy", HeldStore(holding.path, holding.files)))
        # only what arrived at this restore: anything else in the directory is no file of this fetch
        layers.append(("fetched", HeldStore(fetch_dir, arrived if private_dir_problem(fetch_dir) is None else ())))
        return Fetched(
            store=OverlayStore(layers),
            transfers=tuple(transfers),
            bytes_moved=sum(t.size for t in transfers),
            seconds=time.perf_counter() - started,
            labels=labels,
        )

    def _plan(self, manifest: Manifest | None, ckpt_id: str, needs: Sequence[object]) -> object:
        """The coordinator's plan: which rank sends which file to which node."""
        assert manifest is not None  # the coordinator's own option parsed, or its error failed the decision
        wanted: list[list[str]] = []
        for rank, need in enumerate(needs):
            if not isinstance(need, list) or not all(isinstance(p, str) for p in need):
                raise MalformedMessageError(
                    f"rank {rank} sent the files it needs as {type(need).__name__}, not a list of paths"
                )
            wanted.append(need)
        if len(wanted) != len(self.nodes.nodes):
            raise MalformedMessageError(f"{len(wanted)} ranks answered, the node map has {len(self.nodes.nodes)}")
        return [t.to_dict() for t in plan_transfers(manifest, ckpt_id, self._holdings, self.nodes, wanted)]

    def _checked_plan(self, plan: object, manifest: Manifest, ckpt_id: str) -> list[Transfer]:
        """The coordinator's plan, refused alike on every rank unless each transfer is of a file of the checkpoint,
        between ranks of the job, from a directory that holds it on the sender's node."""
        if not isinstance(plan, list):
            raise MalformedMessageError(f"rank {COORDINATOR} sent a plan that is {type(plan).__name__}, not a list")
        sizes = {f.path: f.size for f in manifest.files}
        world = len(self.nodes.nodes)
        transfers = [Transfer.from_dict(t, rank=COORDINATOR) for t in plan]
        for t in transfers:
            if sizes.get(t.path) != t.size or t.src >= world or t.dst >= world:
                raise MalformedMessageError(
                    f"rank {COORDINATOR} planned a transfer of a file not in the checkpoint, or of unknown ranks: {t}"
                )
            holders = {
                h.path
                for h in self._holdings
                if h.checkpoint_id == ckpt_id and h.node == self.nodes.nodes[t.src] and t.path in h.files
            }
            if t.source_dir not in holders:
                raise MalformedMessageError(
                    f"rank {COORDINATOR} planned a transfer from a directory that holds no such file: {t}"
                )
        return transfers

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

    def _move(self, index: int, transfer: Transfer, option: MemoryOption, fetch_dir: str) -> None:
        if self.channel is None:
            raise CollectiveError("no channel to move files between nodes")
        tag = ROUND_TAGS + index
        if transfer.src == self.rank:
            problem = self.own_dir_problem(transfer.source_dir)
            refusal = (
                UnsafePathError(f"not sent from {transfer.source_dir[:200]!r}: it {problem}", path=transfer.path)
                if problem is not None
                else None
            )
            # a refused source is still answered (an abort before its first byte): the receiver is not left waiting
            send_files(
                self.channel,
                dst=transfer.dst,
                tag=tag,
                source=SlotStore(transfer.source_dir),
                manifest_bytes=option.manifest_bytes,
                paths=[transfer.path],
                still_valid=lambda: refusal,
            )
        else:
            if private_dir_problem(fetch_dir) == "absent":
                os.makedirs(fetch_dir, mode=0o700, exist_ok=True)
            problem = self.own_dir_problem(fetch_dir)
            if problem is not None:  # made here, or checked by _fetch_dir: only a race with this user gets here
                raise UnsafePathError(f"the directory to fetch into {problem}", path=fetch_dir)
            receive_files(
                self.channel,
                src=transfer.src,
                tag=tag,
                destination=SlotStore(fetch_dir),
                max_paths=1,
                expect_id=option.checkpoint_id,
            )

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


def _parse_report(report: object, rank: int) -> tuple[list[Holding], dict[str, str]]:
    """A leader's holdings and manifests (by checkpoint id), each member of its type; MalformedMessageError naming
    ``rank`` otherwise."""
    if not isinstance(report, dict) or set(report) != {"holdings", "manifests"}:
        raise MalformedMessageError(f"rank {rank} sent holdings that are not an object of holdings and manifests")
    holdings, manifests = report["holdings"], report["manifests"]
    if not isinstance(holdings, list):
        raise MalformedMessageError(f"rank {rank} sent holdings that are {type(holdings).__name__}, not a list")
    if not isinstance(manifests, dict) or not all(isinstance(v, str) for v in manifests.values()):
        raise MalformedMessageError(f"rank {rank} sent manifests that are not an object of strings")
    who = f"rank {rank}"
    return [Holding.from_dict(h, rank=rank) for h in holdings], {
        check_checkpoint_id(k, who): v for k, v in manifests.items()
    }


def _parse_options(decision: object) -> tuple[list[MemoryOption], list[Holding]]:
    """The coordinator's decision, parsed alike on every rank: each option's manifest must hash to its id."""
    who = f"rank {COORDINATOR}"
    if not isinstance(decision, dict) or set(decision) != {"options", "holdings"}:
        raise MalformedMessageError(f"{who} sent memory options that are not an object of options and holdings")
    raw_options, raw_holdings = decision["options"], decision["holdings"]
    if not isinstance(raw_options, list) or not isinstance(raw_holdings, list):
        raise MalformedMessageError(f"{who} sent memory options or holdings that are not lists")
    options: list[MemoryOption] = []
    for raw in raw_options:
        if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[2], str)):
            raise MalformedMessageError(f"{who} sent a memory option that is not [step, checkpoint id, manifest]")
        step = raw[0]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise MalformedMessageError(f"{who} sent a memory option whose step is {str(step)[:40]!r}")
        ckpt_id = check_checkpoint_id(raw[1], who)
        data = raw[2].encode("utf-8", "surrogatepass")
        if checkpoint_id(data) != ckpt_id:
            raise MalformedMessageError(f"{who} sent a memory option whose manifest does not hash to {ckpt_id}")
        options.append(MemoryOption(step=step, checkpoint_id=ckpt_id, manifest_bytes=data))
    return options, [Holding.from_dict(h, rank=COORDINATOR) for h in raw_holdings]
