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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from ..collective import Collective, PeerChannel, decode_status, encode_status
from ..errors import CheckpointError, CollectiveError
from ..manifest_parse import parse_manifest
from ..storage.base import Store
from ..storage.overlay import OverlayStore
from ..storage.slot import SlotStore
from .holdings import FETCH_PREFIX, Holding, Transfer, complete, node_holdings, plan_transfers
from .nodes import NodeMap
from .replica import ROUND_TAGS
from .ring import MemoryTier, private_dir_problem
from .wire import receive_files, send_files

log = logging.getLogger("ckptfmt")


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
        self._holdings: list[Holding] = []  # every node's, as the coordinator saw them; broadcast with each option

    @property
    def held(self) -> list[Holding]:
        """The holdings of the complete checkpoints, on every live node (after :meth:`options`)."""
        return list(self._holdings)

    def _broadcast(self, data: bytes | None) -> bytes:
        if self.collective is None:
            assert data is not None
            return data
        return self.collective.broadcast(data, src=0)

    def _gather(self, data: bytes) -> list[bytes] | None:
        if self.collective is None:
            return [data]
        return self.collective.gather(data, dst=0)

    def options(self) -> list[MemoryOption]:
        """The complete checkpoints in the live nodes' memory, newest step first (a collective call)."""
        mine: dict[str, object] = {"holdings": [], "manifests": {}}
        if self.nodes.leader(self.node) == self.rank:
            self.clean_up()  # files fetched by an earlier restore that died: nobody reads them now
            holdings, manifests = node_holdings(
                self.tier, node=self.node, run_id=self.run_id, run_dir=self.run_dir, slot_count=self.tier.slot_count
            )
            mine = {
                "holdings": [h.to_dict() for h in holdings],
                "manifests": {k: v.decode("utf-8") for k, v in manifests.items()},
            }
        gathered = self._gather(json.dumps(mine).encode("utf-8"))
        decision: bytes | None = None
        if gathered is not None:
            holdings_all: list[Holding] = []
            manifests_all: dict[str, bytes] = {}
            for data in gathered:
                doc = json.loads(data)
                holdings_all += [Holding.from_dict(h) for h in doc["holdings"]]
                manifests_all.update({k: v.encode("utf-8") for k, v in doc["manifests"].items()})
            chosen = complete(holdings_all, manifests_all)
            decision = json.dumps(
                {
                    "options": [[step, cid, manifests_all[cid].decode("utf-8")] for step, cid in chosen],
                    "holdings": [h.to_dict() for h in holdings_all if any(h.checkpoint_id == c for _, c in chosen)],
                }
            ).encode("utf-8")
        doc = json.loads(self._broadcast(decision))
        self._holdings = [Holding.from_dict(h) for h in doc["holdings"]]
        return [
            MemoryOption(step=int(s), checkpoint_id=str(c), manifest_bytes=str(m).encode("utf-8"))
            for s, c, m in doc["options"]
        ]

    def fetch(self, option: MemoryOption, needed: set[str]) -> Fetched:
        """Gather on this node the files of ``option`` that its ranks need (a collective call). A transfer that fails
        on any rank fails the call on every rank, with that rank's error (so all pass over ``option`` together)."""
        started = time.perf_counter()
        manifest = parse_manifest(option.manifest_bytes)
        gathered = self._gather(json.dumps(sorted(needed)).encode("utf-8"))
        plan: bytes | None = None
        if gathered is not None:
            needs = [json.loads(g) for g in gathered]
            transfers = plan_transfers(manifest, option.checkpoint_id, self._holdings, self.nodes, needs)
            plan = json.dumps([t.to_dict() for t in transfers]).encode("utf-8")
        transfers = [Transfer.from_dict(t) for t in json.loads(self._broadcast(plan))]
        fetch_dir = os.path.join(self.tier.root, f"{FETCH_PREFIX}{option.checkpoint_id.partition(':')[2][:16]}")
        error: CheckpointError | None = None
        labels: dict[str, str] = {}
        for index, transfer in enumerate(transfers):
            if self.rank not in (transfer.src, transfer.dst):
                continue
            try:
                self._move(index, transfer, option.manifest_bytes, fetch_dir)
            except CheckpointError as exc:
                error = error or exc
                log.warning("restore of step %d: %s could not be moved: %s", option.step, transfer.path, exc)
        self.agree(error)  # every transfer of every node done, or the same error everywhere
        for transfer in transfers:
            if self.nodes.nodes[transfer.dst] == self.node:
                labels[transfer.path] = f"peer:rank {transfer.src}"
        layers: list[tuple[str, Store]] = []
        mine = sorted(
            (h for h in self._holdings if h.node == self.node and h.checkpoint_id == option.checkpoint_id),
            key=lambda h: (h.kind != "slot", h.path),
        )
        for holding in mine:
            layers.append(("memory" if holding.kind == "slot" else "peer-copy", SlotStore(holding.path)))
        if private_dir_problem(fetch_dir) is None:
            layers.append(("fetched", SlotStore(fetch_dir)))
        if not layers:
            layers.append(("fetched", SlotStore(fetch_dir)))
        return Fetched(
            store=OverlayStore(layers),
            transfers=tuple(transfers),
            bytes_moved=sum(t.size for t in transfers),
            seconds=time.perf_counter() - started,
            labels=labels,
        )

    def _move(self, index: int, transfer: Transfer, manifest_bytes: bytes, fetch_dir: str) -> None:
        if self.channel is None:
            raise CollectiveError("no channel to move files between nodes")
        tag = ROUND_TAGS + index
        if transfer.src == self.rank:
            send_files(
                self.channel,
                dst=transfer.dst,
                tag=tag,
                source=SlotStore(transfer.source_dir),
                manifest_bytes=manifest_bytes,
                paths=[transfer.path],
            )
        else:
            if private_dir_problem(fetch_dir) == "absent":
                os.makedirs(fetch_dir, mode=0o700, exist_ok=True)
            receive_files(self.channel, src=transfer.src, tag=tag, destination=SlotStore(fetch_dir))

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
        """Raise on every rank the first rank's failure, if any rank failed (a collective call)."""
        gathered = self._gather(encode_status(error))
        verdict: bytes | None = None
        if gathered is not None:
            verdict = encode_status(None)
            for data in gathered:
                try:
                    decode_status(data)
                except CheckpointError as exc:
                    verdict = encode_status(exc)
                    break
        decode_status(self._broadcast(verdict))
