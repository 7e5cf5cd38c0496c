"""A model on a layout with its cost model, and what one (layer, micro-batch) moves and computes on each
FFN node under them, by the data plane's own formulas (afd.dataplane.wire_cost, afd.config.placement).

Expected values under uniform routing: a token's K picks are a uniformly random K-subset of the routed
and identity experts (afd.config.placement.miss_probability), a replicated expert's slots split evenly
over its holders. The placement is the YAML's or the default contiguous one; a real router's skew, which
raises the busiest FFN node above its expected rows, is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from afd.config.placement import Placement, default_placement, miss_probability
from afd.dataplane.protocol import COUNT_BYTES
from afd.dataplane.wire_cost import per_token
from afd.plan.costs import CostModel
from afd.plan.shape import Layout, ModelShape


@dataclass(frozen=True)
class Scenario:
    """What `simulate` takes. `placement`: the FFN nodes' routed experts (layout.placement); None for
    default_placement's contiguous split."""

    shape: ModelShape
    layout: Layout
    costs: CostModel
    placement: Placement | None = None

    def __post_init__(self):
        F, E = self.layout.ffn_nodes, self.shape.n_routed_experts
        if F > E:
            raise ValueError(f"{F} FFN nodes for {E} routed experts: some would hold none")
        p = self.placement
        if p is not None and (len(p.nodes) != F or p.n_routed != E):
            raise ValueError(f"the placement has {len(p.nodes)} nodes and {p.n_routed} experts, not {F} and {E}")
        if p is not None and p.replicated and self.layout.routing == "ffn":
            raise ValueError("replicated experts need routing 'attention' (a broadcast would apply them twice)")

    @classmethod
    def from_cluster(
        cls, cfg, shape: ModelShape, costs: CostModel, batch: int, micro_batches: int | None = None
    ) -> Scenario:
        """A cluster YAML (afd.config.schema.ClusterConfig) at `batch` sequences per attention node, its
        placement included."""
        layout = Layout.from_cluster(cfg, batch, micro_batches)
        return cls(shape, layout, costs, cfg.placement(shape.n_routed_experts, shape.expert_groups[0]))

    @cached_property
    def ffn_placement(self) -> Placement:
        s = self.shape
        names = [f"ffn{f}" for f in range(self.layout.ffn_nodes)]
        return self.placement or default_placement(s.n_routed_experts, names, s.expert_groups[0])

    @cached_property
    def node_fanout(self) -> tuple[float, ...]:
        """Per FFN node, the chance that a token sends it a row (dispatch). The identity experts are held by
        one more, phantom, node standing for the attention side, so a pick there crosses nowhere."""
        s, p = self.shape, self.ffn_placement
        if s.identity_experts:
            total = s.n_routed_experts + s.identity_experts
            p = Placement(total, (*p.nodes, "identity"), (*p.held, tuple(range(s.n_routed_experts, total))))
        K = s.experts_per_token
        return tuple(1.0 - miss_probability(p, f, K, *s.expert_groups) for f in range(self.layout.ffn_nodes))

    @property
    def fanout(self) -> float:
        """Expected FFN nodes a token is dispatched to."""
        return sum(self.node_fanout)

    @cached_property
    def node_share(self) -> tuple[float, ...]:
        """Per FFN node, its share of the routed picks: its experts, a replicated one's split over holders."""
        p = self.ffn_placement
        return tuple(sum(1.0 / len(p.holders(e)) for e in held) / p.n_routed for held in p.held)

    def ffn_rows(self, i: int, f: int = 0) -> float:
        """Token-expert rows FFN node f computes for micro-batch i: every attention node's tokens' routed
        picks on its experts (both routings: broadcast sends more, computes the same)."""
        lay = self.layout
        return lay.attention_nodes * lay.tokens(i) * self.shape.routed_per_token * self.node_share[f]

    def messages(self, i: int, f: int = 0) -> tuple[tuple[float, ...], float]:
        """(the messages' bytes to FFN node f, in order; the bytes back) between one attention rank and f
        for micro-batch i of a MoE layer, by afd.dataplane.wire_cost.per_token. Broadcast is one message;
        dispatch a count, then the rows (afd.dataplane.protocol). Under attention TP a rank sends only its
        1/G of the rows (docs/architecture/tensor-parallel.md, the MoE boundary)."""
        s, lay = self.shape, self.layout
        fan = self.node_fanout[f] if lay.routing == "attention" else 0.0  # broadcast's bytes do not need it
        cost = per_token(s.hidden_size, s.dtype, s.experts_per_token, lay.exchange_dtype, 1, fan)
        rank_tokens = lay.tokens(i) / lay.attention_tp
        if lay.routing == "ffn":
            return (rank_tokens * cost["broadcast to_ffn"],), rank_tokens * cost["broadcast to_attention"]
        return (COUNT_BYTES, rank_tokens * cost["dispatch to_ffn"]), rank_tokens * cost["dispatch to_attention"]
