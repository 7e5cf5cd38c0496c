"""What only Qwen3-MoE does, against HF transformers: sparse and dense (mlp_only_layers,
decoder_sparse_step) layers, its router, the settings it refuses. The paths every family shares
(colocated, across processes, `afd serve`, config defaults, bf16) are tests/test_families.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from cluster_helpers import cluster_yaml
from hf_qwen3 import BASE

from afd.model.config import ConfigError
from afd.model.registry import config_from_hf


@pytest.mark.parametrize(
    "over",
    [dict(mlp_only_layers=[0, 3]), dict(decoder_sparse_step=3), dict(decoder_sparse_step=2, mlp_only_layers=[1])],
)
def test_moe_layers_are_hfs_sparse_blocks(over):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = Qwen3MoeConfig(**{**BASE, "num_hidden_layers": 6, **over})
    model = Qwen3MoeForCausalLM(hf)
    sparse = tuple(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock))
    assert config_from_hf(hf.to_dict()).moe_layers == sparse


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_picks_hfs_experts_with_hfs_weights(norm_topk_prob, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from afd.model.qwen3_moe.ffn import Router

    hf_cfg = Qwen3MoeConfig(**{**BASE, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": norm_topk_prob})
    torch.manual_seed(0)
    hf = Qwen3MoeTopKRouter(hf_cfg)
    hf.weight.data.normal_(0.0, 0.3)
    ours = Router(config_from_hf(hf_cfg.to_dict()))
    ours.classifier.weight.data.copy_(hf.weight.data)
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = torch.randn(500, BASE["hidden_size"], dtype=dtype)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    assert w.dtype == ref_w.dtype == dtype
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "'use_sliding_window'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "unsupported rope_type 'yarn'"),
        ({"num_key_value_heads": 3}, "'num_key_value_heads' (3)"),
        ({"head_dim": 7}, "'head_dim' must be even"),
        ({"num_experts_per_tok": 9}, "'num_experts_per_tok' (9) exceeds"),
        ({"mlp_only_layers": "1"}, "'mlp_only_layers'"),
    ],
)
def test_unsupported_settings_are_refused_naming_the_key(change, needle):
    from transformers import Qwen3MoeConfig

    with pytest.raises(ConfigError) as e:
        config_from_hf({**Qwen3MoeConfig(**BASE).to_dict(), **change})
    assert needle in str(e.value)


def test_check_config_names_the_family_and_the_expert_split(families, tmp_path):
    path = cluster_yaml(tmp_path, families.path("qwen3_moe", "gqa"), attention=1, ffn=2)
    r = subprocess.run(
        [sys.executable, "-m", "afd", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "family: qwen3_moe" in r.stdout.splitlines()
    assert "experts 0-2" in r.stdout and "experts 3-5" in r.stdout
