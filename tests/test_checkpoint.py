"""Checkpoint loading: sharded layouts, each role reading only its own tensors, clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_reference import PROMPTS, make_hf_checkpoint

import afd
from afd.model.checkpoint import (
    CheckpointError,
    DummyReader,
    SafetensorsReader,
    build_attention_half,
    build_ffn_half,
)
from afd.model.config import ConfigError
from afd.model.registry import load_config

CPU = torch.device("cpu")


def _is_ffn_key(key: str) -> bool:
    return ".mlp." in key  # the dense MLPs are ".mlps."


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("sharded") / "ck"), seed=0, max_shard_size="20KB")


def test_sharded_checkpoint_matches_single_file(sharded, tiny_checkpoint):
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert afd.LLM(sharded).generate_ids(PROMPTS, 8) == afd.LLM(tiny_checkpoint).generate_ids(PROMPTS, 8)


def test_each_role_reads_only_its_tensors(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    ra, rf = SafetensorsReader(tiny_checkpoint), SafetensorsReader(tiny_checkpoint)
    build_attention_half(cfg, ra, torch.float32, CPU)
    build_ffn_half(cfg, rf, torch.float32, CPU, experts=range(2, 4))
    assert ra.keys_read and not any(_is_ffn_key(k) for k in ra.keys_read)
    assert rf.keys_read and all(_is_ffn_key(k) for k in rf.keys_read)
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in rf.keys_read if ".experts." in k}
    assert experts == {2, 3}


def test_roles_load_with_the_other_roles_shard_deleted(tiny_checkpoint, tmp_path):
    """Split the checkpoint into an attention shard and an FFN shard; each role loads with only its own."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    parts = {"attn.safetensors": {}, "ffn.safetensors": {}}
    for k, v in tensors.items():
        parts["ffn.safetensors" if _is_ffn_key(k) else "attn.safetensors"][k] = v
    cfg = load_config(tiny_checkpoint)
    for keep in parts:
        d = tmp_path / keep
        d.mkdir()
        shutil.copy(os.path.join(tiny_checkpoint, "config.json"), d)
        weight_map = {k: f for f, ts in parts.items() for k in ts}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        save_file(parts[keep], str(d / keep))
        if keep == "attn.safetensors":
            build_attention_half(cfg, SafetensorsReader(str(d)), torch.float32, CPU)
            with pytest.raises(CheckpointError, match="shard missing"):
                build_ffn_half(cfg, SafetensorsReader(str(d)), torch.float32, CPU)
        else:
            build_ffn_half(cfg, SafetensorsReader(str(d)), torch.float32, CPU)
            with pytest.raises(CheckpointError, match="shard missing"):
                build_attention_half(cfg, SafetensorsReader(str(d)), torch.float32, CPU)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_checkpoint, tmp_path / "ck")
    t = load_file(os.path.join(d, "model.safetensors"))
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(t, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.3.up_proj.weight' not found"):
        afd.LLM(d)


def test_shape_mismatch_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path / "ck")
    cfg_file = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["ffn_hidden_size"] += 1
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlps.0.gate_proj.weight' has shape \(48, 32\)"):
        afd.LLM(d)


def test_missing_files_and_bad_model_type(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path / "ck")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        afd.LLM(d)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ConfigError, match="has no config.json"):
        afd.LLM(d)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        afd.LLM(str(tmp_path / "llama"))


def test_dummy_weights_agree_across_expert_partitions(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    whole = build_ffn_half(cfg, DummyReader(7), torch.float32, CPU)
    part = build_ffn_half(cfg, DummyReader(7), torch.float32, CPU, experts=range(3, 5))
    assert torch.equal(whole.layers[1].experts.w13[3:5], part.layers[1].experts.w13)
    other = build_ffn_half(cfg, DummyReader(8), torch.float32, CPU)
    assert not torch.equal(whole.layers[1].experts.w13, other.layers[1].experts.w13)


def test_demo_checkpoint_loads_like_dummy_weights(tmp_path):
    from afd.model.demo import DEMO_CONFIG, write_checkpoint

    cfg = {**DEMO_CONFIG, "num_layers": 1, "vocab_size": 64}
    path = write_checkpoint(str(tmp_path / "demo"), cfg, seed=3)
    prompts = [[1, 2, 3], [4, 5]]
    from_disk = afd.LLM(path).generate_ids(prompts, 6, ignore_eos=True)
    assert from_disk == afd.LLM(path, dummy_weights=True, weights_seed=3).generate_ids(prompts, 6, ignore_eos=True)


def test_a_written_longcat_checkpoint_is_one_transformers_loads(tmp_path):
    """afd.model.demo writes what the locked transformers reads, no tensor more or less (its LongCat experts
    hold no rows for the identity experts since 5.x; a checkpoint with them is refused as mismatched), and
    HF's greedy tokens on it are afd's: the benchmarks that hold afd against HF load such checkpoints."""
    from transformers import LongcatFlashForCausalLM

    from afd.bench.suite import HF_CONFIG
    from afd.model.demo import write_checkpoint

    cfg = {**HF_CONFIG, "num_layers": 1, "hidden_size": 64, "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32}
    path = write_checkpoint(str(tmp_path / "lc"), cfg, seed=3)
    hf = LongcatFlashForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    assert afd.LLM(path).generate_ids([prompt], 6, ignore_eos=True) == [ref]
