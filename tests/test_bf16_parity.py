"""bf16 parity on CPU: afd serving in bf16 against HF transformers loaded in bf16.

transformers' bf16 rules that afd follows (5.24): RMSNorm in fp32, cast back before the weight; rotary
tables in fp32, cast to bf16; attention softmax in fp32, probabilities cast back; LongCat's router
upcasts a bf16 classifier and correction bias to fp32; DeepSeek-V3's router keeps both in fp32 at the
checkpoint's precision (`_keep_in_fp32_modules_strict`); Qwen3-MoE routes on bf16 logits with an fp32
softmax. Where afd's algorithm is HF's (Qwen3-MoE throughout, MLA prefill) the logits are HF's eager
ones bit for bit; elsewhere afd differs from HF as much as HF's own sdpa and eager paths differ.
"""

from __future__ import annotations

import pytest
import torch
from hf_deepseek import make_deepseek_checkpoint
from hf_qwen3 import TINY_CONFIGS as QWEN3_CONFIGS
from hf_qwen3 import make_qwen3_checkpoint
from hf_reference import PROMPTS, greedy_with_logits, make_hf_checkpoint

import afd
from afd.backend.cpu import ROW_MAJOR_ENV
from afd.dataplane.exchange import LocalMoE
from afd.engine.kv_cache import KVCache
from afd.engine.runner import ModelRunner, StepSeq
from afd.model.checkpoint import SafetensorsReader, build_ffn_half
from afd.model.registry import load_config

BF16 = torch.bfloat16
BLOCK = 4
SEQS, SEQ_LEN, PROMPT_LEN = 8, 48, 8
"""Teacher forcing: 8 random sequences of 48 tokens; afd prefills 8 and decodes the other 40 one by one,
so (48 - 8 + 1) * 8 = 328 positions are compared, prefill and decode paths both."""

# The fp32 fixtures' weight scale (0.2, 10x HF's init) makes the tiny models chaotic: bf16 rounding alone
# then flips expert choices often and HF's own sdpa and eager bf16 paths differ by up to 3 logits.
# At 0.05 (2.5x HF's init) routing and attention still vary per token while the differences stay at
# the rounding level. Expert sizes are multiples of 8 so that HF's default grouped_mm experts (16-byte
# strides) load: HF exactly as a user loads it.
WEIGHT_STD = 0.05
CHECKPOINTS = {
    "longcat_flash": (make_hf_checkpoint, dict(seed=0)),
    "deepseek_v3": (make_deepseek_checkpoint, dict(seed=10, moe_intermediate_size=16)),
    "qwen3_moe": (make_qwen3_checkpoint, dict(seed=0, moe_intermediate_size=16)),
}

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


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bf16")
    return {name: make(str(root / name), weight_std=WEIGHT_STD, **kw) for name, (make, kw) in CHECKPOINTS.items()}


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


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_teacher_forced_logits_match_hf_bf16(ckpts, family):
    path = ckpts[family]
    seqs = random_sequences(load_config(path).vocab_size)
    got = parity(afd_teacher_forced(path, seqs), hf_teacher_forced(hf_bf16(path), seqs))
    assert got["top1"] >= MIN_TOP1, got
    assert got["close"] >= MIN_CLOSE, got
    assert got["mean_rel"] <= MAX_MEAN_REL, got


