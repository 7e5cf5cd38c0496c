"""DeepSeek-V4's MTP module (afd.model.deepseek_v4.mtp) from a released-layout FP8 checkpoint's `mtp.0.*`.

transformers drops `mtp.*`, so HF is no oracle. What holds without one: every tensor of the module loads from
the checkpoint's names (and no other); its block, given decoder layer 0's weights (a sliding-window layer, as
the MTP block is), computes exactly what afd's decoder layer 0 computes on the same streams, prefill and
decode; fuse and head are DeepSeek's formulas; and speculative decoding with it keeps the greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_deepseek_v4 import V4_CONFIGS, make_v4_checkpoint
from hf_reference import PROMPTS
from v4_released import write_released

import afd
from afd.model.attention_metadata import AttentionMetadata
from afd.model.checkpoint import SafetensorsReader, _build, build_attention_half
from afd.model.deepseek_v4 import mtp as v4_mtp
from afd.model.deepseek_v4 import weights
from afd.model.meta import on_meta
from afd.model.registry import load_config

BLOCK = (8, 16)
SWA_LAYER, LEARNED_LAYER = 0, 2  # all_types: layer 0 sliding-window, layer 2 a learned ("moe") router


def add_mtp(src: str, seed: int = 7) -> None:
    """Writes `mtp.0.*` into the transformers checkpoint at `src` (before it is rewritten in the released
    layout): the block from decoder layer 0 (attention, norms, mHC, shared expert), the router and experts
    from layer 2, its own e_proj / h_proj (random), norms and hc_head (the main model's)."""
    from safetensors.torch import load_file, save_file

    f = os.path.join(src, "model.safetensors")
    t = load_file(f)
    g = torch.Generator().manual_seed(seed)
    out = dict(t)
    for k, v in t.items():
        for layer, parts in (
            (SWA_LAYER, ("attn.", "attn_norm", "ffn_norm", "hc_", "ffn.shared")),
            (LEARNED_LAYER, ("ffn.gate.", "ffn.experts.")),
        ):
            pre = f"model.layers.{layer}."
            if k.startswith(pre) and k[len(pre) :].startswith(parts):
                out["mtp.0." + k[len(pre) :]] = v.clone()
        if k.startswith("model.hc_head.hc_"):
            out["mtp.0.hc_head_" + k.removeprefix("model.hc_head.hc_")] = v.clone()
    D = t["model.norm.weight"].shape[0]
    for name in ("e_proj", "h_proj"):
        out[f"mtp.0.{name}.weight"] = torch.randn(D, D, generator=g) * 0.2
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    save_file(out, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4mtp")
    src = make_v4_checkpoint(str(root / "src"), **V4_CONFIGS["all_types"])
    add_mtp(src)
    rel, _ = write_released(src, str(root), BLOCK)
    return rel


def _mtp(path: str):
    cfg = load_config(path)
    reader = weights.checkpoint_reader(SafetensorsReader(path))
    with on_meta():
        module = v4_mtp.build(cfg)
    return cfg, reader, _build(module, weights.mtp_weights, reader, "mtp", torch.float32, torch.device("cpu"))


def test_every_mtp_tensor_loads_from_the_released_names(ckpt):
    from safetensors.torch import load_file

    _, reader, mtp = _mtp(ckpt)
    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    want = {k for k in stored if k.startswith("mtp.0.") and not k.startswith(("mtp.0.ffn.gate.", "mtp.0.ffn.experts."))}
    assert set(reader.keys_read) == want  # FP8 ones with their .scale; the routed side is the FFN half's
    assert stored["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(mtp.block.attn.wq_a.weight, reader.get("model.layers.0.attn.wq_a.weight", (16, 32)))


def test_the_block_is_a_sliding_window_decoder_layer(ckpt):
    """Given layer 0's weights, the block's pre_moe, post_moe and combine equal afd's decoder layer 0 on the
    same streams, bit for bit: 10 tokens prefilled (past the window of 8), then one decoded from the cache."""
    cfg, reader, mtp = _mtp(ckpt)
    attn = build_attention_half(cfg, reader, torch.float32, torch.device("cpu"))
    assert mtp.block.attn.rate == 0 and v4_mtp.moe_layers(cfg) == (cfg.num_hidden_layers,)
    bs, blocks, table = 4, 8, [3, 0, 5, 1]
    kv_main = torch.zeros(cfg.kv_cache_shape(blocks, bs)[1:])
    kv_mtp = torch.zeros(mtp.kv_cache_shape(blocks, bs))
    g = torch.Generator().manual_seed(3)
    for start, n in ((0, 10), (10, 1)):
        meta = AttentionMetadata.build([start], [n], [table], bs, torch.device("cpu"))
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        x, rope = attn.embed(ids, meta)
        x = x + 0.3 * torch.randn(x.shape, generator=g)  # streams that differ
        y = torch.randn(n, cfg.hidden_size, generator=g)  # a routed output
        h0, m0 = attn.pre_moe(SWA_LAYER, x, rope, meta, kv_main)
        h1, m1 = mtp.block.pre_moe(x, rope, meta, kv_mtp)
        assert torch.equal(m0, m1) and torch.equal(h0, h1)
        h0 = attn.post_moe(SWA_LAYER, h0, m0, rope, meta, kv_main)
        h1 = mtp.block.post_moe(h1, m1, rope, meta, kv_mtp)
        assert torch.equal(attn.combine(SWA_LAYER, h0, y), mtp.block.combine(h1, y))


def test_fuse_and_head_are_deepseeks_formulas(ckpt):
    cfg, _, mtp = _mtp(ckpt)
    g = torch.Generator().manual_seed(4)
    T, N, D = 5, cfg.hc_mult, cfg.hidden_size
    e, streams = torch.randn(T, D, generator=g), torch.randn(T, N, D, generator=g)
    want = mtp.e_proj(mtp.enorm(e))[:, None] + mtp.h_proj(mtp.hnorm(streams))
    assert torch.equal(mtp.fuse(e, streams), want)
    assert torch.equal(mtp.fuse(e[:, None].expand(T, N, D), streams), want)  # the embedded streams, all equal
    assert torch.equal(mtp.head(want), mtp.norm(mtp.hc_head(want)))


def _mimic(path: str, damp: float, noise: float) -> None:
    """The main model's attention and expert outputs (wo_b, w2) scaled by `damp`, so that its next token
    depends mostly on the last one; the MTP module's by `noise`, with e_proj = I + noise and h_proj = noise
    (random): its draft is then mostly lm_head(norm(embed(t + 1))), the main model's prediction after t + 1
    alone, with every path of the module still in play (tests/hf_mtp.py's scheme for V3)."""
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    g = torch.Generator().manual_seed(1)
    for k in [k for k in t if k.endswith(("attn.wo_b.weight", "w2.weight"))]:
        t[k] = t[k] * (damp if k.startswith("model.") else noise)
    D = t["model.norm.weight"].shape[0]
    t["mtp.0.e_proj.weight"] = torch.eye(D) + noise * torch.randn(D, D, generator=g)
    t["mtp.0.h_proj.weight"] = noise * torch.randn(D, D, generator=g)
    save_file(t, f, metadata={"format": "pt"})


def test_speculative_decoding_keeps_the_greedy_tokens(tmp_path):
    """With MTP (N = 1, 2) the greedy tokens are those without it, and the mimicking module's drafts are
    accepted often but not always (measured: N = 1 accepted 48 of 73 drafts, N = 2 63 of 116)."""
    src = make_v4_checkpoint(str(tmp_path / "src"), **V4_CONFIGS["all_types"])
    add_mtp(src)
    _mimic(src, damp=0.02, noise=0.01)
    off = afd.LLM(src, dtype="float32", block_size=4).generate_ids(PROMPTS, 32)
    for n in (1, 2):
        llm = afd.LLM(src, dtype="float32", block_size=4, speculative_tokens=n)
        assert llm.generate_ids(PROMPTS, 32) == off, f"N={n}"
        got = llm.spec_decode
        assert 0.3 < got["num_accepted_tokens"] / got["num_draft_tokens"] < 0.95, got
