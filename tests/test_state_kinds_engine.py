"""DeepSeek-V4 through afd's engine with its state kinds (afd.model.state_spec): a long sequence holds its window's
pages and its compressed entries', not its history, and decodes HF's tokens (tests/hf_deepseek_v4.py's tiny
checkpoint)."""

from __future__ import annotations

import pytest
import torch
from hf_deepseek_v4 import V4_CONFIGS, hf_greedy, make_v4_checkpoint

import afd

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    return make_v4_checkpoint(str(tmp_path_factory.mktemp("v4") / "all_types"), **V4_CONFIGS["all_types"])


def test_a_long_sequence_holds_its_window_not_its_history(v4_path):
    """A 300-token prompt, then 64 decoded, blocks of 4: the prefill writes 75 blocks, and from the next step on
    (the scheduler gives the window's pages back before each step) the sequence holds its window's pages
    (lookback 15: 5 of them) and its compressed entries' few, not the 75 to 91 blocks of its history; its
    tokens are HF's."""
    from afd.engine.request import Request
    from afd.engine.sampling import SamplingParams

    path = v4_path
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_greedy(path, [prompt], NEW_TOKENS)
    engine = afd.LLM(path, block_size=4).job_engine([prompt], [NEW_TOKENS])
    a = engine.runner.kv.allocator
    total, held, out = a.num_free, [], []
    engine.add_request(
        Request("0", prompt, SamplingParams(), NEW_TOKENS, lambda o: out.extend(o.new_token_ids), ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()
        held.append(total - a.num_free)
    assert out == ref[0][0]
    # 6 entry pages at most: 91 CSA entries, 24 a page; 22 HCA, 72 a page
    assert held[0] >= 75 and max(held[1:-1]) <= 5 + 6 and a.num_free == total


def test_a_window_family_serves_sequences_longer_than_its_pages_in_full(v4_path):
    """A serving engine's max_model_len is what the pool holds at peak (KVCache.max_tokens): for V4, whose
    window's pages go back as it advances, far past pages x block_size; a 300-token prompt through a pool of
    about 30 pages (120 tokens in full), prefilled 32 tokens a step, decodes HF's tokens."""
    from afd.config.flags import flat_overrides, with_overrides
    from afd.dataplane.exchange import LocalMoE
    from afd.engine.factory import build_engine
    from afd.engine.kv_cache import bytes_per_block
    from afd.engine.request import Request
    from afd.engine.sampling import SamplingParams

    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = hf_greedy(v4_path, [prompt], NEW_TOKENS)
    llm = afd.LLM(v4_path, block_size=4)
    per_block = bytes_per_block(llm.cfg, 4, 4)  # fp32
    llm2 = afd.LLM(v4_path, block_size=4, kv_cache_bytes=24 * per_block)
    cfg = with_overrides(llm2.config, flat_overrides({"max_num_batched_tokens": 32}))  # a server's, not a job's
    engine = build_engine(cfg, llm2.attn, LocalMoE(llm2.ffn, llm2.backend), llm2.backend.device)
    pages = engine.runner.kv.allocator.num_free
    assert pages * 4 < len(prompt) + NEW_TOKENS <= engine.max_model_len
    out: list[int] = []
    engine.add_request(
        Request("0", prompt, SamplingParams(), NEW_TOKENS, lambda o: out.extend(o.new_token_ids), ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()
    assert out == ref[0][0]
    assert engine.runner.kv.allocator.num_free == pages


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_job_runs_every_sequence_at_once(v4_path, block_size):
    """A job's cache is sized for its sequences (afd.engine.factory.build_runner): for V4, each one's window and
    every compressed kind's pages, a partly filled last page each. Sized by pool_pages's average instead, 4
    sequences of 22 tokens at blocks of 16 got 14 pages for the 16 they take at once: one was preempted and
    recomputed, and `afd profile` found no decode step of the batch it asked for."""
    from afd.engine.request import Request
    from afd.engine.sampling import SamplingParams

    prompts = [torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    engine = afd.LLM(v4_path, block_size=block_size).job_engine(prompts, [6] * 4)
    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), p, SamplingParams(), 6, lambda o: None, ignore_eos=True))
    batches = []
    while engine.has_unfinished():
        batches.append(len(engine.scheduler.running))
        engine.step()
    assert engine.scheduler.num_preemptions == 0 and batches[1:] == [4] * (len(batches) - 1)
