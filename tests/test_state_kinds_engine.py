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
