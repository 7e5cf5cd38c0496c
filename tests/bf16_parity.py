"""bf16 parity on CPU, the tools: afd serving in bf16 against HF transformers loaded in bf16.

transformers' bf16 rules that afd follows (read from 5.24; the lock's release holds them too): RMSNorm
in fp32, cast back before the weight; rotary tables in fp32, cast to bf16; attention softmax in fp32,
probabilities cast back; LongCat's router upcasts a bf16 classifier and correction bias to fp32;
DeepSeek-V3's router keeps both in fp32 at the checkpoint's precision (`_keep_in_fp32_modules_strict`);
Qwen3-MoE routes on bf16 logits with an fp32 softmax. Where afd's algorithm is HF's (Qwen3-MoE throughout,
MLA prefill) the logits are HF's eager ones bit for bit; elsewhere afd differs from HF as much as HF's own
sdpa and eager paths differ.
"""

from __future__ import annotations

import torch

import afd
from afd.dataplane.exchange import LocalMoE
from afd.engine.kv_cache import KVCache
from afd.engine.runner import ModelRunner, StepSeq

BF16 = torch.bfloat16
BLOCK = 4
SEQS, SEQ_LEN, PROMPT_LEN = 8, 48, 8
"""Teacher forcing: 8 random sequences of 48 tokens; afd prefills 8 and decodes the other 40 one by one,
so (48 - 8 + 1) * 8 = 328 positions are compared, prefill and decode paths both."""

# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-8 (~0.4 %), and the logits are
# bf16. A position's logits are "close" when every one is within 2^-5 (~3 %) of the position's largest
# |logit|, i.e. a few roundings of that size through the residual stream; measured, the median position
# is within ~0.6 % and the mean within 0.6-1.1 %. Some positions differ by more: where two experts'
# scores tie within bf16 noise the two implementations route a token differently (HF's sdpa and eager
# paths do the same to each other), which moves that token and the later ones attending to it.
REL_TOL = 2**-5
# Measured over 8 checkpoint and sequence seeds per family: close 0.985-1.0, mean 0.006-0.011,
# tie-aware top-1 0.994-1.0 (strict top-1 0.979-0.997); HF's eager path against its default sdpa one
# scores the same (e.g. Qwen3: close 0.994, mean 0.0072, strict top-1 0.982, as afd).
MIN_CLOSE = 0.97
MAX_MEAN_REL = 2**-6
MIN_TOP1 = 0.99


def random_sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size - 1, (SEQS, SEQ_LEN), generator=g).tolist()


def afd_teacher_forced(path: str, seqs: list[list[int]]) -> torch.Tensor:
    """afd.LLM's halves in bf16 on the serving runner: prefill PROMPT_LEN tokens of every sequence, then
    feed the rest one per step (batched decode). fp32 logits at positions PROMPT_LEN - 1.., [B, N - P + 1, V]."""
    llm = afd.LLM(path, dtype="bfloat16", block_size=BLOCK)
    kv = KVCache(llm.cfg, SEQS * SEQ_LEN // BLOCK, BLOCK, BF16, llm.backend.device)
    runner = ModelRunner(llm.attn, LocalMoE(llm.ffn, llm.backend), kv, llm.backend.device)
    tables: list[list[int]] = [[] for _ in seqs]
    for t in tables:
        kv.grow(t, SEQ_LEN)
    steps = [runner.execute([StepSeq(s[:PROMPT_LEN], 0, t) for s, t in zip(seqs, tables)]).logits]
    for i in range(PROMPT_LEN, SEQ_LEN):
        steps.append(runner.execute([StepSeq([s[i]], i, t) for s, t in zip(seqs, tables)]).logits)
    return torch.stack(steps, dim=1)


def grouped_mm_runs(cfg) -> bool:
    """Whether transformers' default experts (torch._grouped_mm, LongCat's too from 5.25) can run this
    checkpoint in bf16 on the CPU: its operands' strides must be multiples of 16 bytes, so the hidden and
    expert sizes multiples of 8; otherwise it raises "strides should be multiple of 16 bytes". LongCat's bf16
    fixture has experts of 12 (the size its tolerances were measured on): HF's eager experts run it."""
    return cfg.hidden_size % 8 == 0 and cfg.expert_intermediate_size % 8 == 0


def hf_bf16(path: str, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=BF16, **kw).eval()


def hf_teacher_forced(model, seqs: list[list[int]]) -> torch.Tensor:
    """One forward over the whole sequences; fp32 logits at the positions afd_teacher_forced returns."""
    with torch.no_grad():
        return model(torch.tensor(seqs)).logits[:, PROMPT_LEN - 1 :].float()


def parity(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """ours, ref [B, P, V]: the share of positions whose logits are close, the mean relative error, and
    top-1 agreement, tie-aware and strict."""
    scale = ref.abs().amax(dim=-1)  # [B, P]
    rel = (ours - ref).abs().amax(dim=-1) / scale
    # Top-1 up to a tie: the logits are bf16, so HF's best two are often equal or an ulp apart (about 2 %
    # of positions here) and either is HF's answer at this precision. afd's pick counts as agreeing when
    # HF scores it within REL_TOL of HF's best.
    pick = ours.argmax(dim=-1, keepdim=True)
    tied = ref.gather(-1, pick)[..., 0] >= ref.amax(dim=-1) - REL_TOL * scale
    return {
        "close": (rel <= REL_TOL).float().mean().item(),
        "mean_rel": rel.mean().item(),
        "max_rel": rel.max().item(),
        "top1": tied.float().mean().item(),
        "strict_top1": (pick[..., 0] == ref.argmax(dim=-1)).float().mean().item(),
    }


def hf_router(hf, family: str, i: int):
    mlp = hf.model.layers[i].mlp
    return mlp.router if family == "longcat_flash" else mlp.gate
