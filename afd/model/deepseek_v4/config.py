"""DeepSeek-V4's hyper-parameters, with transformers' DeepseekV4Config defaults (torch-free: `afd check-config`
reads it). Reference: transformers 5.24, models/deepseek_v4/configuration_deepseek_v4.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from afd.model.config import ConfigError, HFNames, check_types, eos_ids, from_hf_dict

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SWA, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_LEGACY_RATIO = {0: SWA, 4: CSA, 128: HCA}  # HF's _COMPRESS_RATIO_TO_LAYER_TYPE
# Keys whose other values HF's model ignores or builds differently than DeepSeek's own code: afd runs only
# the value HF's model means (its routers always normalise; its shared MLP is one moe_intermediate_size wide).
FIXED = {
    "hidden_act": "silu",
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "attention_bias": False,
    "mlp_bias": False,
}
SCORING = ("sqrtsoftplus", "sigmoid")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor")
"""YaRN's keys afd reads; HF's V4 always truncates the correction range (it reads `truncate` from the top
level of its nested rope_parameters, where there is none), so afd does too."""


@dataclass(frozen=True)
class DeepseekV4Config(HFNames):
    """Every default is DeepseekV4Config's in transformers (tests/test_deepseek_v4_config.py holds them equal)."""

    model_type: ClassVar[str] = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    """Each routed expert's, and the shared expert's (HF's DeepseekV4MLP reads intermediate_size, mapped here)."""
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    """The sliding-window layers' ("main") rope base."""
    compress_rope_theta: float = 160000.0
    """The CSA / HCA layers' ("compress") rope base, their compressors' and indexers' too."""
    layer_types: tuple[str, ...] = ()
    """Per layer: sliding_attention, compressed_sparse_attention or heavily_compressed_attention (from_hf_dict
    fills HF's default schedule)."""
    mlp_layer_types: tuple[str, ...] = ()
    """Per layer: hash_moe (experts by tid2eid[token id]) or moe (learned top-k)."""
    csa_rate: int = 4
    hca_rate: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False
    partial_rotary_factor: float = 64 / 512
    rope_type: str = "default"
    """The compressed layers' rope: default or yarn (HF applies YaRN to those layers only)."""
    rope_factor: float | None = None
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float | None = None
    rope_beta_slow: float | None = None
    rope_attention_factor: float | None = None

    def __post_init__(self):
        check_types(
            self,
            (
                "vocab_size",
                "hidden_size",
                "moe_intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "head_dim",
                "q_lora_rank",
                "num_experts_per_tok",
                "n_routed_experts",
                "csa_rate",
                "hca_rate",
                "hc_mult",
                "hc_sinkhorn_iters",
                "sliding_window",
                "o_groups",
                "o_lora_rank",
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "max_position_embeddings",
            ),
        )
        L = self.num_hidden_layers
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, name)
            if len(types) != L:
                raise ConfigError(f"config.json: '{name}' has {len(types)} entries for 'num_hidden_layers' {L}")
            if bad := sorted(set(types) - set(allowed)):
                raise ConfigError(f"config.json: '{name}' entries must be one of {allowed}, got {bad}")
        if self.scoring_func not in SCORING:
            raise ConfigError(f"config.json: unsupported scoring_func {self.scoring_func!r}; afd supports {SCORING}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("config.json: 'num_experts_per_tok' exceeds 'n_routed_experts'")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError("config.json: 'o_groups' must divide 'num_attention_heads' x 'head_dim'")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            raise ConfigError(
                f"config.json: 'partial_rotary_factor' x 'head_dim' gives {self.rope_dim} rope dims: they must be "
                f"even and fit 'head_dim' ({self.head_dim}) and 'index_head_dim' ({self.index_head_dim})"
            )
        if self.hc_mult > self.hidden_size:
            raise ConfigError("config.json: 'hc_mult' exceeds 'hidden_size'")
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(f"config.json: unsupported rope_type {self.rope_type!r}; afd supports default, yarn")
        if self.rope_type == "yarn" and self.rope_factor is None:
            raise ConfigError("config.json: yarn rope_parameters need 'factor'")

    # ---- afd.model.config.ModelConfig --------------------------------------------------------------------

    @property
    def routes_by_token_ids(self) -> bool:
        """The hash layers' experts are tid2eid[token id]: they route where the ids are (layout.routing
        attention; afd.config.loader.check_routing)."""
        return "hash_moe" in self.mlp_layer_types

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Every V4 layer is an MoE layer (hash or learned routing)."""
        return tuple(range(self.num_hidden_layers))

    # ---- derived ------------------------------------------------------------------------------------------

    @property
    def rope_dim(self) -> int:
        """Rotary dims at the end of each head (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, i: int) -> int:
        """Layer i's compression rate; 0 for a sliding-window-only layer."""
        return {SWA: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[i]]

    def is_csa(self, i: int) -> bool:
        """Whether layer i is compressed sparse attention (its compressor windows overlap; it has an indexer)."""
        return self.layer_types[i] == CSA

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The page pool of V4's state kinds (state_kinds): [1, pages, page values]."""
        from afd.model.state_spec import StateLayout

        return (1, num_blocks, StateLayout(self.state_kinds(), block_size).page_values)

    def state_kinds(self) -> tuple:
        """A window of per-token planes and full-history compressed entries (afd.model.deepseek_v4.state)."""
        from afd.model.deepseek_v4.state import state_kinds

        return state_kinds(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> DeepseekV4Config:
        for key, want in FIXED.items():
            if d.get(key) not in (None, want):
                raise ConfigError(f"config.json: unsupported {key} {d[key]!r}; afd supports {want!r}")
        q = d.get("quantization_config")
        experts = (q.get("expert_dtype") if isinstance(q, dict) else None) or d.get("expert_dtype") or "fp8"
        if experts != "fp8":  # DeepSeek-V4-Flash: e2m1 pairs packed in int8, a ue8m0 scale per 32 columns
            raise ConfigError(
                f"config.json: expert_dtype {experts!r} is not supported; afd reads FP8 (e4m3, block-scaled) experts"
            )
        L = d.get("num_hidden_layers", cls.num_hidden_layers)
        if not isinstance(L, int) or L < 0:
            raise ConfigError(f"config.json: 'num_hidden_layers' must be a non-negative integer, got {L!r}")
        rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
        rates[CSA] = d.get("compress_rate_csa", rates[CSA])  # legacy keys HF folds in
        rates[HCA] = d.get("compress_rate_hca", rates[HCA])
        types = d.get("layer_types")
        if types is None and d.get("compress_ratios") is not None:
            types = [_LEGACY_RATIO.get(r, str(r)) for r in d["compress_ratios"]]
        if types is None:  # HF's default: 2 HCA, then CSA / HCA interleaved
            types = [HCA] * min(L, 2) + [CSA if i % 2 else HCA for i in range(max(L - 2, 0))]
        mlp = d.get("mlp_layer_types")
        if mlp is None:
            n_hash = d.get("num_hash_layers", 3)
            mlp = ["hash_moe"] * min(L, n_hash) + ["moe"] * max(0, L - n_hash)
        partial = d.get("partial_rotary_factor")
        if partial is None:
            qk_rope = d.get("qk_rope_head_dim")
            partial = qk_rope / d.get("head_dim", cls.head_dim) if qk_rope is not None else 64 / 512
        derived = {
            "layer_types": tuple(types[:L]),
            "mlp_layer_types": tuple(mlp[:L]),
            "csa_rate": rates[CSA],
            "hca_rate": rates[HCA],
            "partial_rotary_factor": float(partial),
            "eos_token_ids": eos_ids(d.get("eos_token_id", 1)),
            "bos_token_id": d.get("bos_token_id", cls.bos_token_id),
            **_rope(d),
        }
        return from_hf_dict(cls, d, {"num_local_experts": "n_routed_experts"}, **derived)


def _rope(d: dict) -> dict:
    """rope_theta, compress_rope_theta and the compressed layers' YaRN from rope_parameters: flat (YaRN's keys
    beside the thetas, as DeepSeek ships it) or nested {"main": ..., "compress": ...} (as HF saves it)."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    out = {
        "rope_theta": float(d.get("rope_theta", 10000.0)),
        "compress_rope_theta": float(d.get("compress_rope_theta", 160000.0)),
    }
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ConfigError("config.json: rope_parameters.main must be a default rope")
        out["rope_theta"] = float(main.get("rope_theta", out["rope_theta"]))
        out["compress_rope_theta"] = float(comp.get("rope_theta", out["compress_rope_theta"]))
    else:
        comp = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    rope_type = comp.get("rope_type", comp.get("type", "default"))
    out["rope_type"] = rope_type
    if rope_type == "yarn":
        out.update({f"rope_{k}": comp[k] for k in YARN_KEYS if comp.get(k) is not None})
        out.setdefault("rope_attention_factor", 1.0)  # HF forces 1.0: V4 does not scale cos / sin
        out.setdefault("rope_original_max_position_embeddings", d.get("max_position_embeddings", 1048576))
    return out
