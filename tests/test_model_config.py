"""config.json: HF's attribute-map names, the errors that name a key, the registry's errors, and a
torch-free read. Every family's defaults (a missing key takes HF's) are tests/test_families.py."""

from __future__ import annotations

import pytest
from hf_reference import BASE

from afd.model.config import ConfigError
from afd.model.longcat_flash.config import LongcatFlashConfig
from afd.model.registry import FAMILIES, config_from_hf


def _full_longcat() -> dict:
    from transformers import LongcatFlashConfig as HF

    return HF(**BASE).to_dict()


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
