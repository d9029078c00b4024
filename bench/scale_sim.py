"""A restore and replica placement planned for 1,000 and 10,000 nodes x 8 ranks, by simulation: the project's real
planning code on synthetic holdings and failure traces, without processes.

    python bench/scale_sim.py [--nodes 1000 10000] [--ranks 8] [--replicas 1 2] [--files 2] [--rack 32] [--json [FILE]]

Nodes ``node-NNNNN`` in four regions of racks of ``--rack`` nodes (``CKPTFMT_FAILURE_DOMAIN=region-R/rack-K``; a
region's last rack may be short); each rank writes ``--files`` files a snapshot (data files and a context blob,
1 GiB in all), and the memory holds the two newest snapshots, each with ``k`` replicas placed by
:func:`ckptfmt.tier.placement.place_ranks`. Measured, per size and k:

- **placement**: seconds to place every rank's copies (every rank computes it, at start);
- **plan**, after one node is lost and comes back empty: a node's summary of its holdings
  (:func:`ckptfmt.tier.summary.summarize`, from :class:`~ckptfmt.tier.holdings.Holding` records as its leader lists
  them), rank 0's choice (:func:`~ckptfmt.tier.summary.choose`), the map of who holds what
  (:func:`~ckptfmt.tier.summary.holders_of`) and a node's own fetch plan (:func:`~ckptfmt.tier.summary.plan_fetches`).
  The nodes summarize and plan side by side, so those two count the slowest node (the five slowest of one run
  each, run five times again: the most of their least); rank 0's two, the least of three runs
  (the simulation's own objects frozen out of the collector, :func:`least`);
- **rank-0 inbound**: the bytes of every node's summaries (JSON, as the gather carries them) and the largest one,
  against every node's file lists (:meth:`Holding.to_dict`), what today's restore gathers;
- **bytes per link** of the restore after one node, one rack and one region is lost (their nodes back empty): the
  most into one node and out of one node; the steps lost: 0 when every rank's files survive somewhere, else the
  mean of the steps since the last durable save (every 100 steps);
- **steps lost** over a trace of 200 failure events at random steps (the same trace for every row, copies whole
  again between events): random (two nodes at once, anywhere) and correlated (a rack, one in ten a region, and one
  more node anywhere at the same time); for the placement by failure domain, and for the same k placed by node
  order (no labels: the next nodes by key, the placement before MEM-19).

Timings are of this machine, one core; the byte counts and steps are exact for the model.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptfmt.tier.holdings import Holding
from ckptfmt.tier.placement import place_ranks
from ckptfmt.tier.summary import Completeness, choose, holders_of, plan_fetches, summarize, to_ranges

RACK = 32
REGIONS = 4
RANK_BYTES = 1 << 30
CONTEXT_BYTES = 4096
DURABLE_EVERY = 100
EVENTS = 200
IDS = [f"sha256:{i:064x}" for i in (1, 2)]  # the two newest snapshots (steps 99, 100)
STEPS = (99, 100)


def rank_files(rank: int, files: int = 2) -> dict[str, int]:
    """A rank's files of one snapshot, ``RANK_BYTES`` in all: ``files - 1`` data files and a context blob."""
    data = files - 1
    out = {
        f"weights/r{rank:05d}-{seq:05d}.safetensors": (RANK_BYTES - CONTEXT_BYTES) // data
        + (seq < (RANK_BYTES - CONTEXT_BYTES) % data)
        for seq in range(data)
    }
    out[f"context.r{rank:05d}.msgpack"] = CONTEXT_BYTES
    return out


