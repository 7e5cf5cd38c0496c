"""A placement of the routed experts from their measured loads (`afd rebalance`): replicate the hottest
experts into the spare slots, then pack the replicas onto the FFN nodes so that their loads come out even.

The two greedy steps follow DeepSeek's expert-parallel load balancer (github.com/deepseek-ai/EPLB, eplb.py:
`replicate_experts`, then `balanced_packing`), without its node/GPU hierarchy: here one FFN node is one
pack. A replicated expert's load counts split evenly over its holders, as the data plane splits its tokens
by token index across the live holders (afd/dataplane/dispatch.py).

Pure Python, no torch: it runs where the cluster YAML is edited.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from afd.config.placement import Placement


def replica_counts(loads: Sequence[float], total_slots: int, num_nodes: int, floor: int = 1) -> list[int]:
    """Replicas per expert: `floor` each (at most one per node), then each spare slot to the expert with the
    highest load per replica (ties: the lowest id), no expert on more nodes than there are. Spare slots past
    n_routed * num_nodes stay empty."""
    n = len(loads)
    base = min(floor, num_nodes)
    counts = [base] * n
    spare = min(total_slots - n * base, n * (num_nodes - base))
    heap = [(-load, e) for e, load in enumerate(loads)]  # (-load per replica, expert)
    heapq.heapify(heap)
    while spare > 0 and heap:
        _, e = heapq.heappop(heap)
        counts[e] += 1
        spare -= 1
        if counts[e] < num_nodes:
            heapq.heappush(heap, (-loads[e] / counts[e], e))
    return counts


def min_holders(placement: Placement) -> int:
    """The fewest FFN nodes any routed expert has: the redundancy a placement keeps when one node is away."""
    return min(len(placement.holders(e)) for e in range(placement.n_routed))


def rebalance(
    loads: Sequence[float],
    nodes: Sequence[str],
    slots: int | Sequence[int],
    current: Placement | None = None,
    min_replicas: int | None = None,
) -> Placement:
    """A placement of len(loads) routed experts on `nodes`, each holding at most its `slots` (one int for
    every node, or one per node). Replicas go, heaviest load per replica first, each to the least loaded
    node with a free slot that does not hold that expert yet; ties go to the node with fewer experts, then
    to one that holds the expert in `current` (fewer weights move), then to the first in node order.

    The greedy packing is not optimal: when `current` fits the slots and is at least as even on these
    loads, it is returned unchanged (no weights move for nothing), so the result never loses to it.

    Every expert gets at least `min_replicas` holders (default: as many as the fewest any expert has in
    `current`, so that a placement where each expert survives the loss of a node keeps that; 1 without one).

    A replica that finds room only on nodes holding its expert already takes a full node's place there, that
    node's lightest expert the node with room lacks moving over (`_make_room`); one that cannot (possible only
    with uneven `slots`) is left out: its expert keeps its other holders. ValueError when the slots cannot hold
    every expert `min_replicas` times."""
    loads = [float(x) for x in loads]
    n, F = len(loads), len(nodes)
    budget = [int(slots)] * F if isinstance(slots, int) else [int(s) for s in slots]
    if F < 1:
        raise ValueError("no FFN node to place experts on")
    if len(budget) != F:
        raise ValueError(f"{len(budget)} slot budgets for {F} FFN nodes")
    if n < 1 or any(x < 0 or x != x for x in loads):
        raise ValueError(f"expected a non-negative load per routed expert, got {loads!r}")
    if min(budget) < 1:
        raise ValueError(f"every FFN node needs at least one expert slot, got {budget}")
    floor = min_replicas if min_replicas is not None else 1 if current is None else min_holders(current)
    floor = min(max(1, floor), F)
    if sum(budget) < n * floor:
        each = f"{budget[0]} each" if len(set(budget)) == 1 else "+".join(map(str, budget))
        times = "once each" if floor == 1 else f"{floor} times each (--min-replicas)"
        raise ValueError(
            f"{sum(budget)} expert slots on {F} FFN nodes ({each}) cannot hold the "
            f"{n} routed experts {times}: give each node at least {-(-n * floor // F)} slots"
        )
    counts = replica_counts(loads, sum(budget), F, floor)
    shares = [loads[e] / counts[e] for e in range(n)]  # a replica's share of its expert's load
    replicas = sorted(((shares[e], e) for e in range(n) for _ in range(counts[e])), key=lambda r: (-r[0], r[1]))
    was = [set(current.held_by(name)) if current is not None and name in current.nodes else set() for name in nodes]
    node_load = [0.0] * F
    held: list[set[int]] = [set() for _ in range(F)]
    for share, e in replicas:
        free = [f for f in range(F) if len(held[f]) < budget[f] and e not in held[f]]
        if not free:
            _make_room(e, held, budget, node_load, shares)
            free = [f for f in range(F) if len(held[f]) < budget[f] and e not in held[f]]
        if not free:
            continue  # every node with room holds e, and none can trade for it
        f = min(free, key=lambda g: (node_load[g], len(held[g]), e not in was[g], g))
        held[f].add(e)
        node_load[f] += share
    new = Placement(n, tuple(nodes), tuple(tuple(sorted(h)) for h in held))
    if current is None or current.nodes != new.nodes or current.n_routed != n:
        return new
    fits = all(len(h) <= b for h, b in zip(current.held, budget)) and min_holders(current) >= floor
    return current if fits and imbalance(current, loads) <= imbalance(new, loads) else new


def _make_room(e: int, held: list[set[int]], budget: list[int], node_load: list[float], share: list[float]) -> None:
    """The packing's last replicas can find room only on nodes that hold their expert already (the others are
    full): a full node without `e` hands one of its experts that a node with room lacks to that node, which
    leaves room for `e` where it is not. A node with room holds fewer experts than a full one, so the full
    one always has an expert to hand over."""
    for x in [f for f in range(len(held)) if len(held[f]) < budget[f]]:
        for y in [f for f in range(len(held)) if e not in held[f] and len(held[f]) >= budget[f]]:
            g = next((g for g in sorted(held[y], key=lambda g: share[g]) if g not in held[x]), None)
            if g is not None:
                held[y].remove(g)
                held[x].add(g)
                node_load[y] -= share[g]
                node_load[x] += share[g]
                return


def node_loads(placement: Placement, loads: Sequence[float]) -> list[float]:
    """Each node's load: the sum of its experts' loads, a replicated expert's split evenly over its
    holders (the data plane splits its tokens by token index across them)."""
    holders = [0] * placement.n_routed
    for h in placement.held:
        for e in h:
            holders[e] += 1
    return [sum(loads[e] / holders[e] for e in h) for h in placement.held]


def imbalance(placement: Placement, loads: Sequence[float]) -> float:
    """max / mean of the node loads: 1.0 is even; the busiest node sets the layer's time. 1.0 when no
    load was counted at all."""
    per_node = node_loads(placement, loads)
    mean = sum(per_node) / len(per_node)
    return max(per_node) / mean if mean > 0 else 1.0
