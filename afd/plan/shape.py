"""What the decode-step simulator (afd.plan.simulate) is asked about: the model's shape and the cluster's
layout, validated on construction so that a search over layouts fails on the field it got wrong.

Pure Python (no torch): `afd plan` builds many of these.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.dataplane.protocol import MAX_MICRO_BATCHES, QMAX
from afd.model.config import DTYPES

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
        """From any family's ModelConfig (afd.model.config). A ModelConfig does not carry the checkpoint's
        dtype: give `dtype` (from_hf reads it), else float32, afd.model.config.checkpoint_dtype's default."""
        return cls(
            num_layers=cfg.num_layers,
            moe_layers=tuple(cfg.moe_layers),
            hidden_size=cfg.hidden_size,
            experts_per_token=cfg.experts_per_token,
            n_routed_experts=cfg.n_routed_experts,
            identity_experts=cfg.identity_experts,
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

    @classmethod
    def from_cluster(cls, cfg, batch: int, micro_batches: int | None = None) -> Layout:
        """A cluster YAML's layout (afd.config.schema.ClusterConfig) at `batch` sequences per attention node;
        `micro_batches` overrides the YAML's, and must be given where it leaves them to the tuner (0)."""
        if cfg.colocated:
            raise ValueError(f"{cfg.source}: no FFN nodes (colocated), so nothing crosses to simulate")
        lay = cfg.layout
        m = micro_batches or lay.micro_batches
        if not m:
            raise ValueError(f"{cfg.source}: layout.micro_batches is 0 (chosen at run time): give micro_batches")
        attention, ffn = len(cfg.attention_nodes), len(cfg.ffn_nodes)
        return cls(attention, ffn, batch, m, lay.attention_tp, lay.overlap, cfg.routing, lay.exchange_dtype)
