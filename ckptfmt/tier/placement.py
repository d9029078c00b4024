"""Where each rank's replicas go: k copies on nodes of distinct failure domains (spec/memory.md, MEM-19).

Pure: the same inputs give the same placement on every rank and across restarts, since it orders nodes by their
keys and domains by their labels, never by rank numbers (a restarted job may place its ranks on nodes in another
order, MEM-9). A **failure domain** is what one event takes out at once (a rack's power, a region's network);
its label is a ``/``-separated path from the widest to the narrowest (``region-a/rack-3``), and a node without
one is a domain of its own.

The rule, for each writing node, picks its copies' domains one at a time, among the domains other than its own:
first one that shares the least of its label with the writer's (another region before another rack of the same
region), then the least with the domains already picked, then the one at the writer's place in the next group:
where the labels part, the next group after the writer's (in sorted order, as a ring), and below that, each level's
member as far after its first as the writer's is after its own first (``region-1/rack-3`` sends to ``region-2/rack-3``,
modulo region 2's racks). So receivers are spread one to one where the groups are alike (the next group's first
rack alone, as the rule had it before, took the copies of a whole region), and a job without labels sends to the
next node by key, as a ring. Within a chosen domain
the writer's i-th node (by key, within its domain) sends to that domain's i-th node (modulo its size), and a
node's j-th rank to the receiving node's j-th rank (modulo its size). Where fewer other domains exist than copies
asked for, the rest go to other nodes of domains already used (never the writer's node); there are fewer copies
than asked only where there are fewer other nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import UsageError

DOMAIN_ENV = "CKPTFMT_FAILURE_DOMAIN"
MAX_REPLICAS = 8


def domain_path(label: str) -> tuple[str, ...]:
    """A label's levels, widest first (``"region-a/rack-3"`` -> ``("region-a", "rack-3")``)."""
    return tuple(part for part in label.split("/") if part)


def shared(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading levels two domains share (a whole label shared: its length, plus one for the same leaf)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            return n
        n += 1
    return n + 1 if len(a) == len(b) else n


def check_replicas(replicas: int) -> int:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise UsageError(f"replicas must be a number of copies from 1 to {MAX_REPLICAS}, not {replicas!r}")
    return replicas


def place_nodes(domains: Mapping[str, str], replicas: int) -> dict[str, tuple[str, ...]]:
    """Node key -> the nodes that hold its copies, first choice first. ``domains``: each node's failure-domain
    label ("" or absent: the node is a domain of its own)."""
    check_replicas(replicas)
    label = {node: (dom if domain_path(dom) else "\0node:" + node) for node, dom in domains.items()}
    members: dict[str, list[str]] = {}
    for node in sorted(label):
        members.setdefault(label[node], []).append(node)
    order = sorted(members)
    path = {d: domain_path(d) if not d.startswith("\0") else ("\0", d) for d in order}
    labelled = any(not d.startswith("\0") for d in order)
    below: dict[tuple[str, ...], set[str]] = {}  # a label's prefix -> the next level's names under it
    for p in path.values():
        for j in range(len(p)):
            below.setdefault(p[:j], set()).add(p[j])
    place = {prefix: {name: i for i, name in enumerate(sorted(names))} for prefix, names in below.items()}
    # by domain, not by node: O(domains^2)
    picks = {own: _domains_for(at, order, path, place, replicas, labelled) for at, own in enumerate(order)}
    out: dict[str, tuple[str, ...]] = {}
    for node in sorted(label):
        own = label[node]
        mine = members[own].index(node)
        picked = picks[own]
        chosen = [members[d][mine % len(members[d])] for d in picked]
        if len(chosen) < replicas:  # fewer other domains than copies: other nodes, outside the writer's node
            others = [n for d in [*picked, own] for n in members[d] if n != node and n not in chosen]
            chosen += others[: replicas - len(chosen)]
        out[node] = tuple(chosen)
    return out


def _domains_for(
    at: int,
    order: list[str],
    path: Mapping[str, tuple[str, ...]],
    place: Mapping[tuple[str, ...], Mapping[str, int]],
    replicas: int,
    labelled: bool,
) -> list[str]:
    """The domains a node of ``order[at]`` sends its copies to, first choice first (the module docstring's rule).
    ``place``: a label's prefix -> each name of the next level under it -> its place among them, sorted."""
    own = order[at]
    if not labelled:  # no node has a label: every other domain ranks alike, the rotation decides (O(k), not O(n))
        return [order[(at + i) % len(order)] for i in range(1, min(replicas + 1, len(order)))]
    mine = path[own]

    def offset(d: str) -> tuple[int, ...]:
        """How far ``d`` is from the writer's place, level by level from where their labels part."""
        theirs, out = path[d], []
        for j in range(min(shared(theirs, mine), len(theirs)), len(theirs)):
            names = place[theirs[:j]]
            # the writer's place at this level: within its own group (j > where they part) or this one
            at_j = place.get(mine[:j], {}).get(mine[j], 0) if j < len(mine) else 0
            out.append((names[theirs[j]] - at_j) % len(names))
        return tuple(out)

    rest = {order[(at + i) % len(order)]: i for i in range(1, len(order))}  # rotation: the next domain first
    picked: list[str] = []
    while rest and len(picked) < replicas:
        best = min(
            rest,
            key=lambda d: (
                shared(path[d], mine),
                max((shared(path[d], path[p]) for p in picked), default=0),
                offset(d),
                rest[d],
            ),
        )
        del rest[best]
        picked.append(best)
    return picked


def place_ranks(nodes: Sequence[str], domains: Mapping[str, str], replicas: int) -> dict[int, tuple[int, ...]]:
    """Source rank -> the ranks that hold its copies (``nodes``: each rank's node key, by rank). Empty for a
    single node: there is nowhere else to put a copy."""
    ranks: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    if len(ranks) < 2:
        return {}
    targets = place_nodes({n: domains.get(n, "") for n in ranks}, replicas)
    out: dict[int, tuple[int, ...]] = {}
    for node, mine in ranks.items():
        for j, rank in enumerate(mine):
            out[rank] = tuple(ranks[t][j % len(ranks[t])] for t in targets[node])
    return out


def sources(placement: Mapping[int, Sequence[int]], rank: int) -> list[int]:
    """The ranks that send their copies to ``rank``, in rank order."""
    return sorted(src for src, dsts in placement.items() if rank in dsts)
