"""What the decode-step simulator (afd.plan.simulate) is asked about: the model's shape, the cluster's layout,
and what one (layer, micro-batch) moves and computes under them, by the data plane's own formulas.

Pure Python (no torch): `afd plan` searches many layouts, and `afd check-config` style callers read it.

Expected values under uniform routing throughout: a token's K picks are a uniformly random K-subset of
the routed and identity experts (afd.cluster.placement.miss_probability), experts placed by
default_placement, no replicas. A real router's skew raises the busiest FFN node's rows above the mean;
the simulator does not model that.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from afd.cluster.placement import Placement, default_placement, miss_probability
from afd.dataplane.protocol import COUNT_BYTES, MAX_MICRO_BATCHES, QMAX
from afd.dataplane.wire_cost import per_token
from afd.model.config import DTYPES
from afd.plan.costs import CostModel

ROUTINGS = ("ffn", "attention")
"""layout.routing: `ffn` broadcasts every token to every FFN node, `attention` dispatches each token to
the nodes holding its experts (docs/architecture/dataplane.md, A:F ratios and routing)."""
EXCHANGE_DTYPES = ("same", *QMAX)


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a model the step's times and bytes depend on."""

    num_layers: int
    moe_layers: tuple[int, ...]
    """Layers whose MoE crosses to the FFN nodes; the others are dense (attention side only)."""
    hidden_size: int
    experts_per_token: int
    """K: the router's picks per token, identity experts included (what a dispatched row carries ids for)."""
    n_routed_experts: int
    identity_experts: int = 0
    """LongCat-Flash's zero-computation experts: picked like routed ones, applied on the attention side."""
    expert_groups: tuple[int, int] = (1, 1)
    """(groups, kept per token) of a group-limited router (DeepSeek-V3); (1, 1) without groups."""
    dtype: str = "bfloat16"
    """The activations' dtype (what crosses unquantized): float32, bfloat16 or float16."""
    name: str = ""

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.moe_layers:
            raise ValueError("moe_layers is empty: a model without MoE layers has nothing to disaggregate")
        if list(self.moe_layers) != sorted(set(self.moe_layers)) or self.moe_layers[0] < 0:
            raise ValueError(f"moe_layers must be ascending without repeats, got {self.moe_layers}")
        if self.moe_layers[-1] >= self.num_layers:
            raise ValueError(f"moe layer {self.moe_layers[-1]} is not one of the {self.num_layers} layers")
        for what in ("hidden_size", "experts_per_token", "n_routed_experts"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be >= 1, got {getattr(self, what)}")
        if self.identity_experts < 0:
            raise ValueError(f"identity_experts must be >= 0, got {self.identity_experts}")
        if self.experts_per_token > self.n_routed_experts + self.identity_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} exceeds the {self.n_routed_experts} routed + "
                f"{self.identity_experts} identity experts"
            )
        groups, keep = self.expert_groups
        if not 1 <= keep <= groups or self.n_routed_experts % groups:
            raise ValueError(f"expert_groups {self.expert_groups} do not divide {self.n_routed_experts} experts")
        if groups > 1 and self.identity_experts:
            raise ValueError("a group-limited router with identity experts is not modelled (no family has one)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")

    @classmethod
    def from_config(cls, cfg, dtype: str | None = None, name: str = "") -> ModelShape:
        """From any family's ModelConfig (afd.model.config); `dtype` defaults to float32 when the config
        names none (afd.model.config.checkpoint_dtype's rule)."""
        return cls(
            num_layers=cfg.num_layers,
            moe_layers=tuple(cfg.moe_layers),
            hidden_size=cfg.hidden_size,
            experts_per_token=cfg.experts_per_token,
            n_routed_experts=cfg.n_routed_experts,
            # not in the ModelConfig protocol: LongCat-Flash's alone (as afd/bench/dispatch.py reads it)
            identity_experts=getattr(cfg, "zero_expert_num", 0),
            expert_groups=tuple(cfg.expert_groups),
            dtype=dtype or "float32",
            name=name or cfg.model_type,
        )

    @classmethod
    def from_hf(cls, d: dict, dtype: str | None = None, name: str = "") -> ModelShape:
        """From a config.json dict (afd.model.registry.config_from_hf), its own dtype unless given."""
        from afd.model.config import checkpoint_dtype
        from afd.model.registry import config_from_hf

        return cls.from_config(config_from_hf(d), dtype or checkpoint_dtype(d), name)

    @classmethod
    def from_model(cls, path: str, dtype: str | None = None) -> ModelShape:
        """From a checkpoint directory's config.json (`afd plan --model DIR`), named by the directory."""
        from afd.model.config import read_config_json

        return cls.from_hf(read_config_json(path), dtype, path)

    @property
    def routed_per_token(self) -> float:
        """Expected routed (non-identity) picks per token: the token-expert rows it brings the FFN nodes."""
        return self.experts_per_token * self.n_routed_experts / (self.n_routed_experts + self.identity_experts)


