"""Speculative sampling keeps the target distribution: the rejection rule on a tiny vocabulary,
Sampler.verify's tokens over two drafts, greedy verification, and seeded requests' reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from afd.engine.logits import History
from afd.engine.sample_ops import rejection_sample
from afd.engine.sampling import Sampler, SamplingParams, accepted, verify_rows

TRIALS = 20000
TOL = 4 * math.sqrt(0.25 / TRIALS)
"""Four standard deviations of an empirical frequency over TRIALS draws (at worst p = 1/2)."""

P = torch.tensor([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize(
    "p,q",
    [
        (P, torch.tensor([0.4, 0.3, 0.2, 0.1])),  # drafts from another distribution
        (P, torch.tensor([1.0, 0.0, 0.0, 0.0])),  # a greedy draft: q one-hot (afd's MTP drafts)
        (P, P),  # the same distribution: every draft kept
        (torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.1, 0.1, 0.4, 0.4])),  # a cut target (top-k/top-p)
    ],
)
def test_rejection_rule_keeps_the_target_distribution(p, q):
    """TRIALS independent rows in one batch, as the sampler runs them."""
    gen = torch.Generator().manual_seed(0)
    P, Q = p.expand(TRIALS, -1), q.expand(TRIALS, -1)
    draft = torch.multinomial(Q, 1, generator=gen)[:, 0]
    u, e = torch.rand(TRIALS, generator=gen), torch.empty(TRIALS, len(p)).exponential_(generator=gen)
    tok, ok = rejection_sample(P, Q, draft, u, e)
    counts = torch.bincount(tok, minlength=len(p)).float()
    assert (counts / TRIALS - p).abs().max() < TOL
    assert abs(ok.float().mean() - float(torch.minimum(p, q).sum())) < TOL  # P(keep) = sum min(p, q)


def test_verify_emits_the_targets_tokens_over_two_drafts():
    """Two greedy drafts checked by temperature sampling: the first token is distributed as p0, and once
    the first draft is kept the second as p1, as when sampling one token at a time."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [1.0, 1.0, 0.0]])  # rows for x_n, d1, d2
    drafts = [2, 0]
    p0, p1 = torch.softmax(logits[0], -1), torch.softmax(logits[1], -1)
    sampler, params = Sampler(), SamplingParams(temperature=1.0)
    first, second, lengths = torch.zeros(3), torch.zeros(3), torch.zeros(4)
    # TRIALS requests verifying the same drafts, in one batch as a step samples them (Sampler.verify is one)
    flat = torch.tensor(drafts * TRIALS)
    rows = [r for i in range(TRIALS) for r in verify_rows(flat[2 * i : 2 * i + 2], 2 * i, params, i, History([1], []))]
    drawn = sampler.draw(logits.repeat(TRIALS, 1), rows, flat)
    for i in range(TRIALS):
        out = [d.token for d in accepted(drawn[3 * i : 3 * i + 3])]
        first[out[0]] += 1
        lengths[len(out)] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert (first / TRIALS - p0).abs().max() < TOL
    assert (second / second.sum() - p1).abs().max() < 4 * math.sqrt(0.25 / second.sum())
    assert lengths[1] > 0 and lengths[2] > 0 and lengths[3] > 0  # rejected, then kept one, then kept both


def test_greedy_verification_keeps_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    sampler, greedy = Sampler(), SamplingParams()
    h = History([1], [])
    assert sampler.verify(logits, [1, 0], greedy, "r", h) == [1, 0, 2]  # both kept, then the bonus token
    assert sampler.verify(logits, [1, 2], greedy, "r", h) == [1, 0]  # second rejected: the target's own
    assert sampler.verify(logits, [2, 0], greedy, "r", h) == [1]
    # penalties see the drafts before each row: a repetition penalty on token 1 (kept) turns row 1's choice
    rep = SamplingParams(repetition_penalty=100.0)
    assert sampler.verify(torch.tensor([[0.5, 3.0], [0.5, 3.0]]), [1], rep, "r", History([], [])) == [1, 0]


def test_seeded_requests_repeat_with_speculation(tiny_checkpoints, tmp_path):
    from hf_mtp import add_mtp

    import afd

    path = add_mtp(tiny_checkpoints["zero_experts"], str(tmp_path / "mtp"), "longcat_flash", noise=0.1, damp=0.1)
    llm = afd.LLM(path, block_size=4, speculative_tokens=2)
    prompts = [[5, 6, 7, 8], [60]]
    a = llm.generate_ids(prompts, 24, temperature=0.8, seed=7)
    assert llm.spec_decode["num_accepted_tokens"] > 0
    assert llm.generate_ids(prompts, 24, temperature=0.8, seed=7) == a
    assert llm.generate_ids(prompts, 24, temperature=0.8, seed=8) != a
    assert all(len(ids) == 24 for ids in a)
