"""DeepSeek-V4's pieces against HF transformers 5.24: the config's defaults (each key of a saved config.json
dropped in turn), YaRN and legacy keys, the rope tables, the routers and mHC module by module. afd's engine on
DeepSeek-V4 against HF is tests/test_deepseek_v4_engine.py; its paged state's layout tests/test_state_kinds.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_deepseek_v4 import BASE, CSA, HCA, V4_CONFIGS

from afd.model.config import ConfigError, eos_ids
from afd.model.registry import config_from_hf

# ---- config.json: a missing key takes HF's default ----------------------------------------------------


def _hf_view(hf, ours) -> dict:
    """HF's value of every afd field, in afd's terms."""
    comp = hf.rope_parameters["compress"]
    out = {}
    for f in dataclasses.fields(ours):
        n = f.name
        if n == "eos_token_ids":
            out[n] = eos_ids(hf.eos_token_id)
        elif n in ("layer_types", "mlp_layer_types"):
            out[n] = tuple(getattr(hf, n))
        elif n in ("csa_rate", "hca_rate"):
            out[n] = hf.compress_rates[CSA if n == "csa_rate" else HCA]
        elif n == "rope_theta":
            out[n] = hf.rope_parameters["main"]["rope_theta"]
        elif n == "compress_rope_theta":
            out[n] = comp["rope_theta"]
        elif n == "rope_type":
            out[n] = comp["rope_type"]
        elif n.startswith("rope_"):
            out[n] = comp.get(n[5:])
        else:
            out[n] = getattr(hf, n)
    return out


def _hf_config(**kw):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**kw)


def test_defaults_are_hf_defaults():
    ours = config_from_hf({"model_type": "deepseek_v4"})
    assert dataclasses.asdict(ours) == _hf_view(_hf_config(), ours)
    assert ours.layer_types[:3] == (HCA, HCA, HCA) and ours.layer_types[3] == CSA  # HF's V4-Pro schedule


FULL = _hf_config(**BASE).to_dict()


@pytest.mark.parametrize("key", sorted(set(FULL) - {"model_type"}))
def test_missing_key_takes_hf_default_or_is_named(key):
    """Each key of a saved config.json left out in turn: afd reads what transformers would build, or refuses
    naming the key."""
    d = {k: v for k, v in FULL.items() if k != key}
    try:
        ours = config_from_hf(d)
    except ConfigError as e:
        assert f"'{key}'" in str(e)
        return
    hf = _hf_config(**{k: v for k, v in d.items() if k != "model_type"})
    assert dataclasses.asdict(ours) == _hf_view(hf, ours)


def test_yarn_and_legacy_keys_are_read():
    """DeepSeek's flat rope_scaling (YaRN beside the thetas) and the legacy per-layer compress_ratios."""
    d = {
        **BASE,
        "model_type": "deepseek_v4",
        "layer_types": None,
        "compress_rates": None,
        "compress_ratios": [0, 4, 128, 4],
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32},
    }
    cfg = config_from_hf(d)
    assert cfg.layer_types == ("sliding_attention", CSA, HCA, CSA)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_attention_factor) == ("yarn", 16, 1.0)
    for change, needle in [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            config_from_hf({**d, **change})


def test_compressed_rope_tables_are_hfs():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from afd.model.deepseek_v4.layers import rotaries

    over = {k: v for k, v in V4_CONFIGS["yarn"].items() if k != "seed"}
    hf = DeepseekV4RotaryEmbedding(_hf_config(**{**BASE, **over}))
    main, comp = rotaries(config_from_hf(_hf_config(**{**BASE, **over}).to_dict()))
    assert torch.equal(main.inv_freq, hf.main_inv_freq) and torch.equal(comp.inv_freq, hf.compress_inv_freq)
    assert not torch.equal(comp.inv_freq, main.inv_freq)


# ---- pieces against HF's modules ------------------------------------------------------------------------


@pytest.mark.parametrize("hashed", [True, False])
def test_router_picks_hfs_experts_with_hfs_weights(hashed):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

    from afd.model.deepseek_v4.ffn import Router

    hf_cfg = _hf_config(**BASE)
    torch.manual_seed(3)
    hf = (DeepseekV4HashRouter if hashed else DeepseekV4TopKRouter)(hf_cfg)
    ours = Router(config_from_hf(hf_cfg.to_dict()), hashed)
    with torch.no_grad():
        hf.weight.normal_(0, 0.3)
        ours.classifier.weight.copy_(hf.weight)
        if hashed:
            hf.tid2eid.copy_(torch.rand(hf_cfg.vocab_size, hf_cfg.n_routed_experts).argsort(-1)[:, :2])
            ours.tid2eid.copy_(hf.tid2eid)
        else:
            hf.e_score_correction_bias.normal_(0, 0.3)
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x, tokens = torch.randn(256, hf_cfg.hidden_size), torch.randint(0, hf_cfg.vocab_size, (256,))
    _, hf_w, hf_ids = hf(x, tokens) if hashed else hf(x)
    w, ids = ours(x, None, tokens)
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=0, atol=0)
    if hashed:
        with pytest.raises(RuntimeError, match="token id"):
            ours(x)


def test_hyper_connection_is_hfs():
    """Collapse weights, expand weights and the Sinkhorn-projected mixing, from the same streams."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from afd.model.deepseek_v4.layers import HyperConnection

    hf_cfg = _hf_config(**BASE)
    torch.manual_seed(4)
    hf = DeepseekV4HyperConnection(hf_cfg)
    ours = HyperConnection(config_from_hf(hf_cfg.to_dict()))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.5 if name == "scale" else 0.0, 0.5)
            dict(ours.named_parameters())[name].copy_(p)
    streams = torch.randn(7, hf_cfg.hc_mult, hf_cfg.hidden_size)
    hf_post, hf_comb, hf_collapsed = hf(streams.unsqueeze(0))
    post, comb, collapsed = ours(streams)
    torch.testing.assert_close(post, hf_post[0], rtol=0, atol=0)
    torch.testing.assert_close(comb, hf_comb[0], rtol=0, atol=0)
    torch.testing.assert_close(collapsed, hf_collapsed[0], rtol=0, atol=0)
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(7, hf_cfg.hc_mult), rtol=0, atol=1e-4)  # doubly
    torch.testing.assert_close(comb.sum(dim=-1), torch.ones(7, hf_cfg.hc_mult), rtol=0, atol=1e-4)  # stochastic
