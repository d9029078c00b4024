"""A restore and replica placement planned for 1,000 and 10,000 nodes x 8 ranks, by simulation: the project's real
planning code on synthetic holdings and failure traces, without processes.

    python bench/scale_sim.py [--nodes 1000 10000] [--ranks 8] [--json FILE]

Nodes ``node-NNNNN`` in racks of 32 and four regions (``CKPTFMT_FAILURE_DOMAIN=region-R/rack-K``); each rank writes
two files a snapshot (its data file and a context blob, 1 GiB in all), and the memory holds the two newest
snapshots, each with ``k`` replicas placed by :func:`ckptfmt.tier.placement.place_ranks`. Measured, per size and k:

- **placement**: seconds to place every rank's copies (every rank computes it, at start);
- **plan**: a node's summary of its holdings (:func:`ckptfmt.tier.summary.summarize`, from
  :class:`~ckptfmt.tier.holdings.Holding` records as its leader lists them; the slowest node, as the nodes run it
  side by side), rank 0's choice (:func:`~ckptfmt.tier.summary.choose`), the broadcast map
  (:func:`~ckptfmt.tier.summary.holders_of`) and the slowest node's own fetch plan
  (:func:`~ckptfmt.tier.summary.plan_fetches`), after a node is lost and comes back empty;
- **rank 0 inbound**: the bytes of every node's summary (JSON, as the gather carries it) and the largest one,
  against every node's file lists as today's restore gathers them (:meth:`Holding.to_dict`);
- **bytes per link** for the restore after one node, one rack and one region is lost (their nodes back empty),
  the largest into one node and out of one node, and the steps lost: 0 when every rank's files survive somewhere,
  else the steps since the last durable save (every 100 steps: 50 on average);
- **steps lost** over failure traces of 200 events at random steps: random (two nodes at once, anywhere),
  correlated (a rack; one in ten a region).

Timings are of this machine, one core; the byte counts and steps are exact for the model.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptfmt.tier.holdings import Holding
from ckptfmt.tier.placement import place_ranks
from ckptfmt.tier.summary import choose, holders_of, plan_fetches, summarize, to_ranges

RACK = 32
REGIONS = 4
RANK_BYTES = 1 << 30
DURABLE_EVERY = 100
IDS = [f"sha256:{i:064x}" for i in (1, 2)]  # the two newest snapshots (steps 99, 100)


def rank_files(rank: int) -> dict[str, int]:
    return {f"weights/r{rank:05d}-00000.safetensors": RANK_BYTES - 4096, f"context.r{rank:05d}.msgpack": 4096}


class Job:
    """``n`` nodes of ``ranks`` ranks, their domains and the placement of ``k`` replicas."""

    def __init__(self, n: int, ranks: int, k: int) -> None:
        self.n, self.ranks, self.k = n, ranks, k
        self.names = [f"node-{i:05d}" for i in range(n)]
        self.domains = {name: f"region-{i * REGIONS // n}/rack-{i // RACK:04d}" for i, name in enumerate(self.names)}
        self.node_of_rank = [name for name in self.names for _ in range(ranks)]
        self.ranks_of = {name: list(range(i * ranks, (i + 1) * ranks)) for i, name in enumerate(self.names)}
        started = time.perf_counter()
        self.placed = place_ranks(self.node_of_rank, self.domains, k)
        self.placement_s = time.perf_counter() - started
        self.groups = {r: rank_files(r) for r in range(n * ranks)}
        self.held_ranks: dict[str, list[int]] = {name: [] for name in self.names}  # own and replicas, by node
        for rank, node in enumerate(self.node_of_rank):
            self.held_ranks[node].append(rank)
            for dst in self.placed[rank]:
                self.held_ranks[self.node_of_rank[dst]].append(rank)

    def holdings(self, node: str) -> list[Holding]:
        """What a node's leader lists: per snapshot, its slot (its own ranks) and one peer copy per source rank."""
        out = []
        for step, cid in zip((99, 100), IDS, strict=True):
            own = [r for r in self.held_ranks[node] if self.node_of_rank[r] == node]
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
        return all(any(node not in lost for node in self._holders[r]) for node in lost for r in self.held_ranks[node])

    @property
    def _holders(self) -> list[list[str]]:
        if not hasattr(self, "_holders_cache"):
            cache: list[list[str]] = [[] for _ in range(self.n * self.ranks)]
            for node, ranks in self.held_ranks.items():
                for r in ranks:
                    cache[r].append(node)
            self._holders_cache = cache
        return self._holders_cache


