"""What only DeepSeek-V3 does, against HF transformers: grouped sigmoid routing, YaRN, dense-first
layers, shared experts in the overlap window, MTP layers the decoder skips. The paths every family
shares (colocated, across processes, `afd serve`, config defaults, bf16) are tests/test_families.py."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_deepseek import BASE
from hf_reference import PROMPTS

import afd
from afd.model.config import ConfigError
from afd.model.registry import config_from_hf

MULTI = "grouped"  # one dense layer first, then MoE layers with grouped routing


@pytest.mark.parametrize(
    "over",
    [
        dict(seed=0),
        dict(n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=5, norm_topk_prob=False, seed=1),
    ],
)
def test_router_picks_hfs_experts_with_hfs_weights(over):
    """Many tokens through HF's DeepseekV3TopkRouter and afd's, with a correction bias large enough that
    both it and the group mask change which experts win."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from afd.model.deepseek_v3.ffn import Router

    over = dict(over)
    seed = over.pop("seed")
    hf_cfg = DeepseekV3Config(**{**BASE, **over})
    torch.manual_seed(seed)
    hf = DeepseekV3TopkRouter(hf_cfg)
    with torch.no_grad():
        hf.weight.normal_(0, 0.3)
        hf.e_score_correction_bias.normal_(0, 0.2)
    ours = Router(config_from_hf(hf_cfg.to_dict()))
    ours.classifier.weight.data.copy_(hf.weight)
    ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(512, hf_cfg.hidden_size)
    _, hf_w, hf_ids = hf(x)
    w, ids = ours(x)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=0, atol=0)
    plain = torch.sigmoid(x @ hf.weight.t()).topk(hf_cfg.num_experts_per_tok, dim=-1)[1].sort(dim=-1)[0]
    assert (plain != ids.sort(dim=-1)[0]).any(dim=-1).float().mean() > 0.3  # bias and groups matter


def test_yarn_rope_and_softmax_scale_are_hfs(families):
    from transformers import DeepseekV3ForCausalLM

    path = families.path("deepseek_v3", "yarn")
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).model
    attn = afd.LLM(path).attn
    assert torch.equal(attn.rotary.inv_freq, hf.rotary_emb.inv_freq)
    assert attn.rotary.attention_factor == hf.rotary_emb.attention_scaling != 1.0
    assert attn.layers[0].self_attn.scale == hf.layers[0].self_attn.scaling != attn.cfg.qk_head_dim**-0.5


def test_hub_style_config_keys_are_read():
    """DeepSeek-V3's published config.json: rope_scaling with `type`, rope_theta beside it, and keys HF
    ignores that afd checks hold the one value HF's model computes."""
    hub = {
        **BASE,
        "model_type": "deepseek_v3",
        "rope_theta": 50.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 8,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }
    cfg = config_from_hf(hub)
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor, cfg.rope_beta_fast) == ("yarn", 50.0, 4.0, 8)
    assert cfg.moe_layers == (1, 2) and cfg.kv_cache_shape(5, 4) == (3, 5, 4, 8 + 4)
    for change, needle in [
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"num_key_value_heads": 1}, "'num_key_value_heads'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            config_from_hf({**hub, **change})


