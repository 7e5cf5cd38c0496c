"""Check `paged`: MLA decode attention over the paged cache at long contexts, on the device against the CPU in
fp32 (afd/model/paged_attention.py: a chunk of blocks at a time, the whole sequence never copied out; on
Ascend, FIA where its documented limits hold: afd/backend/npu_attention.py).

One decode step of B sequences at contexts of one chunk and of several (4,096 tokens: four chunks), block
tables drawn at random from the pool as a long-running server's are, in FIA's MLA shape (latent 512, rope 64,
32 heads; the other widths small). Outputs within a tolerance, and the median step time per context.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from device_common import Target, median_ms
from device_env import dtype_supported
from device_report import Result

MEASURED = "MLA decode over the paged cache vs CPU fp32, contexts 256 and 4,096: max rel error, median ms"
B, BS, C, R, HEADS = 4, 16, 512, 64, 32
CONTEXTS = (256, 4096)
TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # max |device - cpu| / max |cpu|: summation order; bf16 rounding


def _mla(dtype: torch.dtype):
    from afd.model.mla import MLAttention

    cfg = SimpleNamespace(
        num_attention_heads=HEADS, hidden_size=64, qk_nope_head_dim=16, qk_rope_head_dim=R, qk_head_dim=16 + R,
        v_head_dim=16, q_lora_rank=32, kv_lora_rank=C, attention_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return MLAttention(cfg, lora_scales=False, softmax_scale=0.11, rope_interleave=True).to(dtype)


def check_paged(target: Target, dtype: str) -> Result:
    name = f"paged MLA decode {dtype} vs CPU fp32"
    ok, why = dtype_supported(target, dtype)
    if not ok:
        return Result(name, "skip", why, measured=MEASURED)
    from afd.backend import get_backend
    from afd.model.attention_metadata import AttentionMetadata
    from afd.model.mla import attach_backend

    backend = get_backend(target.kind)
    dev, dt = backend.device, getattr(torch, dtype)
    ref, attn = _mla(torch.float32), _mla(torch.float32).to(dev, dt)
    attach_backend(attn, backend)  # Ascend: FIA where it fits; CUDA and CPU: the chunked path
    blocks = B * max(CONTEXTS) // BS
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(blocks, BS, C + R, generator=g) * 0.5
    pool = list(range(blocks))
    random.Random(0).shuffle(pool)
    figures: dict = {"tol": TOL[dtype]}
    worst = 0.0
    with torch.inference_mode():
        for L in CONTEXTS:
            nb = L // BS
            tables = [pool[i * nb : (i + 1) * nb] for i in range(B)]
            x = torch.randn(B, 64, generator=g)
            angle = torch.rand(B, R // 2, generator=g) * 6
            cos, sin = angle.cos(), angle.sin()
            meta = AttentionMetadata.build([L - 1] * B, [1] * B, tables, BS, torch.device("cpu"))
            want = ref(x, cos, sin, meta, cache.clone())
            dmeta = AttentionMetadata.build([L - 1] * B, [1] * B, tables, BS, dev)
            dcache = cache.to(dev, dt)
            args = (x.to(dev, dt), cos.to(dev, dt), sin.to(dev, dt), dmeta, dcache)
            got = attn(*args).float().cpu()
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            worst = err if not err <= worst else worst  # a NaN stays
            figures[f"ms_L{L}"] = median_ms(backend, lambda a=args: attn(*a), calls=10)
    figures["rel_err"] = worst
    if not worst <= TOL[dtype]:
        return Result(name, "fail", f"rel err {worst:.3g} > {TOL[dtype]}", figures)
    return Result(name, "pass", f"within {TOL[dtype]} at contexts {', '.join(map(str, CONTEXTS))}", figures)
