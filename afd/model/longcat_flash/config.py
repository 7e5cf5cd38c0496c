"""LongCat-Flash's hyper-parameters, with transformers' LongcatFlashConfig defaults (torch-free:
`afd check-config` reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from afd.model.config import ConfigError, check_types, eos_ids, from_hf_dict, rope_theta, rope_type
from afd.model.state_spec import StateKind, full_history

# HF's attribute_map: config.json may use these names for the fields on the right.
ALIASES = {
    "num_local_experts": "n_routed_experts",
    "num_experts_per_tok": "moe_topk",
    "intermediate_size": "ffn_hidden_size",
    "moe_intermediate_size": "expert_ffn_hidden_size",
}
HF_HEAD_DIM = 64
"""LongcatFlashConfig.head_dim's default: HF sizes the rotary table by head_dim, not qk_rope_head_dim."""


@dataclass(frozen=True)
class LongcatFlashConfig:
    """Every default is LongcatFlashConfig's in transformers (tests/test_model_config.py holds them equal)."""

    model_type: ClassVar[str] = "longcat_flash"
    vocab_size: int = 131072
    hidden_size: int = 6144
    num_layers: int = 28
    """Logical layers; each holds 2 attentions, 2 dense MLPs and 1 shortcut MoE."""
    num_attention_heads: int = 64
    ffn_hidden_size: int = 12288
    """Intermediate size of the dense MLPs (attention side)."""
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    """Width of the compressed latent kept in the KV cache (plus `qk_rope_head_dim`)."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    moe_topk: int = 12
    n_routed_experts: int = 512
    expert_ffn_hidden_size: int = 2048
    zero_expert_num: int = 256
    """Identity experts: router indices >= n_routed_experts add `w * x`."""
    routed_scaling_factor: float = 6.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000000.0
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (2,)
    bos_token_id: int | None = 1

    def __post_init__(self):
        check_types(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_layers",
                "num_attention_heads",
                "kv_lora_rank",
                "q_lora_rank",
                "qk_rope_head_dim",
                "v_head_dim",
                "moe_topk",
                "n_routed_experts",
                "expert_ffn_hidden_size",
                "ffn_hidden_size",
                "max_position_embeddings",
            ),
        )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")
        if self.moe_topk > self.num_experts_total:
            raise ConfigError(
                f"config.json: 'moe_topk' ({self.moe_topk}) exceeds n_routed_experts + zero_expert_num "
                f"({self.num_experts_total})"
            )

    @property
    def num_experts_total(self) -> int:
        """Router outputs: routed experts followed by zero-compute (identity) experts."""
        return self.n_routed_experts + self.zero_expert_num

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_ffn_hidden_size

    @property
    def experts_per_token(self) -> int:
        return self.moe_topk

    @property
    def identity_experts(self) -> int:
        return self.zero_expert_num

    @property
    def expert_groups(self) -> tuple[int, int]:
        return (1, 1)

    @property
    def routes_by_token_ids(self) -> bool:
        return False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Per-token, per-attention KV cache width: the MLA latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Every LongCat-Flash layer has a shortcut MoE."""
        return tuple(range(self.num_layers))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Two MLA sublayers per layer, each caching latents: [L, 2, blocks, block_size, C + R]."""
        return (self.num_layers, 2, num_blocks, block_size, self.latent_dim)

    def state_kinds(self) -> tuple[StateKind, ...]:
        """One full-history kind, per token, in kv_cache_shape's layout (afd.model.state_spec)."""
        return full_history(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> LongcatFlashConfig:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {act!r}; afd supports 'silu'")
        if rope_type(d) != "default":
            raise ConfigError(f"config.json: unsupported rope_type {rope_type(d)!r}; afd supports 'default'")
        rope_dim = d.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        head_dim = d.get("head_dim")
        if head_dim is None:
            head_dim = HF_HEAD_DIM
        if head_dim != rope_dim:
            # HF sizes the rotary table by head_dim; the two must agree for the model to be well formed.
            raise ConfigError(
                f"config.json: 'head_dim' ({head_dim}{' by default' if 'head_dim' not in d else ''})"
                f" must equal 'qk_rope_head_dim' ({rope_dim})"
            )
        qk = d.get("qk_head_dim")
        nope = d.get("qk_nope_head_dim", cls.qk_nope_head_dim)
        if qk is not None and qk != nope + rope_dim:
            raise ConfigError(
                f"config.json: 'qk_head_dim' ({qk}) must equal 'qk_nope_head_dim' + 'qk_rope_head_dim' "
                f"({nope + rope_dim})"
            )
        nkv = d.get("num_key_value_heads")
        heads = d.get("num_attention_heads", cls.num_attention_heads)
        if nkv is not None and nkv != heads:
            raise ConfigError(
                f"config.json: MLA needs 'num_key_value_heads' ({nkv}) == 'num_attention_heads' ({heads})"
            )
        derived = {
            "rope_theta": rope_theta(d, cls.rope_theta),
            "eos_token_ids": eos_ids(d.get("eos_token_id", 2)),
            "bos_token_id": d.get("bos_token_id", cls.bos_token_id),
        }
        if "zero_expert_num" in d and d["zero_expert_num"] is None:
            derived["zero_expert_num"] = 0  # HF: `config.zero_expert_num or 0`
        return from_hf_dict(cls, d, ALIASES, **derived)