class Job:
    """``n`` nodes of ``ranks`` ranks, their failure domains and the placement of ``k`` replicas (by domain, or by
    node order when ``labelled`` is false)."""

    def __init__(self, n: int, ranks: int, k: int, *, files: int = 2, rack: int = RACK, labelled: bool = True) -> None:
        if n < 2 or ranks < 1 or files < 2 or rack < 1:
            raise ValueError("a job needs 2 nodes or more, a rank a node, 2 files a rank and a rack of 1 or more")
        self.n, self.ranks, self.k, self.files = n, ranks, k, files
        self.names = [f"node-{i:05d}" for i in range(n)]
        region = [i * REGIONS // n for i in range(n)]
        first = {r: region.index(r) for r in set(region)}
        self.domains = {
            name: f"region-{region[i]}/rack-{(i - first[region[i]]) // rack:04d}" for i, name in enumerate(self.names)
        }
        self.node_of_rank = [name for name in self.names for _ in range(ranks)]
        self.ranks_of = {name: list(range(i * ranks, (i + 1) * ranks)) for i, name in enumerate(self.names)}
        started = time.perf_counter()
        self.placed = place_ranks(self.node_of_rank, self.domains if labelled else {}, k)
        self.placement_s = time.perf_counter() - started
        self.held_ranks: dict[str, list[int]] = {name: [] for name in self.names}  # own and copies, by node
        self.holders: list[list[str]] = [[] for _ in range(n * ranks)]  # by rank: the nodes holding its files
        for rank, node in enumerate(self.node_of_rank):
            for holder in (node, *(self.node_of_rank[dst] for dst in self.placed[rank])):
                self.held_ranks[holder].append(rank)
                self.holders[rank].append(holder)
        self._groups: list[dict[str, int]] | None = None

    @property
    def groups(self) -> list[dict[str, int]]:
        """Each rank's files (path -> size), the same in both snapshots."""
        if self._groups is None:
            self._groups = [rank_files(r, self.files) for r in range(self.n * self.ranks)]
        return self._groups

    def domain_nodes(self, label: str) -> set[str]:
        """The nodes whose label is ``label`` or under it (``region-1``: every rack of region 1)."""
        return {x for x, d in self.domains.items() if d == label or d.startswith(label + "/")}

    def holdings(self, node: str) -> list[Holding]:
        """What a node's leader lists: per snapshot, its slot (its own ranks) and one peer copy per source rank."""
        out = []
        own = self.ranks_of[node]
        for step, cid in zip(STEPS, IDS, strict=True):
            files = {p: s for r in own for p, s in self.groups[r].items()}
            out.append(
                Holding(node=node, path=f"/shm/{node}/slot", kind="slot", checkpoint_id=cid, step=step, files=files)
            )
            for r in self.held_ranks[node]:
                if self.node_of_rank[r] != node:
                    path = f"/shm/{node}/peer-{r:05d}"
                    out.append(
                        Holding(node=node, path=path, kind="peer", checkpoint_id=cid, step=step, files=self.groups[r])
                    )
        return out

    def survives(self, lost: set[str]) -> bool:
        """Whether every rank's files are still held by a node not lost (only the lost nodes' ranks can be gone)."""
        return all(any(h not in lost for h in self.holders[r]) for node in lost for r in self.held_ranks[node])


@dataclass
class Restore:
    """One planned restore: its plan's times, what rank 0 takes in, and the bytes of the fetches it plans."""

    restorable: bool
    summary_s: float  # the slowest node's summaries
    choose_s: float
    map_s: float
    fetch_s: float  # the slowest node's own fetch plan
    inbound: int  # every node's summaries, as JSON
    largest: int  # the largest node's
    moved: int = 0  # bytes of every fetch planned
    lost_bytes: int = 0  # bytes of the lost nodes' ranks
    max_link: int = 0
    max_into_node: int = 0
    max_out_of_node: int = 0
    links: int = 0
    into: dict[str, int] = field(default_factory=dict, repr=False)
    out_of: dict[str, int] = field(default_factory=dict, repr=False)
    where: dict[int, list[str]] = field(default_factory=dict, repr=False)

    @property
    def plan_s(self) -> float:
        return self.summary_s + self.choose_s + self.map_s + self.fetch_s

    def brief(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k not in ("into", "out_of", "where")}


def least(run: Callable[[], object], times: int = 3) -> float:
    """The least seconds of ``times`` runs (one timing on a shared machine catches its noise), the objects alive
    before frozen out of the collector: a run pays for its own garbage, not for the collector walking the whole
    simulated job, which no rank holds (that walk made the map of 10,000 nodes 2-3x slower)."""
    gc.freeze()  # no collect first: on a large heap (pytest's) it costs more than the runs
    out = []
    try:
        for _ in range(times):
            started = time.perf_counter()
            run()
            out.append(time.perf_counter() - started)
    finally:
        gc.unfreeze()
    return min(out)


def slowest(took: dict[str, float], prepare: Callable[[str], Callable[[], object]], few: int = 5) -> float:
    """The slowest node's seconds, as the nodes run side by side: the ``few`` slowest of one timing each (``took``)
    timed ``few`` times again, the most of their least (one timing of a node on a shared machine catches its noise)."""
    worst = sorted(took, key=took.__getitem__)[-few:]
    return max((least(prepare(node), few) for node in worst), default=0.0)  # inputs made outside the timing


def restore(job: Job, lost: set[str]) -> Restore:
    """The planned restore with ``lost`` nodes back empty."""
    groups_of = {cid: dict(enumerate(job.groups)) for cid in IDS}
    # each node's manifest-wide work (parsing it, its writer ranks) is O(ranks), once a node, side by side: done once
    writers_of = {cid: to_ranges(groups_of[cid]) for cid in IDS}
    summaries: dict[str, list[Completeness]] = {}
    inbound, largest, took = 0, 0, {}
    for node in job.names:
        held = [] if node in lost else job.holdings(node)
        started = time.perf_counter()
        mine = summarize(held, groups_of, writers_of)
        took[node] = time.perf_counter() - started
        summaries[node] = mine
        size = len(json.dumps([c.to_dict() for c in mine], separators=(",", ":")))
        inbound += size
        largest = max(largest, size)

    def summarize_on(node: str) -> Callable[[], object]:
        held = [] if node in lost else job.holdings(node)
        return lambda: summarize(held, groups_of, writers_of)

    summary_s = slowest(took, summarize_on)
    chosen = choose(summaries)
    choose_s = least(lambda: choose(summaries))
    if not chosen or chosen[0][1] != IDS[-1]:  # both snapshots lose the same ranks: the newest or none
        return Restore(False, summary_s, choose_s, 0.0, 0.0, inbound, largest)
    where = holders_of(summaries, chosen[0][1])
    map_s = least(lambda: holders_of(summaries, chosen[0][1]))
    links: Counter[tuple[str, str]] = Counter()
    took = {}
    for node in job.names:
        started = time.perf_counter()
        plan = plan_fetches(node, job.ranks_of[node], where)
        took[node] = time.perf_counter() - started
        for rank, src in plan.items():
            links[(src, node)] += sum(job.groups[rank].values())
    fetch_s = slowest(took, lambda x: lambda: plan_fetches(x, job.ranks_of[x], where))
    into: Counter[str] = Counter()
    out_of: Counter[str] = Counter()
    for (src, dst), nbytes in links.items():
        into[dst] += nbytes
        out_of[src] += nbytes
    lost_bytes = sum(sum(job.groups[r].values()) for node in lost for r in job.ranks_of[node])
    return Restore(
        True,
        summary_s,
        choose_s,
        map_s,
        fetch_s,
        inbound,
        largest,
        moved=sum(links.values()),
        lost_bytes=lost_bytes,
        max_link=max(links.values(), default=0),
        max_into_node=max(into.values(), default=0),
        max_out_of_node=max(out_of.values(), default=0),
        links=len(links),
        into=dict(into),
        out_of=dict(out_of),
        where=where,
    )


def sent_by(job: Job, lost: set[str], where: dict[int, list[str]]) -> dict[str, int]:
    """What each holder plans to send, from its own side: for each rank it holds whole whose node is lost, the fetch
    plan of that node as the holder computes it (the same pure function, from the same map)."""
    out: Counter[str] = Counter()
    for holder in job.names:
        for rank in sorted({r for r in job.held_ranks[holder] if holder not in lost}):
            dst = job.node_of_rank[rank]
            if dst in lost and plan_fetches(dst, job.ranks_of[dst], where).get(rank) == holder:
                out[holder] += sum(job.groups[rank].values())
    return dict(out)


def file_lists(job: Job) -> tuple[int, int]:
    """What today's gather carries: every node's holdings with their file lists (bytes in all, the largest)."""
    sizes = [len(json.dumps([h.to_dict() for h in job.holdings(x)], separators=(",", ":"))) for x in job.names]
    return sum(sizes), max(sizes)


def traces(job: Job, seed: int = 42, events: int = EVENTS) -> dict[str, int]:
    """Steps lost over ``events`` failures, random and correlated (the module docstring's trace)."""
    rng = random.Random(seed)
    racks = sorted(set(job.domains.values()))
    regions = sorted({d.split("/")[0] for d in racks})
    out = {"random": 0, "correlated": 0}
    for _ in range(events):
        since_durable = rng.randrange(DURABLE_EVERY)
        if not job.survives(set(rng.sample(job.names, 2))):
            out["random"] += since_durable
        domain = rng.choice(regions) if rng.random() < 0.1 else rng.choice(racks)
        if not job.survives(job.domain_nodes(domain) | {rng.choice(job.names)}):
            out["correlated"] += since_durable
    return out


def simulate(n: int, ranks: int, k: int, *, files: int = 2, rack: int = RACK) -> dict[str, object]:
    """One row of the table: a job of ``n`` nodes x ``ranks`` ranks with ``k`` replicas."""
    job = Job(n, ranks, k, files=files, rack=rack)
    middle = job.names[n // 2]
    losses = {"node": {middle}, "rack": job.domain_nodes(job.domains[middle]), "region": job.domain_nodes("region-1")}
    row: dict[str, object] = {"nodes": n, "ranks": n * ranks, "k": k, "files": files, "placement_s": job.placement_s}
    row["most_copies_on_a_node"] = max(len(held) for held in job.held_ranks.values()) - ranks  # ranks' copies
    for name, lost in losses.items():
        got = restore(job, lost)
        if name == "node":
            row.update(plan_s=got.plan_s, summary_s=got.summary_s, choose_s=got.choose_s, map_s=got.map_s)
            row.update(fetch_s=got.fetch_s, inbound=got.inbound, largest_message=got.largest)
        row[f"{name}_loss"] = got.brief() | {"lost_nodes": len(lost)}
        row[f"{name}_steps_lost"] = 0 if got.restorable else DURABLE_EVERY / 2
    row["file_lists_inbound"], row["file_lists_largest"] = file_lists(job)
    row["trace_steps_lost"] = traces(job)
    row["trace_steps_lost_by_node_order"] = traces(Job(n, ranks, k, files=files, rack=rack, labelled=False))
    return row


def _num(row: dict[str, object], key: str) -> float:
    value = row[key]
    assert isinstance(value, int | float), key
    return float(value)


def _loss(row: dict[str, object], name: str) -> str:
    got = row[f"{name}_loss"]
    assert isinstance(got, dict)
    if not got["restorable"]:
        return f"lost ({row[f'{name}_steps_lost']} steps)"
    return f"{got['max_into_node'] / (1 << 30):.0f} / {got['max_out_of_node'] / (1 << 30):.0f}"


def _steps(row: dict[str, object], key: str) -> str:
    got = row[key]
    assert isinstance(got, dict)
    return f"{got['random']} / {got['correlated']}"


def table(rows: Sequence[dict[str, object]]) -> str:
    """The rows as one markdown table, and where two sizes were run for a k, the larger's ratio to the smaller."""
    out = [
        "| nodes x ranks | k | placement s | plan s (ms: summary + choice + map + fetch plan) | rank-0 inbound MB: "
        "summaries (file lists) | largest message KB: summary (file list) | node loss: GiB into / out of one node "
        "| rack loss | region loss | most copies on one node (ranks) | steps lost, random / correlated: by domain "
        "| by node order |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {int(_num(r, 'nodes')):,} x {int(_num(r, 'ranks') // _num(r, 'nodes'))} | {r['k']} "
            f"| {_num(r, 'placement_s'):.3f} | {_num(r, 'plan_s'):.3f} ({_num(r, 'summary_s') * 1e3:.3f} + "
            f"{_num(r, 'choose_s') * 1e3:.1f} + {_num(r, 'map_s') * 1e3:.1f} + {_num(r, 'fetch_s') * 1e3:.3f}) "
            f"| {_num(r, 'inbound') / 1e6:.2f} ({_num(r, 'file_lists_inbound') / 1e6:.1f}) "
            f"| {_num(r, 'largest_message') / 1e3:.2f} ({_num(r, 'file_lists_largest') / 1e3:.1f}) "
            f"| {_loss(r, 'node')} | {_loss(r, 'rack')} | {_loss(r, 'region')} | {r['most_copies_on_a_node']} "
            f"| {_steps(r, 'trace_steps_lost')} | {_steps(r, 'trace_steps_lost_by_node_order')} |"
        )
    for k in sorted({int(_num(r, "k")) for r in rows}):
        same = sorted((r for r in rows if _num(r, "k") == k), key=lambda r: _num(r, "nodes"))
        if len(same) < 2:
            continue
        a, b = same[0], same[-1]

        def x(key: str, a: dict[str, object] = a, b: dict[str, object] = b) -> str:
            return f"{_num(b, key) / _num(a, key):.1f}x"

        out.append(
            f"| growth, nodes {_num(b, 'nodes') / _num(a, 'nodes'):.0f}x | {k} | {x('placement_s')} | {x('plan_s')} "
            f"({x('summary_s')} + {x('choose_s')} + {x('map_s')} + {x('fetch_s')}) "
            f"| {x('inbound')} ({x('file_lists_inbound')}) | {x('largest_message')} ({x('file_lists_largest')}) "
            "| | | | | | |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--ranks", type=int, default=8, help="ranks a node")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="k: copies of each rank's files")
    p.add_argument("--files", type=int, default=2, help="files a rank writes a snapshot (2 or more)")
    p.add_argument("--rack", type=int, default=RACK, help="nodes a rack")
    p.add_argument("--json", metavar="FILE", nargs="?", const="-", help="the rows as JSON, to FILE or stdout")
    args = p.parse_args(argv)
    rows = []
    for n in args.nodes:
        for k in args.replicas:
            started = time.perf_counter()
            rows.append(simulate(n, args.ranks, k, files=args.files, rack=args.rack))
            print(f"{n} nodes, k={k}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    if args.json == "-":
        print(json.dumps(rows, indent=1))
    else:
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
