"""DeepSeek-V4 in its released FP8 layout: afd reads DeepSeek's names and `.scale` block scales
(ue8m0) through afd.model.deepseek_v4.weights.ReleasedReader, the experts into afd's quantized path as stored.

The oracle is HF transformers 5.24 on the same weights dequantized, saved in transformers' layout
(tests/v4_released.py): HF cannot read the tiny released checkpoint with edge blocks as the oracle itself (its
FP8 dequantization takes a tensor's block as its shape over its scale grid: tests/test_fp8_checkpoint.py's
docstring). With whole blocks it can, and it reads the fixture's layout (names, `.scale`, ue8m0) into the
very weights of the dequantized checkpoint: the fixture's layout is the one transformers converts from
(test_hf_reads_the_fixture_layout)."""

from __future__ import annotations

import os

import pytest
import torch
from hf_deepseek_v4 import V4_CONFIGS, hf_greedy, make_v4_checkpoint
from hf_reference import PROMPTS, max_rel_err
from v4_released import FP8, UE8M0, dequantized, released_quantization_config, rewrite, write_released

import afd
from afd.model.checkpoint import CheckpointError, SafetensorsReader
from afd.model.config import ConfigError
from afd.model.deepseek_v4.weights import ReleasedReader, checkpoint_reader, released_key
from afd.model.registry import config_from_hf

BLOCK = (8, 16)
"""(bn, bk): unequal, so that a swapped block shows; the tiny sizes (12-wide experts, 16-row projections)
leave edge blocks too."""
NEW_TOKENS = 24
# HF runs the dequantized weights afd's experts widen from the stored FP8 (bit-equal: one fp32 product of an
# exact e4m3 value and a power of two), so this is tests/test_deepseek_v4_engine.py's comparison of two fp32
# runs in different kernel orders (measured there <= 4e-6 of the largest logit), with its tolerance.
LOGITS_REL_TOL = 1e-4


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4fp8")
    src = make_v4_checkpoint(str(root / "src"), **V4_CONFIGS["all_types"])
    return write_released(src, str(root), BLOCK)


