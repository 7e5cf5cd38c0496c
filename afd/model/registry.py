"""Model families by config.json's `model_type`: the one place that knows which families exist.

A family is a package `afd.model.<family>` with four modules:
  config.py     a frozen dataclass with HF's defaults and `from_hf_dict` (torch-free), satisfying
                afd.model.config.ModelConfig (`moe_layers`, `kv_cache_shape`, ...);
  attention.py  `AttentionHalf(cfg)`: embed(ids, meta) -> (x, rope); pre_moe(i, x, rope, meta, kv) -> (h, m)
                with m the MoE input, or None on a dense layer; post_moe(i, h, m, rope, meta, kv) -> h, the
                work that needs no MoE output (the overlap window; a dense layer's MLP); logits(x).
                Decoder layer i ends as x = post_moe(...) + MoE(m);
  ffn.py        `FFNHalf(cfg, lo, hi, serves_zero)`: forward(backend, i, m) -> this node's share of layer
                i's MoE for routed experts [lo, hi); layer(i) -> a module with `router.classifier`
                (nn.Linear) and `experts` (afd.model.experts.Experts), which metrics and prefetch read;
  weights.py    `attention_weights` / `ffn_weights`: the checkpoint name map of each half.
Adding a family is a folder and a line in FAMILIES.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from afd.model.config import ConfigError, ModelConfig, read_config_json

FAMILIES = {
    "longcat_flash": ("afd.model.longcat_flash", "LongcatFlashConfig"),
    "qwen3_moe": ("afd.model.qwen3_moe", "Qwen3MoeConfig"),
    "deepseek_v3": ("afd.model.deepseek_v3", "DeepseekV3Config"),
}


def _family(model_type) -> tuple[str, str]:
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: unsupported model_type {model_type!r}; afd supports {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def config_from_hf(d: dict) -> ModelConfig:
    package, cls = _family(d.get("model_type"))
    return getattr(import_module(f"{package}.config"), cls).from_hf_dict(d)


def load_config(path: str) -> ModelConfig:
    """The config of the checkpoint directory `path`, by its family."""
    return config_from_hf(read_config_json(path))


def family_module(cfg: ModelConfig, part: str) -> ModuleType:
    """`attention`, `ffn` or `weights` of cfg's family (these import torch)."""
    return import_module(f"{_family(cfg.model_type)[0]}.{part}")