def _hf_router(hf, family: str, i: int):
    mlp = hf.model.layers[i].mlp
    return mlp.router if family == "longcat_flash" else mlp.gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_router_precision_is_hfs(ckpts, family, dtype, monkeypatch):
    """afd's router holds the values HF's holds after from_pretrained(dtype=...) and routes a batch as
    HF's does, bit for bit. DeepSeek keeps classifier and bias unrounded in fp32 (its strict fp32 list);
    LongCat rounds both to bf16 and upcasts them (its fp32 list is fp16-only); Qwen3 routes in dtype.
    Bit for bit holds only where both sides run the same GEMM kernel: afd's CPU weight layout (column-major)
    makes MKL take another kernel than HF's row-major weight, and the two round differently on some CPUs
    (an AVX-512 EPYC; this machine with ATEN_CPU_CAPABILITY=avx2), so the layout is off here."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(ROW_MAJOR_ENV, "1")

    path = ckpts[family]
    cfg = load_config(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    ffn = build_ffn_half(cfg, SafetensorsReader(path), dtype, torch.device("cpu"))
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    for i in cfg.moe_layers:
        ours, theirs = ffn.layer(i).router, _hf_router(hf, family, i)
        hf_weight = theirs.classifier.weight if family == "longcat_flash" else theirs.weight
        assert torch.equal(ours.classifier.weight.float(), hf_weight.float())
        if hasattr(theirs, "e_score_correction_bias"):
            assert torch.equal(ours.e_score_correction_bias.float(), theirs.e_score_correction_bias.float())
        with torch.no_grad():
            _, hf_w, hf_ids = theirs(x)
        w, ids = ours(x)
        order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
        assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
        assert torch.equal(w.gather(1, order), hf_w.gather(1, hf_order))
    if family == "deepseek_v3":  # the checkpoint's fp32 values are not bf16 values: kept, not rounded
        bias = ffn.layer(cfg.moe_layers[0]).router.e_score_correction_bias
        assert bias.dtype == torch.float32 and not torch.equal(bias, bias.to(dtype).float())


def test_qwen3_is_hfs_eager_bf16_bit_for_bit(tmp_path, monkeypatch):
    """Qwen3-MoE computes HF's eager ops in HF's order and dtypes, so prefill, batched decode and greedy
    generation give HF's bf16 logits exactly: any drift here is a dtype rule that changed."""
    # bit for bit needs both sides on the same GEMM kernels: HF's row-major weights (see the router test)
    monkeypatch.setenv(ROW_MAJOR_ENV, "1")
    path = make_qwen3_checkpoint(str(tmp_path / "gqa"), **QWEN3_CONFIGS["gqa"])
    # eager experts: the fixture's expert size (12) is not a multiple of 8, which grouped_mm needs
    hf = hf_bf16(path, attn_implementation="eager", experts_implementation="eager")
    seqs = random_sequences(load_config(path).vocab_size)
    assert torch.equal(afd_teacher_forced(path, seqs), hf_teacher_forced(hf, seqs))
    logits: list = []
    ours = afd.LLM(path, dtype="bfloat16", block_size=BLOCK).generate_ids(PROMPTS, 16, logits_out=logits)
    ref = greedy_with_logits(hf, PROMPTS, 16)
    assert ours == [ids for ids, _ in ref]
    assert all(torch.equal(torch.stack(a), torch.stack(b)) for a, (_, b) in zip(logits, ref))


def test_mla_prefill_is_hfs_eager_bf16_bit_for_bit(tiny_checkpoints):
    """MLA prefill expands the latents as HF does: with the same dtype rules (fp32 norms of the LoRA
    latents, bf16 LoRA scaling, interleaved rope from fp32 tables, fp32 softmax) LongCat's prefill logits
    are HF's eager bf16 ones exactly. (Decode attends in latent space, a different rounding order.)"""
    path = tiny_checkpoints["no_zero_experts"]  # identity experts are summed in another order than HF's
    seq = random_sequences(load_config(path).vocab_size)[0]
    lens = list(range(4, SEQ_LEN + 1, 4))  # one prefill per prefix, all in one step
    llm = afd.LLM(path, dtype="bfloat16", block_size=BLOCK)
    kv = KVCache(llm.cfg, sum(n // BLOCK for n in lens), BLOCK, BF16, llm.backend.device)
    tables: list[list[int]] = [[] for _ in lens]
    for t, n in zip(tables, lens):
        kv.grow(t, n)
    runner = ModelRunner(llm.attn, LocalMoE(llm.ffn, llm.backend), kv, llm.backend.device)
    ours = runner.execute([StepSeq(seq[:n], 0, t) for n, t in zip(lens, tables)]).logits
    hf = hf_bf16(path, attn_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    assert torch.equal(ours, ref[[n - 1 for n in lens]])