def _stored(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _reader(path: str):
    return checkpoint_reader(SafetensorsReader(path))


def test_released_key_names():
    assert released_key("model.embed_tokens.weight") == "embed.weight"
    assert released_key("model.hc_head.hc_fn") == "hc_head_fn"
    assert released_key("model.layers.3.attn.wq_a.weight") == "layers.3.attn.wq_a.weight"
    assert released_key("model.layers.3.attn.wq_a.weight_scale_inv") == "layers.3.attn.wq_a.scale"
    assert released_key("model.layers.0.ffn.experts.5.w2.weight_scale_inv") == "layers.0.ffn.experts.5.w2.scale"
    assert released_key("head.weight") == "head.weight" and released_key("mtp.0.e_proj.weight") == "mtp.0.e_proj.weight"


def test_the_layout_is_told_by_its_keys(released):
    rel, deq = released
    assert isinstance(_reader(rel), ReleasedReader)
    assert type(_reader(deq)) is SafetensorsReader  # transformers' layout: the reader as it is
    stored = _stored(rel)
    assert "embed.weight" in stored and "hc_head_fn" in stored and not any(k.startswith("model.") for k in stored)
    assert stored["layers.2.ffn.experts.3.w1.weight"].dtype == FP8
    assert stored["layers.2.ffn.experts.3.w1.scale"].dtype == UE8M0
    assert stored["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32  # shipped unquantized


def test_reader_gives_the_dequantized_values_and_the_stored_bytes(released):
    rel, deq = released
    reader, stored, want = _reader(rel), _stored(rel), _stored(deq)
    for name in [k for k in stored if stored[k].dtype == FP8]:
        hf_key = "model." + name
        shape = tuple(stored[name].shape)
        s = stored[name.removesuffix("weight") + "scale"]
        assert torch.equal(reader.get(hf_key, shape), dequantized(stored[name], s, BLOCK)), name
        assert torch.equal(reader.get(hf_key, shape), want[hf_key]), name
        q, scale = reader.get_fp8(hf_key, shape)
        assert torch.equal(q.view(torch.uint8), stored[name].view(torch.uint8)) and scale.dtype == torch.float32
    assert torch.equal(reader.get("model.embed_tokens.weight", (97, 32)), stored["embed.weight"])
    assert reader.get_fp8("model.layers.2.ffn.gate.weight", (8, 32)) is None


def test_greedy_tokens_and_logits_match_hf_on_the_dequantized_weights(released):
    """afd.LLM on the released layout, --quantization w8a16: the experts hold the stored FP8 bytes (widened in
    the GEMM), the attention half the dequantized values; HF's greedy tokens on the dequantized checkpoint.
    afd.model.checkpoint.open_reader reads it through the family's reader (Family.reader)."""
    rel, deq = released
    ref = hf_greedy(deq, PROMPTS, NEW_TOKENS)
    llm = afd.LLM(rel, dtype="float32", block_size=4, quantization="w8a16")
    assert llm.ffn.layer(2).experts.w13.dtype == FP8
    logits: list = []
    ours = llm.generate_ids(PROMPTS, NEW_TOKENS, logits_out=logits)
    for i, (ids, ref_logits) in enumerate(ref):
        assert ours[i] == ids, f"prompt {i}"
        assert max_rel_err(logits[i], ref_logits) <= LOGITS_REL_TOL, f"prompt {i}"


def _drop_scale(t: dict) -> None:
    del t["layers.1.attn.wq_a.scale"]


def _wrong_scale(t: dict) -> None:
    t["layers.2.ffn.experts.4.w2.scale"] = t["layers.2.ffn.experts.4.w2.scale"][:1]


@pytest.mark.parametrize(
    "edit,key,want",
    [
        (_drop_scale, ("model.layers.1.attn.wq_a.weight", (16, 32)), "'layers.1.attn.wq_a.weight' has no "),
        (_wrong_scale, ("model.layers.2.ffn.experts.4.w2.weight", (32, 12)), "'layers.2.ffn.experts.4.w2.scale' is"),
    ],
)
def test_a_broken_checkpoint_names_the_tensor(released, tmp_path, edit, key, want):
    bad = rewrite(released[0], str(tmp_path / "bad"), edit)
    with pytest.raises(CheckpointError, match=want):
        _reader(bad).get(*key)
    with pytest.raises(CheckpointError, match=want):
        _reader(bad).get_fp8(*key)


def test_fp4_experts_are_refused_by_the_config():
    q = {**released_quantization_config((128, 128)), "expert_dtype": "fp4"}
    for d in ({"quantization_config": q}, {"expert_dtype": "fp4"}):
        with pytest.raises(ConfigError, match="expert_dtype 'fp4' is not supported"):
            config_from_hf({"model_type": "deepseek_v4", **d})


def test_hf_reads_the_fixture_layout(released, tmp_path):
    """transformers' own conversion of DeepSeek's layout (conversion_mapping.py's deepseek_v4 renames, the FP8
    quantizer's `.scale` -> weight_scale_inv, ue8m0 scales), dequantized, gives every tensor of the
    dequantized checkpoint exactly: no key left unread or initialised at random. Blocks of 4 x 4 (whole at
    every size of the fixture) so that HF's dequantization reads them right."""
    from fp8_checkpoint import hf_dequantized_model
    from hf_deepseek_v4 import hf_model

    src = os.path.join(os.path.dirname(released[0]), "src")
    rel, deq = write_released(src, str(tmp_path), (4, 4))
    ours = hf_dequantized_model(rel).state_dict()
    want = hf_model(deq).state_dict()
    assert set(ours) == set(want)
    assert all(torch.equal(ours[k].float(), want[k].float()) for k in want)


@pytest.mark.parametrize("method", [None, "w8a8"])  # None: the checkpoint's FP8 blocks, the default
def test_quantized_schemes_leave_what_the_release_ships_in_16_bits(released, method):
    """fp8 and w8a8 quantize the attention side's linears but the compressors' and the indexer's weights_proj,
    which the FP8 release keeps in BF16, and wo_a, a grouped weight (AttentionHalf.unquantized); and run."""
    from torch import nn

    from afd.model.quant_layers import QuantLinear

    rel, _ = released
    llm = afd.LLM(rel, dtype="float32", block_size=4, quantization=method)
    assert len(llm.generate_ids(PROMPTS[:1], 4)[0]) == 4  # the factory quantizes the attention side at a first job
    layer = llm.attn.layers[1].attn  # a CSA layer: compressor and indexer
    assert isinstance(layer.wq_a, QuantLinear) and isinstance(layer.wo_b, QuantLinear)
    assert type(layer.wo_a) is nn.Linear
    assert type(layer.compressor.wkv) is nn.Linear and type(layer.compressor.wgate) is nn.Linear
    assert type(layer.indexer.weights_proj) is nn.Linear and type(layer.indexer.compressor.wkv) is nn.Linear
    assert isinstance(layer.indexer.wq_b, QuantLinear)  # stored FP8 in the release
