"""Sampling at the edges of what the API accepts: every value gives a token from a defined distribution, never
NaN and never an exception (the engine would fail the request with a 500)."""

from __future__ import annotations

import itertools

import pytest
import torch

from afd.engine.logits import History, apply_penalties
from afd.engine.sampling import Sampler, SamplingParams

V = 40
HISTORY = History([1, 2, 3, 4], [3, 5])
SEEN = [1, 2, 3, 4, 5]


def _logits() -> torch.Tensor:
    x = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    # the seen tokens: two positive (their order must survive any penalty), 0 (0 * inf is NaN), two negative
    x[SEEN] = torch.tensor([2.5, 0.0, -1.5, -3.0, 1.0])
    return x


def _reference(x: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty in float64: a seen positive logit divided by the penalty, any other seen logit
    multiplied by it (0 stays 0). Penalties past 1e+-300 are taken as 1e+-300, where float64 still orders the
    seen positive logits (beyond, they overflow and tie): a positive constant keeps the order, which is all
    the greedy token depends on."""
    penalty = min(max(penalty, 1e-300), 1e300)
    out = x.double().clone()
    for t in SEEN:
        v = out[t].item()
        out[t] = v / penalty if v > 0 else (0.0 if v == 0 else v * penalty)
    return out


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-40, 1e39, 1e300, 1.7976931348623157e308])
@pytest.mark.parametrize("min_tokens", [0, 5])
def test_an_extreme_repetition_penalty_keeps_hfs_order_without_nan(penalty, min_tokens):
    """1e-300 rounded to 0 in float32 (-inf * 0 = NaN where min_tokens bars EOS) and 1e300 to inf (0 * inf):
    the greedy token is the float64 reference's, and EOS stays barred."""
    x = _logits()
    p = SamplingParams(repetition_penalty=penalty, min_tokens=min_tokens)
    out = apply_penalties(x[None], [p], [HISTORY], eos_ids=(0,))[0]
    assert not out.isnan().any()
    ref = _reference(x, penalty)
    if min_tokens:
        ref[0] = float("-inf")
        assert out[0] == float("-inf")
    assert Sampler(eos_ids=(0,)).sample(x[None], [p], ["r"], [HISTORY]) == [int(ref.argmax())]


def test_a_logit_at_infinity_takes_all_the_mass_at_any_temperature():
    """A tiny penalty sends a seen positive logit to +inf; divided by a temperature past float32 (also inf)
    it was NaN. The token at +inf is the only one with mass, whatever the temperature and seed."""
    x = _logits()
    x[1], x[5] = 7.0, -1.0  # the one seen positive logit: 7 / 1.2e-38 (float32's least normal) is +inf
    for temperature in (1e-5, 1.0, 1e38, 1e300, 1.7976931348623157e308):
        for seed in range(5):
            p = SamplingParams(temperature=temperature, repetition_penalty=1e-300, seed=seed)
            assert Sampler().sample(x[None], [p], ["r"], [HISTORY]) == [1], (temperature, seed)


def test_a_top_k_past_the_vocabulary_is_no_cut():
    """The API takes any integer; past int64 it could not even become a tensor."""
    x = _logits()[None]
    for k in (V, V + 1, 2**62, 10**30):
        draws = [Sampler().sample(x, [SamplingParams(temperature=1.5, top_k=k, seed=s)], ["r"])[0] for s in range(8)]
        plain = [Sampler().sample(x, [SamplingParams(temperature=1.5, seed=s)], ["r"])[0] for s in range(8)]
        assert draws == plain, k


def test_every_combination_of_extremes_draws_a_token():
    x = torch.stack([_logits(), torch.zeros(V)])
    grid = {
        "temperature": [0.0, 5e-324, 1e-300, 1e-5, 1.0, 1e300],
        "top_p": [5e-324, 1e-300, 0.5, 1.0],
        "top_k": [0, 1, V + 1, 10**30],
        "repetition_penalty": [5e-324, 1.0, 1e300],
        "presence_penalty": [-2.0, 2.0],
        "logit_bias": [{}, {3: 100.0, 7: -100.0}],
        "min_tokens": [0, 10**30],
    }
    for values in itertools.product(*grid.values()):
        kw = dict(zip(grid, values))
        p = SamplingParams(**kw, seed=1)
        toks = Sampler(eos_ids=(0,)).sample(x, [p, p], ["a", "b"], [HISTORY, HISTORY])
        assert all(0 <= t < V for t in toks), (kw, toks)
        assert kw["min_tokens"] == 0 or 0 not in toks, (kw, toks)  # EOS barred


def test_a_zero_noise_value_never_draws_a_token_of_probability_zero():
    """The exponential race divides by its noise: a 0 there on a token of probability 0 (top-k removed it)
    was 0 / 0, a NaN that argmax takes for the largest."""
    from afd.engine.sample_ops import draw

    p = torch.tensor([[0.0, 0.7, 0.3], [0.5, 0.0, 0.5]])
    e = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 2.0]])
    assert draw(p, e).tolist() == [1, 0]


def test_min_p_drops_the_tokens_below_its_share_of_the_top_one():
    """vLLM's min-p: after temperature, a token less likely than min_p x the most likely one is never drawn;
    the others keep their relative odds; min_p 1 leaves the top token alone; 0 cuts nothing."""
    from afd.engine import sample_ops as ops

    x = torch.tensor([[3.0, 2.0, 1.0, -1.0, -4.0]])
    one = torch.ones(1)
    p = torch.softmax(x, -1)[0]
    cut = ops.probs(x, one, None, 0, None, torch.tensor([0.2]))[0]
    keep = p >= 0.2 * p.max()
    assert torch.equal(cut > 0, keep) and torch.allclose(cut[keep], p[keep] / p[keep].sum())
    assert torch.equal(ops.probs(x, one, None, 0, None, torch.ones(1))[0] > 0, torch.tensor([1, 0, 0, 0, 0]).bool())
    assert torch.allclose(ops.probs(x, one, None, 0, None, torch.zeros(1)), torch.softmax(x, -1))
    draws = {
        Sampler().sample(x, [SamplingParams(temperature=1.0, min_p=0.2, seed=s)], ["r"], [HISTORY])[0]
        for s in range(200)
    }
    assert draws == set(keep.nonzero().flatten().tolist())
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
