"""Qwen3-MoE through every afd path, against HF transformers on the same tiny checkpoints."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_helpers import cluster_yaml, post
from hf_qwen3 import BASE, TINY_CONFIGS, hf_greedy, make_qwen3_checkpoint
from hf_reference import PROMPTS, assert_colocated_matches_hf, lazy_refs
from serve_helpers import Served, free_port_run

import afd
from afd.model.config import ConfigError
from afd.model.registry import config_from_hf

NEW_TOKENS = 32
MULTI = "sparse_step"  # the config the multi-process paths run: dense and sparse layers, GQA, tied lm_head


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen3")
    return {name: make_qwen3_checkpoint(str(root / name), **kw) for name, kw in TINY_CONFIGS.items()}


@pytest.fixture(scope="module")
def refs(ckpts):
    return lazy_refs(hf_greedy, ckpts, NEW_TOKENS)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_colocated_greedy_tokens_and_logits_match_hf(ckpts, refs, name):
    assert_colocated_matches_hf(ckpts[name], refs(name), NEW_TOKENS)


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


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "A,F,overlap,micro_batches",
    [
        (1, 1, True, 1),
        pytest.param(2, 1, False, 1, marks=pytest.mark.slow),
        pytest.param(1, 2, True, 2, marks=pytest.mark.slow),
    ],
)
def test_afd_across_processes_equals_hf(ckpts, refs, A, F, overlap, micro_batches):
    """1A2F splits the experts [0, 3) + [3, 6) over two FFN nodes; m=2 ping-pongs two micro-batches."""
    llm = afd.LLM(
        ckpts[MULTI], attention_nodes=A, ffn_nodes=F, overlap=overlap, micro_batches=micro_batches, block_size=4
    )
    assert llm.generate_ids(PROMPTS, NEW_TOKENS) == [ids for ids, _ in refs(MULTI)]


@pytest.mark.multiprocess
def test_afd_serve_answers_concurrent_requests_with_hfs_tokens(ckpts, refs, tmp_path):
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    s = Served([ckpts[MULTI], "--port", str(port)], tmp_path / "serve.log", [url])
    try:
        s.wait_ready()

        def greedy(prompt: list[int]) -> list[int]:
            code, body = post(
                url,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True},
            )
            assert code == 200, body
            return body["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(greedy, PROMPTS))
    finally:
        assert s.stop() == 0
    assert got == [ids for ids, _ in refs(MULTI)]


def test_check_config_names_the_family_and_the_expert_split(ckpts, tmp_path):
    path = cluster_yaml(tmp_path, ckpts["gqa"], attention=1, ffn=2)
    r = subprocess.run(
        [sys.executable, "-m", "afd.cli", "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "family: qwen3_moe" in r.stdout.splitlines()
    assert "experts [0, 3)" in r.stdout and "experts [3, 6)" in r.stdout
