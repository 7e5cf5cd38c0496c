"""bf16 parity on CPU where afd's algorithm is HF's own: the logits are HF's eager bf16 ones bit for
bit. The parity every family keeps (teacher-forced logits, router precision) is tests/test_families.py;
the rules and tolerances are tests/bf16_parity.py."""

from __future__ import annotations

import torch
from bf16_parity import BF16, BLOCK, SEQ_LEN, afd_teacher_forced, hf_bf16, hf_teacher_forced, random_sequences
from hf_reference import PROMPTS, greedy_with_logits

import afd
from afd.backend.cpu import ROW_MAJOR_ENV
from afd.backend.kernel_choice import FORCE_ENV
from afd.dataplane.exchange import LocalMoE
from afd.engine.kv_cache import KVCache
from afd.engine.runner import ModelRunner, StepSeq
from afd.model.registry import load_config


def test_qwen3_is_hfs_eager_bf16_bit_for_bit(families, monkeypatch):
    """Qwen3-MoE computes HF's eager ops in HF's order and dtypes, so prefill, batched decode and greedy
    generation give HF's bf16 logits exactly: any drift here is a dtype rule that changed. Bit equality
    holds only where both sides run the same CPU kernels: afd's column-major weight layout makes MKL take
    another GEMM kernel than HF's row-major weights get (they round differently under AVX2, and on an
    AVX-512 EPYC), so the layout is off here, and every GEMM takes its bf16 kernel (not the fp32 one the CPU may
    time faster: afd.backend.cpu_kernels)."""
    monkeypatch.setenv(ROW_MAJOR_ENV, "1")
    monkeypatch.setenv(FORCE_ENV, "native,linear_layout=plain,grouped_layout=plain")  # HF: plain weights
    path = families.path("qwen3_moe", "gqa")
    # eager experts: the fixture's expert size (12) is not a multiple of 8, which grouped_mm needs
    hf = hf_bf16(path, attn_implementation="eager", experts_implementation="eager")
    seqs = random_sequences(load_config(path).vocab_size)
    assert torch.equal(afd_teacher_forced(path, seqs), hf_teacher_forced(hf, seqs))
    logits: list = []
    ours = afd.LLM(path, dtype="bfloat16", block_size=BLOCK).generate_ids(PROMPTS, 16, logits_out=logits)
    ref = greedy_with_logits(hf, PROMPTS, 16)
    assert ours == [ids for ids, _ in ref]
    assert all(torch.equal(torch.stack(a), torch.stack(b)) for a, (_, b) in zip(logits, ref))


def test_mla_prefill_is_hfs_eager_bf16_bit_for_bit(tiny_checkpoints, monkeypatch):
    """MLA prefill expands the latents as HF does: with the same dtype rules (fp32 norms of the LoRA
    latents, bf16 LoRA scaling, interleaved rope from fp32 tables, fp32 softmax) LongCat's prefill logits
    are HF's eager bf16 ones exactly. (Decode attends in latent space, a different rounding order.) HF's
    row-major weights, so that both sides run the same GEMM kernels (see the Qwen3 test), and HF's eager
    experts: its per-expert loop is the expert computation afd's CPU path repeats, where grouped_mm (LongCat's
    default from transformers 5.25) rounds otherwise and cannot run this fixture's expert size (12, not a
    multiple of 8) in bf16 on the CPU. bf16 kernels, as in the Qwen3 test."""
    monkeypatch.setenv(ROW_MAJOR_ENV, "1")
    monkeypatch.setenv(FORCE_ENV, "native,linear_layout=plain,grouped_layout=plain")  # HF: plain weights
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
    hf = hf_bf16(path, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    assert torch.equal(ours, ref[[n - 1 for n in lens]])
