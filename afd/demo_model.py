"""A small LongCat-Flash-shaped checkpoint with seeded weights, written in the hub's layout.

`make run` serves it so that a newcomer needs no download; it is made once into a cache folder.
"""

from __future__ import annotations

import json
import os

import torch

from afd.checkpoint import DummyReader, attention_keys
from afd.config import ModelConfig
from afd.model.attention_half import AttentionHalf

DEMO_CONFIG = {
    "architectures": ["LongcatFlashForCausalLM"],
    "model_type": "longcat_flash",
    "vocab_size": 512,
    "hidden_size": 256,
    "num_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "ffn_hidden_size": 512,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "head_dim": 16,
    "v_head_dim": 32,
    "moe_topk": 4,
    "n_routed_experts": 16,
    "zero_expert_num": 4,
    "expert_ffn_hidden_size": 128,
    "routed_scaling_factor": 6.0,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}


def default_cache_dir() -> str:
    base = os.environ.get("AFD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "afd")
    return os.path.join(base, "demo-longcat-flash")


def checkpoint_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a hub-layout checkpoint for `cfg`, from the same generator as dummy weights."""
    reader = DummyReader(seed)
    with torch.device("meta"):
        attn = AttentionHalf(cfg)
    out = {key: reader.get(key, tuple(p.shape)) for key, p in attention_keys(attn)}
    H, I, E = cfg.hidden_size, cfg.expert_ffn_hidden_size, cfg.num_experts_total
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp"
        out[f"{pre}.router.classifier.weight"] = reader.get(f"{pre}.router.classifier.weight", (E, H))
        bias_key = f"{pre}.router.e_score_correction_bias"
        out[bias_key] = reader.get(bias_key, (E,))
        for e in range(cfg.n_routed_experts):
            for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                key = f"{pre}.experts.{e}.{name}.weight"
                out[key] = reader.get(key, shape)
    return out


def write_checkpoint(path: str, hf_config: dict, seed: int = 0) -> str:
    """Writes config.json and model.safetensors to `path` (atomically: a half-written one never stays)."""
    from safetensors.torch import save_file

    cfg = ModelConfig.from_hf_dict(hf_config)
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    tensors = {k: v.contiguous() for k, v in checkpoint_tensors(cfg, seed).items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def ensure_demo_checkpoint(path: str | None = None) -> str:
    path = path or default_cache_dir()
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_checkpoint(path, DEMO_CONFIG)
    return path
