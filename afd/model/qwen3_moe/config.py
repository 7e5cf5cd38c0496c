"""Qwen3-MoE's hyper-parameters, with transformers' Qwen3MoeConfig defaults (torch-free: `afd check-config`
reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from afd.model.config import ConfigError, HFNames, check_types, eos_ids, from_hf_dict, rope_theta, rope_type
from afd.model.state_spec import StateKind, full_history

# HF's attribute_map: save_pretrained writes `num_local_experts` for the field HF calls num_experts.
ALIASES = {"num_local_experts": "num_experts"}


@dataclass(frozen=True)
class Qwen3MoeConfig(HFNames):
    """Every default is Qwen3MoeConfig's in transformers (tests/test_model_config.py holds them equal)."""

    model_type: ClassVar[str] = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    """Intermediate size of the dense MLPs of `mlp_only_layers` (attention side)."""
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 64
    """HF: config.json's head_dim, else hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        check_types(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "decoder_sparse_step",
                "moe_intermediate_size",
                "num_experts_per_tok",
                "num_experts",
                "max_position_embeddings",
            ),
        )
        if self.head_dim % 2:
            raise ConfigError(f"config.json: 'head_dim' must be even (rotary pairs), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: 'num_attention_heads' ({self.num_attention_heads}) must be a multiple "
                f"of 'num_key_value_heads' ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                f"'num_experts' ({self.num_experts})"
            )
        if len(self.moe_layers) < self.num_layers and self.intermediate_size <= 0:
            raise ConfigError("config.json: 'intermediate_size' must be positive: some layers are dense")

    @property
    def n_routed_experts(self) -> int:
        return self.num_experts

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """HF's Qwen3MoeDecoderLayer rule; the other layers hold a dense MLP."""
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """K and V heads (after q/k norm and RoPE for K): [L, 2, blocks, block_size, KVH, D]."""
        return (self.num_layers, 2, num_blocks, block_size, self.num_key_value_heads, self.head_dim)

    def state_kinds(self) -> tuple[StateKind, ...]:
        """One full-history kind, per token, in kv_cache_shape's layout (afd.model.state_spec)."""
        return full_history(self)

    @classmethod
    def from_hf_dict(cls, d: dict) -> Qwen3MoeConfig:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {act!r}; afd supports 'silu'")
        if rope_type(d) != "default":
            raise ConfigError(f"config.json: unsupported rope_type {rope_type(d)!r}; afd supports 'default'")
        if d.get("use_sliding_window"):
            raise ConfigError("config.json: 'use_sliding_window' true is unsupported; afd attends to the full context")
        heads = d.get("num_attention_heads", cls.num_attention_heads)
        head_dim = d.get("head_dim") or d.get("hidden_size", cls.hidden_size) // max(heads, 1)
        mlp_only = d.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise ConfigError(f"config.json: 'mlp_only_layers' must be a list of layer indices, got {mlp_only!r}")
        derived = {
            "rope_theta": rope_theta(d, cls.rope_theta),
            "head_dim": head_dim,
            "mlp_only_layers": tuple(mlp_only),
            "eos_token_ids": eos_ids(d.get("eos_token_id")),
            "bos_token_id": d.get("bos_token_id"),
        }
        return from_hf_dict(cls, d, ALIASES, **derived)
