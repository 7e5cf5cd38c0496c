"""Tiny DeepSeek-V4 checkpoints in DeepSeek's released FP8 layout, made from one transformers saved
(tests/hf_deepseek_v4.py), and the same weights dequantized in transformers' layout: HF's model on those is
the oracle afd's load of the released layout is held to (tests/test_deepseek_v4_fp8.py).

The released layout (afd.model.deepseek_v4.weights, with its sources): keys without HF's `model.` prefix
(`embed.weight`, `layers.{i}.*`, `norm.weight`, `head.weight`, `hc_head_{fn,base,scale}`); FP8 tensors
(float8_e4m3fn) beside `<module>.scale`, ue8m0 (float8_e8m0fnu: a power of two per block) under
quantization_config `scale_fmt: ue8m0`. Which tensors are FP8: the attention projections wq_a, wq_b, wkv,
wo_a, wo_b, the indexer's wq_b, the shared and routed experts' w1, w2, w3 (a released checkpoint's listing:
`mtp.0.attn.{wkv,wo_a,wo_b,wq_a,wq_b}.scale`, routed experts `.weight / .scale`); the compressors' and the
indexer's wkv / wgate / weights_proj ship in BF16 without scales (transformers 5.24's DeepseekV4PreTrainedModel
lists them in _keep_in_fp32_modules for that reason); the router, embeddings, head, norms and mHC stay as they
are.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch

FP8 = torch.float8_e4m3fn
UE8M0 = torch.float8_e8m0fnu

FP8_KEY = re.compile(
    r"^(model\.layers|mtp)\.\d+\.("
    r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
    r"|ffn\.(shared_experts|experts\.\d+)\.w[123]"
    r"|e_proj|h_proj"
    r")\.weight$"
)
RELEASED = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
RELEASED.update({f"model.hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")})


def released_name(key: str) -> str:
    """Written apart from afd's released_key so that the fixture does not take afd's word for the layout."""
    return RELEASED.get(key, key[len("model.") :] if key.startswith("model.") else key)


def quantize_ue8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], ue8m0 scales [ceil(N / bn), ceil(K / bk)]): each block's scale the
    power of two at or above its absmax / 448 (so that nothing clips), the values divided by it."""
    bn, bk = block
    N, K = w.shape
    Nb, Kb = math.ceil(N / bn), math.ceil(K / bk)
    padded = torch.zeros(Nb * bn, Kb * bk)
    padded[:N, :K] = w.float()
    blocks = padded.view(Nb, bn, Kb, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=2.0**-100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))  # [Nb, Kb]
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(FP8)
    return q.view(Nb * bn, Kb * bk)[:N, :K].contiguous(), scale.to(UE8M0)


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The format's definition: q[n, k] * scale[n // bn, k // bk], in fp32."""
    bn, bk = block
    N, K = q.shape
    return q.float() * scale.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


def write_released(src: str, root: str, block: tuple[int, int]) -> tuple[str, str]:
    """(released FP8 checkpoint, HF-layout checkpoint of the dequantized weights) under `root`, from the
    transformers checkpoint at `src`."""
    from safetensors.torch import load_file, save_file

    rel, deq = os.path.join(root, "released"), os.path.join(root, "dequantized")
    if os.path.isfile(os.path.join(rel, "config.json")):
        return rel, deq
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out_rel: dict[str, torch.Tensor] = {}
    out_deq: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        name = released_name(key)
        if FP8_KEY.match(key):
            q, s = quantize_ue8m0(t, block)
            out_rel[name], out_rel[name.removesuffix("weight") + "scale"] = q, s
            out_deq[key] = dequantized(q, s, block)
        else:
            out_rel[name], out_deq[key] = t, t
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    for path, out, extra in (
        (rel, out_rel, {"quantization_config": released_quantization_config(block)}),
        (deq, out_deq, {}),
    ):
        os.makedirs(path, exist_ok=True)
        save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**cfg, **extra}, f, indent=2)
        for f_ in os.listdir(src):
            if f_ not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(src, f_)):
                shutil.copy(os.path.join(src, f_), os.path.join(path, f_))
    return rel, deq


def released_quantization_config(block: tuple[int, int]) -> dict:
    """As DeepSeek-V4's config.json writes it (128 x 128 there)."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(block),
    }


def rewrite(path: str, dst: str, edit) -> str:
    """A copy of the checkpoint at `path` with its tensors dict passed through `edit` (a broken one)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dst)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
