"""Model families: config.json read with each family's HF defaults, and the registry's errors."""

from __future__ import annotations

import dataclasses

import pytest
from hf_deepseek import BASE as DEEPSEEK_BASE
from hf_qwen3 import BASE as QWEN3_BASE
from hf_reference import BASE

from afd.model.config import ConfigError, eos_ids
from afd.model.longcat_flash.config import LongcatFlashConfig
from afd.model.registry import FAMILIES, config_from_hf


def _hf_view(hf, ours) -> dict:
    """HF's value of every afd field, in afd's terms."""
    out = {}
    for f in dataclasses.fields(ours):
        if f.name == "rope_theta":
            out[f.name] = hf.rope_parameters["rope_theta"]
        elif f.name == "eos_token_ids":
            out[f.name] = eos_ids(hf.eos_token_id)
        elif f.name == "zero_expert_num":
            out[f.name] = hf.zero_expert_num or 0  # HF's MoE reads `zero_expert_num or 0`
        elif f.name == "head_dim" and hf.model_type == "qwen3_moe":  # Qwen3MoeAttention's fallback
            out[f.name] = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        elif f.name == "mlp_only_layers":
            out[f.name] = tuple(hf.mlp_only_layers)
        elif f.name.startswith("rope_") and not hasattr(hf, f.name):  # rope_type and YaRN's rope_<key>
            out[f.name] = hf.rope_parameters.get(f.name, hf.rope_parameters.get(f.name[5:]))
        else:
            out[f.name] = getattr(hf, f.name)
    return out


def _full_longcat() -> dict:
    from transformers import LongcatFlashConfig as HF

    return HF(**BASE).to_dict()


def test_longcat_defaults_are_hf_defaults():
    from transformers import LongcatFlashConfig as HF

    ours = config_from_hf({"model_type": "longcat_flash"})
    assert dataclasses.asdict(ours) == _hf_view(HF(), ours)


@pytest.mark.parametrize("key", sorted(set(_full_longcat()) - {"model_type"}))
def test_longcat_missing_key_takes_hf_default_or_is_named(key):
    """Each key of a saved config.json left out in turn: afd reads what transformers would build, or
    refuses naming the key. (Before the family configs, afd's own defaults for rope_theta,
    zero_expert_num and routed_scaling_factor differed from HF's.)"""
    from transformers import LongcatFlashConfig as HF

    d = {k: v for k, v in _full_longcat().items() if k != key}
    try:
        ours = config_from_hf(d)
    except ConfigError as e:
        assert f"'{key}'" in str(e)
        return
    assert dataclasses.asdict(ours) == _hf_view(HF(**{k: v for k, v in d.items() if k != "model_type"}), ours)


def _full_qwen3() -> dict:
    from transformers import Qwen3MoeConfig as HF

    return HF(**{**QWEN3_BASE, "mlp_only_layers": [1]}).to_dict()


def test_qwen3_moe_defaults_are_hf_defaults():
    from transformers import Qwen3MoeConfig as HF

    ours = config_from_hf({"model_type": "qwen3_moe"})
    assert dataclasses.asdict(ours) == _hf_view(HF(), ours)


@pytest.mark.parametrize("key", sorted(set(_full_qwen3()) - {"model_type"}))
def test_qwen3_moe_missing_key_takes_hf_default_or_is_named(key):
    """As for LongCat-Flash: a saved Qwen3MoeConfig with one key left out reads as transformers reads it."""
    from transformers import Qwen3MoeConfig as HF

    d = {k: v for k, v in _full_qwen3().items() if k != key}
    try:
        ours = config_from_hf(d)
    except ConfigError as e:
        assert f"'{key}'" in str(e)
        return
    assert dataclasses.asdict(ours) == _hf_view(HF(**{k: v for k, v in d.items() if k != "model_type"}), ours)


def _full_deepseek() -> dict:
    from transformers import DeepseekV3Config as HF

    return HF(**DEEPSEEK_BASE).to_dict()


def test_deepseek_v3_defaults_are_hf_defaults():
    from transformers import DeepseekV3Config as HF

    ours = config_from_hf({"model_type": "deepseek_v3"})
    assert dataclasses.asdict(ours) == _hf_view(HF(), ours)


@pytest.mark.parametrize("key", sorted(set(_full_deepseek()) - {"model_type"}))
def test_deepseek_v3_missing_key_takes_hf_default_or_is_named(key):
    """As for LongCat-Flash: a saved DeepseekV3Config with one key left out reads as transformers reads it."""
    from transformers import DeepseekV3Config as HF

    d = {k: v for k, v in _full_deepseek().items() if k != key}
    try:
        ours = config_from_hf(d)
    except ConfigError as e:
        assert f"'{key}'" in str(e)
        return
    assert dataclasses.asdict(ours) == _hf_view(HF(**{k: v for k, v in d.items() if k != "model_type"}), ours)


def test_hf_attribute_map_names_are_read():
    d = {k: v for k, v in _full_longcat().items() if k not in ("n_routed_experts", "moe_topk")}
    cfg = config_from_hf({**d, "num_local_experts": 9, "num_experts_per_tok": 4})
    assert (cfg.n_routed_experts, cfg.moe_topk) == (9, 4)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"head_dim": 5}, "'head_dim' (5) must equal 'qk_rope_head_dim' (4)"),
        ({"qk_head_dim": 99}, "'qk_head_dim' (99)"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"vocab_size": 0}, "'vocab_size' must be positive"),
        ({"rms_norm_eps": "small"}, "'rms_norm_eps' must be a number"),
        ({"moe_topk": 99}, "'moe_topk' (99) exceeds"),
    ],
)
def test_bad_configs_name_the_key(change, needle):
    with pytest.raises(ConfigError) as e:
        config_from_hf({**_full_longcat(), **change})
    assert needle in str(e.value)
    assert ", ".join(FAMILIES) in str(e.value) or "model_type" not in change


def test_family_config_is_torch_free():
    """`afd check-config` reads a config without importing torch."""
    import subprocess
    import sys

    code = (
        "import sys; from afd.model.registry import config_from_hf; "
        "config_from_hf({'model_type': 'longcat_flash'}); config_from_hf({'model_type': 'qwen3_moe'}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert LongcatFlashConfig.model_type in FAMILIES
