"""Model and cache configuration: small dataclasses, validated on construction."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, fields

SUPPORTED_MODEL_TYPES = ("longcat_flash",)


class ConfigError(ValueError):
    """A configuration value is missing, has the wrong type, or is inconsistent."""


@dataclass(frozen=True)
class ModelConfig:
    """The LongCat-Flash hyper-parameters afd needs, read from an HF `config.json`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    """Logical layers; each holds 2 attentions, 2 dense MLPs and 1 shortcut MoE."""
    num_attention_heads: int
    ffn_hidden_size: int
    """Intermediate size of the dense MLPs (attention side)."""
    q_lora_rank: int
    kv_lora_rank: int
    """Width of the compressed latent kept in the KV cache (plus `qk_rope_head_dim`)."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_topk: int
    n_routed_experts: int
    expert_ffn_hidden_size: int
    zero_expert_num: int = 0
    """Identity experts: router indices >= n_routed_experts add `w * x`."""
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    router_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"config.json: '{f.name}' must be a non-negative integer, got {v!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "kv_lora_rank",
                     "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "moe_topk", "n_routed_experts",
                     "expert_ffn_hidden_size", "ffn_hidden_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: '{name}' must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")
        if self.moe_topk > self.num_experts_total:
            raise ConfigError(
                f"config.json: 'moe_topk' ({self.moe_topk}) exceeds n_routed_experts + zero_expert_num "
                f"({self.num_experts_total})")

    @property
    def num_experts_total(self) -> int:
        """Router outputs: routed experts followed by zero-compute (identity) experts."""
        return self.n_routed_experts + self.zero_expert_num

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Per-token, per-attention KV cache width: the MLA latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_attention_layers(self) -> int:
        return 2 * self.num_layers

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: unsupported model_type {mt!r}; afd supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {act!r}; afd supports 'silu'")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json: unsupported rope_type {rope_type!r}; afd supports 'default'")
        head_dim = d.get("head_dim")
        if head_dim is not None and head_dim != d.get("qk_rope_head_dim"):
            # HF sizes the rotary table by head_dim; the two must agree for the model to be well formed.
            raise ConfigError(f"config.json: 'head_dim' ({head_dim}) must equal 'qk_rope_head_dim' "
                              f"({d.get('qk_rope_head_dim')})")
        nkv = d.get("num_key_value_heads")
        if nkv is not None and nkv != d.get("num_attention_heads"):
            raise ConfigError("config.json: MLA needs num_key_value_heads == num_attention_heads")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        kw = {}
        for f in fields(cls):
            if f.name in d:
                kw[f.name] = d[f.name]
        missing = [f.name for f in fields(cls) if f.name not in kw and f.default is MISSING]
        if missing:
            raise ConfigError(f"config.json: missing required key(s): {', '.join(missing)}")
        kw["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        kw["eos_token_ids"] = eos_ids
        kw["zero_expert_num"] = d.get("zero_expert_num") or 0
        kw["routed_scaling_factor"] = float(d.get("routed_scaling_factor", 1.0))
        kw["rms_norm_eps"] = float(d.get("rms_norm_eps", 1e-5))
        return cls(**kw)

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConfigError(f"model path {path!r} is not a directory")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"model path {path!r} has no config.json")
        try:
            with open(cfg_path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d)


@dataclass
class CacheConfig:
    """Paged KV cache layout."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 0
    """Blocks per attention layer; 0 sizes the cache from `memory_budget_bytes`."""
    memory_budget_bytes: int = 256 << 20
    """Bytes the KV cache may take when `num_blocks` is 0."""

    def __post_init__(self):
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 0 or self.memory_budget_bytes <= 0:
            raise ConfigError("num_blocks must be >= 0 and memory_budget_bytes positive")

    def resolve_num_blocks(self, model: ModelConfig, dtype_bytes: int) -> int:
        if self.num_blocks:
            return self.num_blocks
        per_block = model.num_attention_layers * self.block_size * model.latent_dim * dtype_bytes
        return max(1, self.memory_budget_bytes // per_block)
