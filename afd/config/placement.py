"""Which routed experts each FFN node holds (`layout.placement`), replicas included, and what a placement
costs on the wire by formula.

A placement names, per FFN node, the experts it holds: a list of ids and `lo-hi` ranges (both ends
included), e.g. `{ffn0: "0-7", ffn1: [8, 9, "10-15", 3]}`. Every routed expert has at least one holder;
an expert held by several nodes is replicated, and the attention nodes split its tokens across the live
holders (afd.dataplane.dispatch). The default is contiguous ranges in node order, cut at expert-group
boundaries where the router limits a token to `topk_group` groups (DeepSeek-V3), so that such a token
reaches at most topk_group nodes.

Pure Python: `afd check-config` and `afd rebalance` read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb


class PlacementError(ValueError):
    """A placement that names no expert, an unknown one, or leaves one without a holder."""


@dataclass(frozen=True)
class Placement:
    n_routed: int
    nodes: tuple[str, ...]
    """FFN node names, in the cluster's rank order."""
    held: tuple[tuple[int, ...], ...]
    """held[f]: the routed experts node f holds, ascending: its weights' slot order."""

    def __post_init__(self):
        if len(self.nodes) != len(self.held):
            raise PlacementError(f"{len(self.nodes)} nodes, {len(self.held)} expert lists")
        for name, experts in zip(self.nodes, self.held):
            if not experts:
                raise PlacementError(f"{name} holds no expert")
            bad = [e for e in experts if not 0 <= e < self.n_routed]
            if bad:
                raise PlacementError(
                    f"{name}: expert {bad[0]} is not one of the model's {self.n_routed} (0-{self.n_routed - 1})"
                )
            if list(experts) != sorted(set(experts)):
                raise PlacementError(f"{name}: experts must be ascending without repeats")
        missing = sorted(set(range(self.n_routed)) - {e for h in self.held for e in h})
        if missing:
            raise PlacementError(f"no FFN node holds expert(s) {format_experts(missing)}")

    def holders(self, e: int) -> tuple[int, ...]:
        """Indices (into `nodes`) of the nodes holding expert e."""
        return tuple(f for f, h in enumerate(self.held) if e in h)

    @property
    def replicated(self) -> bool:
        return sum(len(h) for h in self.held) > self.n_routed

    def held_by(self, name: str) -> tuple[int, ...]:
        return self.held[self.nodes.index(name)]

    def unserved(self, dead: set[str] | frozenset[str]) -> list[int]:
        """Experts no live node holds once the nodes in `dead` are gone."""
        live = {e for n, h in zip(self.nodes, self.held) if n not in dead for e in h}
        return [e for e in range(self.n_routed) if e not in live]

    def to_yaml(self) -> dict[str, str]:
        """`layout.placement` as the YAML writes it: each node's experts as compact ranges."""
        return {n: format_experts(h) for n, h in zip(self.nodes, self.held)}


def format_experts(experts) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    out: list[str] = []
    run: list[int] = []
    for e in sorted(experts):
        if run and e == run[-1] + 1:
            run.append(e)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [e]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_experts(spec) -> tuple[int, ...]:
    """A node's entry of layout.placement: an int, a `lo-hi` range (ends included), a comma-separated
    string of those, or a list of them -> the experts, ascending and without repeats."""
    items = spec if isinstance(spec, list) else [spec]
    out: set[int] = set()
    for item in items:
        if type(item) is int:
            out.add(item)
            continue
        if not isinstance(item, str) or not item.strip():
            raise PlacementError(f"expected expert ids or 'lo-hi' ranges, got {item!r}")
        for part in item.split(","):
            lo, sep, hi = part.strip().partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise PlacementError(f"{part.strip()!r} is not an expert id or a 'lo-hi' range")
            a, b = int(lo), int(hi) if sep else int(lo)
            if b < a:
                raise PlacementError(f"range {part.strip()!r} ends before it starts")
            out.update(range(a, b + 1))
    if not out:
        raise PlacementError("names no expert")
    return tuple(sorted(out))


