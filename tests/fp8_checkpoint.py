"""Tiny checkpoints in the layout of the released FP8 ones (DeepSeek-V3, LongCat-Flash-Chat-FP8), made from a
checkpoint transformers saved, and HF transformers' dequantized load of them: the oracle afd's FP8 loading is
held to (tests/test_fp8_checkpoint.py).

Which tensors the releases store FP8 (float8_e4m3fn, beside `<name>.weight_scale_inv` fp32 of shape
[ceil(N / bn), ceil(K / bk)]): every linear projection of the decoder layers -- attention (q_a, q_b or q,
kv_a_proj_with_mqa, kv_b, o), dense MLPs (DeepSeek's first layers' `mlp`, LongCat's `mlps.0/1`), shared
experts and routed experts. Everything else keeps the checkpoint dtype: embed_tokens, lm_head, the norms,
the router (DeepSeek `mlp.gate.weight`, LongCat `mlp.router.classifier.weight`) and e_score_correction_bias.
Sources: a released DeepSeek-V3-architecture checkpoint's tensor table (Kimi-K2-Instruct, the same layout:
gate.weight bf16, e_score_correction_bias fp32, every *_proj float8_e4m3fn with weight_scale_inv, e.g.
kv_a_proj_with_mqa [576, 7168] -> scale [5, 56]); DeepSeek's reference model (deepseek-ai/DeepSeek-V3
inference/model.py: `Linear.dtype = float8_e4m3fn`, while the head is built in the default dtype and the
gate's weight is a plain parameter); deepseek-ai/DeepSeek-V3 README_WEIGHTS.md (the quantization_config,
128 x 128 blocks, edge blocks zero-padded before the scale is taken); sglang's LongCat-Flash model
(sgl-project/sglang python/sglang/srt/models/longcat_flash.py: the router's classifier is built with
`quant_config=None` in fp32, attention, `mlps` and experts with the checkpoint's quant_config).
DeepSeek-V3's config.json has no modules_to_not_convert; neither has the one written here.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

FP8_KEY = re.compile(
    r"^model\.layers\.\d+\.("
    r"self_attn(\.\d+)?\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlps?(\.\d+)?\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r")\.weight$"
)
"""A decoder layer's linear projection: stored FP8 in the releases."""


def is_fp8_key(key: str) -> bool:
    return FP8_KEY.match(key) is not None


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv fp32 [ceil(N / bn), ceil(K / bk)]): each block, zero-padded
    at the edges, divided by its absmax / 448 (DeepSeek's weight quantization). Written apart from afd's own
    quantizer so that the fixture does not take afd's word for the format."""
    bn, bk = block
    N, K = w.shape
    Nb, Kb = math.ceil(N / bn), math.ceil(K / bk)
    padded = torch.zeros(Nb * bn, Kb * bk, dtype=torch.float32)
    padded[:N, :K] = w.float()
    blocks = padded.view(Nb, bn, Kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [Nb, Kb]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: zeros, any scale
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(Nb * bn, Kb * bk)[:N, :K].contiguous(), scale


def block_values(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The released format's definition, element by element: value(n, k) = q[n, k] * scale_inv[n // bn,
    k // bk], in fp32 (one rounding)."""
    bn, bk = block
    N, K = q.shape
    full = scale_inv.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return q.float() * full


def _read_all(src: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(src, f)))
    return out


def write_fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128)) -> str:
    """The checkpoint at `src` (saved by transformers) as released FP8 at `dst`: FP8_KEY tensors quantized in
    `block`s beside their weight_scale_inv, the rest as they are, config.json with quantization_config, every
    other file (tokenizer, generation config) copied."""
    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for key, t in _read_all(src).items():
        if is_fp8_key(key):
            q, s = quantize_blocks(t, block)
            out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = q, s
        else:
            out[key] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if f.endswith(".safetensors") or f in ("config.json", "model.safetensors.index.json"):
            continue
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [block[0], block[1]],
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def hf_dequantized_model(path: str):
    """HF transformers' load of the FP8 checkpoint at `path`, dequantized to fp32 on CPU (the eager expert
    loop: grouped_mm wants 16-byte aligned sizes). transformers' FP8 quantizer needs `accelerate` installed
    (FineGrainedFP8HfQuantizer.validate_environment): the test extra names it."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
        experts_implementation="eager",
    )
    return model.eval()
