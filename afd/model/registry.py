"""Model families by config.json's `model_type`: the one place that knows which families exist.

A family is a package `afd.model.<model_type>` whose parts a `Family` record names:
  config     a frozen dataclass with HF's defaults and `from_hf_dict` (torch-free), satisfying
             afd.model.config.ModelConfig (`moe_layers`, `kv_cache_shape`, ...);
  attention  its afd.model.halves.AttentionHalf;
  ffn        its afd.model.halves.FFNHalf;
  weights    the checkpoint name map: `attention_weights` / `ffn_weights` (and `mtp_weights` with an MTP
             module), each yielding afd.model.checkpoint.Weight for a half's tensors;
  mtp        its multi-token-prediction module (`build`, `check`, `moe_layers`; afd.model.mtp), if any.
The contract the halves keep is afd/model/halves.py. Adding a family is a folder and a line in FAMILIES.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING, Any

from afd.model.config import ConfigError, ModelConfig, read_config_json

if TYPE_CHECKING:
    from afd.model import halves


def _attr(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(import_module(module), name)


@dataclass(frozen=True)
class Family:
    """One family's parts, as "module:Class" / module names: imported on first use, because the halves
    import torch and `afd check-config` reads a config without it."""

    model_type: str
    config: str
    attention: str
    ffn: str
    weights: str
    mtp: str | None = None
    reader: str | None = None
    """"module:function" taking the checkpoint's SafetensorsReader and returning the reader the loader uses,
    for a family whose released checkpoints name tensors otherwise than transformers saves them (DeepSeek-V4's
    own layout); None: the reader as is."""

    @classmethod
    def in_package(cls, model_type: str, config_class: str, mtp: bool) -> Family:
        """The usual layout: afd.model.<model_type>.{config,attention,ffn,weights[,mtp]}."""
        p = f"afd.model.{model_type}"
        return cls(
            model_type,
            f"{p}.config:{config_class}",
            f"{p}.attention:AttentionHalf",
            f"{p}.ffn:FFNHalf",
            f"{p}.weights",
            f"{p}.mtp" if mtp else None,
        )

    @property
    def config_class(self) -> Any:
        """The config dataclass (`from_hf_dict(d)` reads config.json's dict)."""
        return _attr(self.config)

    @property
    def attention_half(self) -> type[halves.AttentionHalf]:
        cls: type[halves.AttentionHalf] = _attr(self.attention)
        return cls

    @property
    def ffn_half(self) -> type[halves.FFNHalf]:
        cls: type[halves.FFNHalf] = _attr(self.ffn)
        return cls

    @property
    def name_map(self) -> ModuleType:
        return import_module(self.weights)

    @property
    def mtp_module(self) -> ModuleType | None:
        return None if self.mtp is None else import_module(self.mtp)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family.in_package("longcat_flash", "LongcatFlashConfig", mtp=True),
        Family.in_package("qwen3_moe", "Qwen3MoeConfig", mtp=False),
        Family.in_package("deepseek_v3", "DeepseekV3Config", mtp=True),
        dataclasses.replace(
            Family.in_package("deepseek_v4", "DeepseekV4Config", mtp=True),
            reader="afd.model.deepseek_v4.weights:checkpoint_reader",
        ),
    )
}


def family(model_type: Any) -> Family:
    """The family of a config.json `model_type` (a config's `cfg.model_type`); ConfigError for one afd
    does not support."""
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: unsupported model_type {model_type!r}; afd supports {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def checkpoint_quant(d: dict):
    """config.json's quantization_config (afd.quant.scheme.CheckpointQuant), checked; None if absent."""
    from afd.quant.scheme import CheckpointQuant, QuantConfigError

    try:
        return CheckpointQuant.from_config_json(d)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def config_from_hf(d: dict) -> ModelConfig:
    cfg: ModelConfig = family(d.get("model_type")).config_class.from_hf_dict(d)
    checkpoint_quant(d)  # a quantization_config afd cannot read is refused with the model's config
    return cfg


def checkpoint_reader(path: str, reader):
    """The reader the loader reads the checkpoint at `path` through: its family's (Family.reader) or `reader`."""
    fam = family(read_config_json(path).get("model_type"))
    return reader if fam.reader is None else _attr(fam.reader)(reader)


def load_config(path: str) -> ModelConfig:
    """The config of the checkpoint directory `path`, by its family."""
    return config_from_hf(read_config_json(path))


def quant_spec(path: str, method: str | None):
    """The scheme (afd.quant.scheme.QuantSpec) the checkpoint at `path` serves with under `--quantization
    method` (model.quantization): its quantization_config's FP8 by default; None: unquantized."""
    from afd.quant.scheme import QuantConfigError, resolve

    try:
        return resolve(method, checkpoint_quant(read_config_json(path)))
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None
