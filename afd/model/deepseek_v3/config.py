"""DeepSeek-V3's hyper-parameters, with transformers' DeepseekV3Config defaults (torch-free:
`afd check-config` reads it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from afd.model.config import ConfigError, HFNames, check_types, eos_ids, from_hf_dict, rope_theta, rope_type
from afd.model.state_spec import StateKind, full_history

# HF's attribute_map: config.json may use these names for the fields on the right.
ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
ROPE_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)
"""YaRN's keys of rope_parameters, kept as the fields rope_<key> (None where config.json has none)."""
# Keys HF's DeepseekV3 ignores but DeepSeek's own code honours: afd runs only the values HF's model means.
HUB_ONLY = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


@dataclass(frozen=True)
class DeepseekV3Config(HFNames):
    """Every default is DeepseekV3Config's in transformers (tests/test_model_config.py holds them equal)."""

    model_type: ClassVar[str] = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    """The dense layers' MLP (layers below first_k_dense_replace)."""
    moe_intermediate_size: int = 2048
    """Each routed expert's; the shared experts are one MLP of n_shared_experts times this."""
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    """None: q is one projection, without a LoRA."""
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 1
    """MTP modules a checkpoint holds after the decoder layers (model.layers.{num_hidden_layers + k}.*);
    speculative decoding uses the first (afd.model.deepseek_v3.mtp)."""
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float | None = None
    rope_beta_slow: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_truncate: bool | None = None

    def __post_init__(self):
        check_types(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "v_head_dim",
                "num_experts_per_tok",
                "n_routed_experts",
                "moe_intermediate_size",
                "intermediate_size",
                "n_group",
                "topk_group",
                "max_position_embeddings",
            ),
        )
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ConfigError(
                f"config.json: 'q_lora_rank' must be a positive integer or null, got {self.q_lora_rank!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")
        E, G = self.n_routed_experts, self.n_group
        if E % G or E // G < 2:  # each group is scored by its top-2 experts
            raise ConfigError(
                f"config.json: 'n_routed_experts' ({E}) must split into 'n_group' ({G}) groups of at least 2 experts"
            )
        if self.topk_group > G:
            raise ConfigError(f"config.json: 'topk_group' ({self.topk_group}) exceeds 'n_group' ({G})")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds the "
                f"{self.topk_group * (E // G)} experts of 'topk_group' ({self.topk_group}) of "
                f"'n_group' ({G}) groups"
            )

    @property
    def expert_groups(self) -> tuple[int, int]:
        return (self.n_group, self.topk_group)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Per-token KV cache width: the MLA latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """HF's DeepseekV3DecoderLayer: an MoE from layer first_k_dense_replace on, a dense MLP below."""
        return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

    @property
    def mtp_moe_layers(self) -> tuple[int, ...]:
        """The MTP module's MoE layer, by its checkpoint index: it is decoder layer num_hidden_layers to
        HF's DeepseekV3DecoderLayer (vLLM's deepseek_mtp.py builds it with that prefix), so an MoE
        layer whenever that index is past first_k_dense_replace."""
        L = self.num_hidden_layers
        return (L,) if self.first_k_dense_replace <= L else ()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One MLA per layer, caching latents: [L, blocks, block_size, C + R]."""
        return (self.num_hidden_layers, num_blocks, block_size, self.latent_dim)

    def state_kinds(self) -> tuple[StateKind, ...]:
        """One full-history kind, per token, in kv_cache_shape's layout (afd.model.state_spec)."""
        return full_history(self)

    @property
    def yarn_factor(self) -> float:
        """rope_factor under YaRN (from_hf_dict refuses yarn without it)."""
        if self.rope_factor is None:
            raise ConfigError("config.json: yarn rope_parameters need 'factor'")
        return self.rope_factor

    @property
    def yarn_original_max_position_embeddings(self) -> int:
        """Under YaRN (from_hf_dict fills it from max_position_embeddings, as HF does)."""
        if self.rope_original_max_position_embeddings is None:
            raise ConfigError("config.json: yarn rope_parameters need 'original_max_position_embeddings'")
        return self.rope_original_max_position_embeddings

    @property
    def rope_attention_scale(self) -> float:
        """YaRN's factor on cos and sin (so on q_rot . k_rot, squared)."""
        if self.rope_type == "default":
            return 1.0
        if self.rope_attention_factor is not None:
            return self.rope_attention_factor
        f = self.yarn_factor
        if self.rope_mscale and self.rope_mscale_all_dim:
            return float(_mscale(f, self.rope_mscale) / _mscale(f, self.rope_mscale_all_dim))
        return _mscale(f)

    @property
    def softmax_scale(self) -> float:
        """HF's DeepseekV3Attention.scaling: under YaRN with mscale_all_dim, DeepSeek stretches the whole
        score (nope dims too) by mscale(factor, mscale_all_dim)^2."""
        scale = self.qk_head_dim ** (-0.5)
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            m = _mscale(self.yarn_factor, self.rope_mscale_all_dim)
            scale = scale * m * m
        return scale

    @classmethod
    def from_hf_dict(cls, d: dict) -> DeepseekV3Config:
        for key, want in (("hidden_act", "silu"), *HUB_ONLY.items()):
            if d.get(key) not in (None, want):
                raise ConfigError(f"config.json: unsupported {key} {d[key]!r}; afd supports {want!r}")
        nkv, heads = d.get("num_key_value_heads", 128), d.get("num_attention_heads", cls.num_attention_heads)
        if nkv is not None and nkv != heads:  # HF's default is 128 whatever the heads
            raise ConfigError(
                f"config.json: MLA needs 'num_key_value_heads' ({nkv}) == 'num_attention_heads' ({heads})"
            )
        derived = {
            "rope_theta": rope_theta(d, cls.rope_theta),
            "rope_type": rope_type(d),
            "eos_token_ids": eos_ids(d.get("eos_token_id", 1)),
            "bos_token_id": d.get("bos_token_id", cls.bos_token_id),
            "q_lora_rank": d.get("q_lora_rank", cls.q_lora_rank),
        }  # null is meaningful here
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if derived["rope_type"] not in ("default", "yarn"):
            raise ConfigError(
                f"config.json: unsupported rope_type {derived['rope_type']!r}; afd supports 'default' and 'yarn'"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("config.json: unsupported rope_parameters 'partial_rotary_factor'; afd supports 1.0")
        if derived["rope_type"] == "yarn":
            derived.update({f"rope_{k}": rope[k] for k in ROPE_KEYS if rope.get(k) is not None})
            if "rope_factor" not in derived:
                raise ConfigError("config.json: yarn rope_parameters need 'factor'")
            derived.setdefault(
                "rope_original_max_position_embeddings",  # as HF's standardize_rope_params
                d.get("max_position_embeddings", cls.max_position_embeddings),
            )
        return from_hf_dict(cls, d, ALIASES, **derived)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