def default_placement(n_routed: int, nodes: list[str], groups: int = 1) -> Placement:
    """Contiguous ranges of near-equal size in node order; with `groups` > 1 (a group-limited router) and
    at least as many groups as nodes, whole groups per node."""
    F = len(nodes)
    if F < 1:
        raise PlacementError("need at least one FFN node")
    if n_routed < F:
        raise PlacementError(f"{F} FFN nodes for {n_routed} routed experts: some would hold none")
    unit = n_routed // groups if groups > 1 and groups >= F else 1
    spans = _even(n_routed // unit, F)
    return Placement(n_routed, tuple(nodes), tuple(tuple(range(lo * unit, hi * unit)) for lo, hi in spans))


def _even(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    spans, lo = [], 0
    for f in range(parts):
        hi = lo + base + (1 if f < extra else 0)
        spans.append((lo, hi))
        lo = hi
    return spans


def from_yaml(spec: dict, n_routed: int, nodes: list[str]) -> Placement:
    """layout.placement (node name -> experts) against the FFN nodes and the model."""
    if set(spec) != set(nodes):
        raise PlacementError(f"must name every FFN node exactly ({', '.join(nodes)}); got {', '.join(map(str, spec))}")
    held = []
    for n in nodes:
        try:
            held.append(parse_experts(spec[n]))
        except PlacementError as e:
            raise PlacementError(f"{n}: {e}") from None
    return Placement(n_routed, tuple(nodes), tuple(held))


# ---- what it costs on the wire, by formula ----------------------------------------------------------


def miss_probability(p: Placement, f: int, top_k: int, groups: int = 1, topk_group: int = 1) -> float:
    """P(a token sends nothing to node f) when its top_k experts are a uniformly random set (within
    `topk_group` uniformly random groups of `groups`, for a group-limited router), and each slot of a
    replicated expert goes to one of its r holders with probability 1/r (afd.dataplane.dispatch splits
    by token, which is uniform over tokens)."""
    E = p.n_routed
    # q[e]: P(a slot on expert e does not go to f)
    q = [1.0 - (1.0 / len(p.holders(e)) if e in p.held[f] else 0.0) for e in range(E)]
    if groups <= 1 or topk_group >= groups:
        return _esp(q, top_k)[top_k] / comb(E, top_k)
    size = E // groups
    # The mean over the comb(groups, topk_group) choices of groups of e_K over the chosen groups' q. e_K of a union
    # is a coefficient of the product of each group's generating polynomial, so the sum over every choice is one
    # pass over the groups: by_count[j] sums the products over the choices of j groups so far.
    by_count = [[1.0] + [0.0] * top_k] + [[0.0] * (top_k + 1) for _ in range(topk_group)]
    for g in range(groups):
        poly = _esp(q[g * size : (g + 1) * size], top_k)
        for j in range(min(g + 1, topk_group), 0, -1):
            by_count[j] = _add(by_count[j], _times(by_count[j - 1], poly))
    return by_count[topk_group][top_k] / comb(topk_group * size, top_k) / comb(groups, topk_group)


def _esp(q: list[float], k: int) -> list[float]:
    """The elementary symmetric polynomials e_0(q) .. e_k(q) (e_j: the sum over j-subsets of the product of
    their q), the coefficients of prod(1 + q_e t) up to t^k."""
    e = [1.0] + [0.0] * k
    for x in q:
        for j in range(k, 0, -1):
            e[j] += e[j - 1] * x
    return e


def _times(a: list[float], b: list[float]) -> list[float]:
    """The product of two polynomials, up to the degree they have."""
    return [sum(a[i] * b[d - i] for i in range(d + 1)) for d in range(len(a))]


def _add(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b)]


def expected_fanout(p: Placement, top_k: int, groups: int = 1, topk_group: int = 1) -> float:
    """The expected number of FFN nodes one token is sent to, under the uniform routing of miss_probability."""
    return sum(1.0 - miss_probability(p, f, top_k, groups, topk_group) for f in range(len(p.nodes)))


def routed_fanout(p: Placement, top_k: int, groups: int = 1, topk_group: int = 1, identity: int = 0) -> float:
    """expected_fanout when a token's top_k picks are uniform over the routed and `identity` experts: only the
    routed picks cross (afd.dataplane.dispatch), and how many there are is hypergeometric. Group-limited
    routing has no identity experts (DeepSeek-V3's), so the two never mix."""
    if identity == 0:
        return expected_fanout(p, top_k, groups, topk_group)
    E, total = p.n_routed, comb(p.n_routed + identity, top_k)
    return sum(
        comb(E, k) * comb(identity, top_k - k) / total * expected_fanout(p, k, groups, topk_group)
        for k in range(top_k + 1)
    )


def max_fanout(p: Placement, top_k: int, groups: int = 1, topk_group: int = 1) -> int:
    """At most this many FFN nodes per token: top_k, the node count, and with a group-limited router the
    nodes the topk_group most spread groups span."""
    bound = min(top_k, len(p.nodes))
    if groups > 1 and topk_group < groups:
        size = p.n_routed // groups
        spans = sorted(
            (len({f for e in range(g * size, (g + 1) * size) for f in p.holders(e)}) for g in range(groups)),
            reverse=True,
        )
        bound = min(bound, sum(spans[:topk_group]))
    return bound