def test_dense_layers_keep_m_and_moe_layers_send_it(families):
    """pre_moe hands m to the exchange only on MoE layers; post_moe adds the shared experts (MoE) or the
    whole dense MLP, so that x = post_moe + routed(m) is HF's decoder layer."""
    from afd.model.attention_metadata import AttentionMetadata

    llm = afd.LLM(families.path("deepseek_v3", MULTI))
    attn, cfg = llm.attn, llm.cfg
    meta = AttentionMetadata.build([0], [5], [[0, 1]], 4, torch.device("cpu"))
    x, rope = attn.embed(torch.tensor([3, 1, 4, 1, 5]), meta)
    kv = torch.zeros(cfg.kv_cache_shape(2, 4))
    for i in range(cfg.num_layers):
        h, m = attn.pre_moe(i, x, rope, meta, kv[i])
        layer = attn.layers[i]
        want_m = layer.post_attention_layernorm(h)
        if i in cfg.moe_layers:
            assert torch.equal(m, want_m)
            assert torch.equal(attn.post_moe(i, h, m, rope, meta, kv[i]), h + layer.mlp.shared_experts(m))
            x = attn.post_moe(i, h, m, rope, meta, kv[i]) + llm.ffn(llm.backend, i, m)
        else:
            assert m is None
            x = attn.post_moe(i, h, m, rope, meta, kv[i])
            assert torch.equal(x, h + layer.mlp(want_m))
    assert cfg.moe_layers == (1, 2) and [type(layer.mlp).__name__ for layer in attn.layers] == [
        "DenseMLP",
        "SharedExperts",
        "SharedExperts",
    ]


def test_shared_experts_run_while_the_routed_experts_are_out(families):
    """With the exchange recorded: each MoE layer's shared experts run after its m was submitted and
    before its routed output is awaited, for every micro-batch; the logits equal the synchronous run."""
    from afd.dataplane.exchange import LocalMoE
    from afd.engine.kv_cache import KVCache
    from afd.engine.runner import ModelRunner, StepSeq

    llm = afd.LLM(families.path("deepseek_v3", MULTI))
    events: list[tuple] = []

    class Recorded(LocalMoE):
        def submit(self, layer, micro_batch, m):
            events.append(("submit", layer, micro_batch))
            y = self.ffn(self.backend, layer, m)

            class Handle:
                def wait(self):
                    events.append(("wait", layer, micro_batch))
                    return y

            return Handle()

    def run(moe):
        kv = KVCache(llm.cfg, 32, 4, torch.float32, torch.device("cpu"))
        seqs = []
        for p in PROMPTS:
            table: list[int] = []
            kv.grow(table, len(p))
            seqs.append(StepSeq(p, 0, table))
        return ModelRunner(llm.attn, moe, kv, torch.device("cpu"), micro_batches=2).execute(seqs).logits

    layer_of = {id(layer.mlp.shared_experts): i for i, layer in enumerate(llm.attn.layers) if i in llm.cfg.moe_layers}
    hooks = [
        llm.attn.layers[i].mlp.shared_experts.register_forward_hook(
            lambda mod, inp, out: events.append(("shared", layer_of[id(mod)]))
        )
        for i in llm.cfg.moe_layers
    ]
    try:
        logits = run(Recorded(llm.ffn, llm.backend))
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(logits, run(LocalMoE(llm.ffn, llm.backend)))
    assert {e[1] for e in events if e[0] == "submit"} == set(llm.cfg.moe_layers)  # dense layers send nothing
    for layer in llm.cfg.moe_layers:
        for mb in (0, 1):
            at = {kind: events.index((kind, layer, mb)) for kind in ("submit", "wait")}
            shared = [k for k, e in enumerate(events) if e == ("shared", layer)]
            assert any(at["submit"] < k < at["wait"] for k in shared), events


def test_mtp_layers_in_the_checkpoint_are_skipped(families, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "with_mtp"
    shutil.copytree(families.path("deepseek_v3", MULTI), path)
    tensors = load_file(path / "model.safetensors")
    L = BASE["num_hidden_layers"]
    tensors.update(
        {
            k.replace("model.layers.2.", f"model.layers.{L}."): torch.full_like(v, float("nan"))
            for k, v in tensors.items()
            if k.startswith("model.layers.2.")
        }
    )
    tensors[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(BASE["hidden_size"], 2 * BASE["hidden_size"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="afd.model"):
        llm = afd.LLM(str(path))
    assert len([r for r in caplog.records if "multi-token-prediction" in r.message]) == 1
    assert llm.generate_ids(PROMPTS, 8) == families.ref_ids("deepseek_v3", MULTI, 8)
