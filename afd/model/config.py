"""What the engine, the data plane and the nodes ask of any model family's config, and config.json.

Each family (afd/model/<family>/config.py) is a frozen dataclass whose fields carry HF's defaults for
that family: a key missing from config.json takes the value transformers would give it, never one of
afd's own. `from_hf_dict` below does the reading; the family adds its own checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from afd.model.state_spec import StateKind


class ConfigError(ValueError):
    """A configuration value is missing, has the wrong type, or is inconsistent."""


DTYPES = ("float32", "bfloat16", "float16")
AUTO_DTYPE = "auto"
"""model.dtype's default, as vLLM's --dtype: the checkpoint's own (config.json's dtype / torch_dtype)."""


def parse_dtype(name: str):
    """The torch dtype of a config's dtype name (`auto` is resolved against the checkpoint first:
    afd.cluster.topology.with_model_defaults)."""
    import torch

    if name == AUTO_DTYPE:
        raise ValueError("model.dtype auto names no dtype until read from the checkpoint's config.json")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def checkpoint_dtype(d: dict) -> str:
    """config.json's dtype (transformers 5 writes `dtype`, earlier ones `torch_dtype`); float32 when it names
    none, as transformers loads such a checkpoint. A released FP8 checkpoint names its activations' bfloat16."""
    name = d.get("dtype", d.get("torch_dtype")) or "float32"
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    if name not in DTYPES:
        raise ConfigError(
            f"config.json's dtype {name!r} is not one afd serves in ({', '.join(DTYPES)}): give model.dtype (--dtype)"
        )
    return name


class ModelConfig(Protocol):
    """The family-independent part of a model config. Read-only (properties), so that the families'
    frozen dataclasses satisfy it."""

    model_type: ClassVar[str]

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int:
        """Decoder layers (the KV cache and the attention half hold all of them)."""
        ...

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MoE crosses to the FFN nodes, ascending (one exchange per such layer and
        micro-batch); the others are dense and run on the attention side alone."""
        ...

    @property
    def n_routed_experts(self) -> int: ...
    @property
    def expert_intermediate_size(self) -> int:
        """A routed expert's intermediate size (LongCat-Flash's expert_ffn_hidden_size, the others'
        moe_intermediate_size)."""
        ...

    @property
    def experts_per_token(self) -> int:
        """K: the experts the router picks per token (identity experts included)."""
        ...

    @property
    def identity_experts(self) -> int:
        """Zero-computation experts the router may pick besides the routed ones (LongCat-Flash's): their
        picks return the token as it is and never leave the attention side."""
        ...

    @property
    def expert_groups(self) -> tuple[int, int]:
        """(groups, groups kept per token) of a group-limited router (DeepSeek-V3's n_group, topk_group);
        (1, 1) for a router without groups."""
        ...

    @property
    def routes_by_token_ids(self) -> bool:
        """Whether a router reads the token ids (DeepSeek-V4's hash layers): it then runs where they are, on
        the attention side (layout.routing attention; afd.config.loader.check_routing)."""
        ...

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def bos_token_id(self) -> int | None: ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The paged KV cache: [num_cache_layers, ...] with block and slot dimensions inside."""
        ...

    def state_kinds(self) -> tuple[StateKind, ...]:
        """The kinds of per-sequence state the family keeps (afd.model.state_spec): the first per token; one
        full-history kind is kv_cache_shape's layout, as every family had before kinds."""
        ...


class HFNames:
    """ModelConfig's layer, router and expert properties read off transformers' names (num_hidden_layers,
    num_experts_per_tok, moe_intermediate_size), with no identity experts and no expert groups: a family's
    config dataclass inherits them and overrides what its router differs in."""

    num_hidden_layers: int
    num_experts_per_tok: int
    moe_intermediate_size: int

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def experts_per_token(self) -> int:
        return self.num_experts_per_tok

    @property
    def identity_experts(self) -> int:
        return 0

    @property
    def expert_groups(self) -> tuple[int, int]:
        return (1, 1)

    @property
    def routes_by_token_ids(self) -> bool:
        return False


def read_config_json(path: str) -> dict:
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
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    return d


def eos_ids(value: Any) -> tuple[int, ...]:
    """HF's eos_token_id: an int, a list of ints, or null."""
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def rope_theta(d: dict, default: float) -> float:
    """transformers 5 keeps rope_theta in rope_parameters; older configs beside it or in rope_scaling."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return float(rope.get("rope_theta", d.get("rope_theta", default)))


def rope_type(d: dict) -> str:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default"))


def from_hf_dict(cls, d: dict, aliases: dict[str, str] | None = None, **derived):
    """An instance of the family config `cls` from a config.json dict: each field from the key of its
    name (or an alias HF's attribute_map allows), else its default, which is HF's. `derived` gives
    fields computed by the family (rope_theta, eos_token_ids, ...). A field without a default is a
    required key."""
    aliases = aliases or {}
    kw = dict(derived)
    missing = []
    for f in fields(cls):
        if f.name in kw:
            continue
        key = f.name if f.name in d else next((a for a, t in aliases.items() if t == f.name and a in d), None)
        if key is not None and d[key] is not None:
            kw[f.name] = d[key]
        elif f.default is MISSING:
            missing.append(f.name)
    if missing:
        raise ConfigError(f"config.json: missing required key(s): {', '.join(missing)}")
    return cls(**kw)


def check_types(cfg, positive: tuple[str, ...]) -> None:
    """Integer fields are non-negative ints; `positive` ones above zero; floats are numbers."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"config.json: '{f.name}' must be a non-negative integer, got {v!r}")
        if f.type == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise ConfigError(f"config.json: '{f.name}' must be a number, got {v!r}")
        if f.type == "bool" and not isinstance(v, bool):
            raise ConfigError(f"config.json: '{f.name}' must be true or false, got {v!r}")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"config.json: '{name}' must be positive, got {getattr(cfg, name)}")
