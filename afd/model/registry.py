"""Model families by config.json's `model_type`: the one place that knows which families exist.

A family is a package `afd.model.<family>` with four modules:
  config.py     a frozen dataclass with HF's defaults and `from_hf_dict` (torch-free);
  attention.py  `AttentionHalf`: embed, pre_moe, post_moe, logits;
  ffn.py        `FFNHalf`: the MoE of each layer, for a range of routed experts;
  weights.py    `attention_weights` / `ffn_weights`: the checkpoint name map of each half.
Adding a family is a folder and a line in FAMILIES.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from afd.model.config import ConfigError, ModelConfig, read_config_json

FAMILIES = {
    "longcat_flash": ("afd.model.longcat_flash", "LongcatFlashConfig"),
}


def _family(model_type) -> tuple[str, str]:
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: unsupported model_type {model_type!r}; afd supports "
                          f"{', '.join(FAMILIES)}")
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
