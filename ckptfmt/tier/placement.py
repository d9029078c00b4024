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
    tree = Domains(sorted(members))
    picks = {own: tree.picks(at, replicas) for at, own in enumerate(tree.order)}
    out: dict[str, tuple[str, ...]] = {}
    for own, nodes in members.items():
        picked = picks[own]
        for mine, node in enumerate(nodes):
            chosen = [members[d][mine % len(members[d])] for d in picked]
            if len(chosen) < replicas:  # fewer other domains than copies: other nodes, outside the writer's node
                others = [n for d in [*picked, own] for n in members[d] if n != node and n not in chosen]
                chosen += others[: replicas - len(chosen)]
            out[node] = tuple(chosen)
    return dict(sorted(out.items()))


class Domains:
    """The domains' labels as a tree of their levels, and the module docstring's rule on it.

    The rule ranks every other domain by (levels shared with the writer's label, the most shared with one already
    picked, its offset from the writer's place, its place after the writer's in sorted order); :meth:`picks` finds
    the least without ranking them all: a walk down the tree in offset order, skipping each group none of whose
    domains can share less with those picked than the best found: about O(depth x k^2) a pick where ranking them all
    is O(domains), which made the placement grow with the square of the nodes (docs/benchmarks.md, "Restore
    planning at scale")."""

    def __init__(self, order: Sequence[str]) -> None:
        self.order = list(order)
        self.index = {d: i for i, d in enumerate(self.order)}
        self.path = {d: domain_path(d) if not d.startswith("\0") else ("\0", d) for d in self.order}
        self.labelled = any(not d.startswith("\0") for d in self.order)
        below: dict[tuple[str, ...], set[str]] = {}  # a label's prefix -> the next level's names under it
        self.at_path: dict[tuple[str, ...], list[str]] = {}  # more than one where labels differ in empty levels
        for d, p in self.path.items():
            self.at_path.setdefault(p, []).append(d)
            for j in range(len(p)):
                below.setdefault(p[:j], set()).add(p[j])
        self.names = {prefix: sorted(names) for prefix, names in below.items()}
        self.place = {prefix: {name: i for i, name in enumerate(names)} for prefix, names in self.names.items()}

    def picks(self, at: int, replicas: int) -> list[str]:
        """The domains a node of ``order[at]`` sends its copies to, first choice first."""
        order, own = self.order, self.order[at]
        if not self.labelled:  # no node has a label: every other domain ranks alike, the rotation decides
            return [order[(at + i) % len(order)] for i in range(1, min(replicas + 1, len(order)))]
        mine = self.path[own]
        picked: list[str] = []
        taken = {own}
        while len(picked) < replicas and len(taken) < len(order):
            for level in range(len(mine) + 2):  # the fewest levels shared with the writer's label first
                found = self._least(at, mine, level, picked, taken)
                if found is not None:
                    break
            assert found is not None  # every other domain shares some number of levels with the writer's
            picked.append(found)
            taken.add(found)
        return picked

    def _least(self, at: int, mine: tuple[str, ...], level: int, picked: list[str], taken: set[str]) -> str | None:
        """Of the domains sharing exactly ``level`` levels with ``mine`` (not ``taken``), the least by (most shared
        with one picked, offset, rotation); None where there is none."""
        best: list[tuple[int, int, str]] = []  # ((shared with the picked, rotation, domain)), the best so far

        def with_picked(p: tuple[str, ...]) -> int:
            return max((shared(p, self.path[x]) for x in picked), default=0)

        def floor(q: tuple[str, ...]) -> int:
            """The least that a domain under ``q`` (or ``q`` itself) can share with one picked."""
            out = 0
            for x in picked:
                px = self.path[x]
                out = max(out, len(q) if px[: len(q)] == q else shared(q, px))
            return out

        def beaten(q: tuple[str, ...]) -> bool:
            return bool(best) and floor(q) >= best[0][0]

        def here(q: tuple[str, ...]) -> None:
            """The domains whose path is ``q``: one unless labels differ in empty levels (rotation decides)."""
            ranked = [
                (with_picked(q), (self.index[d] - at) % len(self.order), d)
                for d in self.at_path.get(q, ())
                if d not in taken
            ]
            if ranked and (not best or min(ranked)[0] < best[0][0]):
                best[:] = [min(ranked)]

        def walk(q: tuple[str, ...], skip_first: bool) -> None:
            """Every domain under ``q``, in offset order: each level's names from the writer's place on."""
            names = self.names.get(q, [])
            j = len(q)
            start = self.place.get(mine[:j], {}).get(mine[j], 0) if j < len(mine) else 0
            for t in range(1 if skip_first else 0, len(names)):
                if beaten(q):
                    return
                child = (*q, names[(start + t) % len(names)])
                if not beaten(child):
                    here(child)
                    walk(child, False)

        if level < len(mine):  # under mine[:level], outside mine[:level + 1]
            root = mine[:level]
            here(root)
            walk(root, True)
        elif level == len(mine):  # under the writer's own label
            walk(mine, False)
        else:  # the writer's own path under another label
            here(mine)
        return best[0][2] if best else None


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