def restore(job: Job, lost: set[str]) -> dict[str, object]:
    """The planned restore with ``lost`` nodes back empty: its plan's times, rank 0's inbound bytes and the bytes
    per link of the fetches each node plans."""
    groups_of = {cid: {r: job.groups[r] for r in range(job.n * job.ranks)} for cid in IDS}
    # each node's manifest-wide work (parsing it, its writer ranks) is O(ranks), once a node, side by side: done once
    writers_of = {cid: to_ranges(groups_of[cid]) for cid in IDS}
    summaries, inbound, largest, node_s = {}, 0, 0, 0.0
    for node in job.names:
        started = time.perf_counter()
        mine = [] if node in lost else summarize(job.holdings(node), groups_of, writers_of)
        node_s = max(node_s, time.perf_counter() - started)
        summaries[node] = mine
        size = len(json.dumps([c.to_dict() for c in mine], separators=(",", ":")))
        inbound += size
        largest = max(largest, size)
    started = time.perf_counter()
    chosen = choose(summaries)
    choose_s = time.perf_counter() - started
    if not chosen:
        return {"restorable": False, "rank0_s": choose_s, "node_s": node_s, "inbound": inbound, "largest": largest}
    _, cid = chosen[0]
    started = time.perf_counter()
    where = holders_of(summaries, cid)
    map_s = time.perf_counter() - started
    links: Counter[tuple[str, str]] = Counter()
    fetch_s = 0.0
    for node in job.names:
        needed = job.ranks_of[node]
        started = time.perf_counter()
        plan = plan_fetches(node, needed, where)
        fetch_s = max(fetch_s, time.perf_counter() - started)
        for rank, src in plan.items():
            links[(src, node)] += sum(job.groups[rank].values())
    into: Counter[str] = Counter()
    out_of: Counter[str] = Counter()
    for (src, dst), nbytes in links.items():
        into[dst] += nbytes
        out_of[src] += nbytes
    return {
        "restorable": True,
        "rank0_s": choose_s + map_s,
        "node_s": node_s + fetch_s,
        "inbound": inbound,
        "largest": largest,
        "links": len(links),
        "max_link": max(links.values(), default=0),
        "max_into_node": max(into.values(), default=0),
        "max_out_of_node": max(out_of.values(), default=0),
    }


def file_lists_bytes(job: Job) -> int:
    """What today's gather carries: every node's holdings with their file lists."""
    return sum(len(json.dumps([h.to_dict() for h in job.holdings(node)], separators=(",", ":"))) for node in job.names)


def traces(job: Job, rng: random.Random, events: int = 200) -> dict[str, int]:
    """Steps lost over ``events`` failures, random and correlated."""
    racks = sorted({d for d in job.domains.values()})
    regions = sorted({d.split("/")[0] for d in job.domains.values()})
    out = {"random": 0, "correlated": 0}
    for _ in range(events):
        since_durable = rng.randrange(DURABLE_EVERY)
        pair = set(rng.sample(job.names, 2))
        if not job.survives(pair):
            out["random"] += since_durable
        if rng.random() < 0.1:
            region = rng.choice(regions)
            lost = {n for n in job.names if job.domains[n].split("/")[0] == region}
        else:
            rack = rng.choice(racks)
            lost = {n for n in job.names if job.domains[n] == rack}
        if not job.survives(lost):
            out["correlated"] += since_durable
    return out


def simulate(n: int, ranks: int, k: int) -> dict[str, object]:
    job = Job(n, ranks, k)
    one = {job.names[n // 2]}
    rack = {x for x in job.names if job.domains[x] == job.domains[job.names[n // 2]]}
    region = {x for x in job.names if job.domains[x].startswith("region-1/")}
    row: dict[str, object] = {"nodes": n, "ranks": n * ranks, "k": k, "placement_s": job.placement_s}
    node_loss = restore(job, one)
    row["plan_s"] = float(node_loss["rank0_s"]) + float(node_loss["node_s"])  # type: ignore[arg-type]
    row["rank0_s"] = node_loss["rank0_s"]
    row["inbound"] = node_loss["inbound"]
    row["largest_message"] = node_loss["largest"]
    row["file_lists_inbound"] = file_lists_bytes(job) if n <= 1000 else None
    for name, lost in (("node", one), ("rack", rack), ("region", region)):
        got = restore(job, lost)
        row[f"{name}_loss"] = {
            k2: got[k2] for k2 in ("restorable", "max_link", "max_into_node", "max_out_of_node", "links") if k2 in got
        }
        row[f"{name}_steps_lost"] = 0 if got["restorable"] else DURABLE_EVERY // 2
    row["trace_steps_lost"] = traces(job, random.Random(42))
    return row


def table(rows: Sequence[dict[str, object]]) -> str:
    mb = 1e6
    gib = float(1 << 30)
    out = [
        "| nodes x ranks | k | placement s | plan s (rank 0 s) | rank-0 inbound MB (file lists) | largest msg KB "
        "| node loss: max link GiB / into node GiB | rack loss | region loss | steps lost random / correlated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def loss(name: str, r: dict[str, object] = r) -> str:
            got = r[f"{name}_loss"]
            assert isinstance(got, dict)
            if not got["restorable"]:
                return f"not restorable ({r[f'{name}_steps_lost']} steps)"
            return f"{got['max_link'] / gib:.0f} / {got['max_into_node'] / gib:.0f}"

        lists = r["file_lists_inbound"]
        steps = r["trace_steps_lost"]
        assert isinstance(steps, dict)
        out.append(
            f"| {r['nodes']:,} x {int(r['ranks']) // int(r['nodes'])} | {r['k']} | {r['placement_s']:.3f} "  # type: ignore[call-overload]
            f"| {r['plan_s']:.3f} ({r['rank0_s']:.3f}) "
            f"| {int(r['inbound']) / mb:.2f}"  # type: ignore[call-overload]
            + (f" ({int(lists) / mb:.1f})" if isinstance(lists, int) else "")
            + f" | {int(r['largest_message']) / 1e3:.1f} | {loss('node')} | {loss('rack')} | {loss('region')} "  # type: ignore[call-overload]
            f"| {steps['random']} / {steps['correlated']} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = []
    for n in args.nodes:
        for k in args.replicas:
            rows.append(simulate(n, args.ranks, k))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