@dataclass(frozen=True)
class Layout:
    """The cluster: A attention nodes of `attention_tp` ranks each, F FFN nodes, and how a decode step runs.

    `batch` is the sequences per attention node (one token each in decode); each micro-batch gets B/m of
    them (the first B % m one more, as afd.engine.runner.split_micro_batches balances by tokens)."""

    attention_nodes: int
    ffn_nodes: int
    batch: int
    micro_batches: int = 1
    attention_tp: int = 1
    overlap: bool = True
    """Off (`--no-overlap`): the attention rank waits for each layer's MoE right after sending it."""
    routing: str = "ffn"
    exchange_dtype: str = "same"

    def __post_init__(self):
        for what in ("attention_nodes", "ffn_nodes", "attention_tp", "micro_batches"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be >= 1, got {getattr(self, what)}")
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise ValueError(f"micro_batches {self.micro_batches}: afd's step header holds at most {MAX_MICRO_BATCHES}")
        if self.batch < self.micro_batches:
            raise ValueError(f"batch {self.batch} < micro_batches {self.micro_batches}: a micro-batch would be empty")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r}: expected one of {', '.join(ROUTINGS)}")
        if self.exchange_dtype not in EXCHANGE_DTYPES:
            raise ValueError(f"exchange_dtype {self.exchange_dtype!r}: expected one of {', '.join(EXCHANGE_DTYPES)}")

    @property
    def attention_ranks(self) -> int:
        return self.attention_nodes * self.attention_tp

    @property
    def devices(self) -> int:
        return self.attention_ranks + self.ffn_nodes

    def tokens(self, i: int) -> int:
        """Tokens of micro-batch i on one attention node."""
        base, extra = divmod(self.batch, self.micro_batches)
        return base + (1 if i < extra else 0)


@dataclass(frozen=True)
class Scenario:
    """A model on a layout, with the cost model its times come from: what `simulate` takes."""

    shape: ModelShape
    layout: Layout
    costs: CostModel

    def __post_init__(self):
        F, E = self.layout.ffn_nodes, self.shape.n_routed_experts
        if F > E:
            raise ValueError(f"{F} FFN nodes for {E} routed experts: some would hold none")

    def placement(self) -> Placement:
        """The default placement, with the identity experts held by one more, phantom, node that stands for
        the attention side: a pick there crosses to no FFN node."""
        s, F = self.shape, self.layout.ffn_nodes
        p = default_placement(s.n_routed_experts, [f"ffn{f}" for f in range(F)], s.expert_groups[0])
        if not s.identity_experts:
            return p
        total = s.n_routed_experts + s.identity_experts
        return Placement(total, (*p.nodes, "identity"), (*p.held, tuple(range(s.n_routed_experts, total))))

    @cached_property
    def fanout(self) -> float:
        """Expected FFN nodes a token is dispatched to (uniform routing; identity picks cross nowhere)."""
        s, p = self.shape, self.placement()
        return sum(
            1.0 - miss_probability(p, f, s.experts_per_token, *s.expert_groups) for f in range(self.layout.ffn_nodes)
        )

    def ffn_rows(self, i: int) -> float:
        """Token-expert rows one FFN node computes for micro-batch i: every attention node's tokens, their
        routed picks spread evenly over the F nodes (both routings: broadcast sends more, computes the same)."""
        lay = self.layout
        return lay.attention_nodes * lay.tokens(i) * self.shape.routed_per_token / lay.ffn_nodes

    def messages(self, i: int) -> tuple[tuple[float, ...], float]:
        """(the messages' bytes to the FFN node, in order; the bytes back) between one attention rank and one
        FFN node for micro-batch i of a MoE layer, by afd.dataplane.wire_cost.per_token. Broadcast is one
        message; dispatch a count, then the rows (afd.dataplane.protocol). Under attention TP a rank sends
        only its 1/G of the rows (docs/architecture/tensor-parallel.md, the MoE boundary)."""
        s, lay = self.shape, self.layout
        F = lay.ffn_nodes
        fan = self.fanout if lay.routing == "attention" else 0.0  # broadcast's bytes do not depend on it
        cost = per_token(s.hidden_size, s.dtype, s.experts_per_token, lay.exchange_dtype, F, fan)
        rank_tokens = lay.tokens(i) / lay.attention_tp
        if lay.routing == "ffn":
            return (rank_tokens * cost["broadcast to_ffn"] / F,), rank_tokens * cost["broadcast to_attention"] / F
        return (COUNT_BYTES, rank_tokens * cost["dispatch to_ffn"] / F), rank_tokens * cost["dispatch to_attention"] / F
