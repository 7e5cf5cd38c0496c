"""Sampling parameters that change logits, against HF's logits processors where HF has one."""

from __future__ import annotations

import pytest
import torch
from hf_reference import PROMPTS

from afd.engine import offline
from afd.engine.logits import History, apply_penalties
from afd.engine.sampling import GREEDY_BELOW, Sampler, SamplingParams

V = 50
PROMPT, OUTPUT = [3, 7, 7, 12], [7, 20, 20, 20, 41]


def _row(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def process(row: torch.Tensor, p: SamplingParams, h: History, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """One row through the batched processors."""
    return apply_penalties(row[None], [p], [h], eos_ids)[0]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_hfs(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    row = _row()
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]), row[None].clone())[0]
    ours = process(row, SamplingParams(repetition_penalty=penalty), History(PROMPT, OUTPUT), ())
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("done", [0, 2, 3])
def test_min_tokens_is_hfs_min_new_tokens(done):
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    row, out = _row(1), OUTPUT[:done]
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, [2, 9])
    ref = hf(torch.tensor([PROMPT + out]), row[None].clone())[0]
    ours = process(row, SamplingParams(min_tokens=3, stop_token_ids=(9,)), History(PROMPT, out), (2,))
    assert torch.equal(ours, ref)


def test_logit_bias_is_hfs_sequence_bias():
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    row, bias = _row(2), {5: 4.5, 17: -100.0, 0: 0.25}
    ref = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})(torch.tensor([PROMPT]), row[None].clone())[0]
    assert torch.allclose(process(row, SamplingParams(logit_bias=bias), History(PROMPT, []), ()), ref)


def test_presence_and_frequency_penalties_follow_openais_formula():
    row = _row(3)
    ours = process(row, SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4), History(PROMPT, OUTPUT), ())
    want = row.clone()
    for tok in set(OUTPUT):  # prompt tokens are not penalized
        want[tok] -= -0.4 * OUTPUT.count(tok) + 0.7
    assert torch.allclose(ours, want)


def test_a_batch_is_processed_as_each_row_alone():
    """Rows with different parameters (and rows with none) in one batch: each row as if processed alone."""
    cases = [
        (SamplingParams(repetition_penalty=1.3, logit_bias={5: 2.0}), History(PROMPT, OUTPUT)),
        (SamplingParams(), History(PROMPT, OUTPUT)),
        (SamplingParams(min_tokens=9, stop_token_ids=(9,), frequency_penalty=0.5), History(PROMPT, OUTPUT)),
        (SamplingParams(presence_penalty=-1.0, repetition_penalty=0.7), History([1, 2], [2, 2, 49])),
    ]
    rows = torch.stack([_row(i) for i in range(len(cases))])
    batch = apply_penalties(rows, [p for p, _ in cases], [h for _, h in cases], (2,))
    for b, (p, h) in enumerate(cases):
        assert torch.equal(batch[b], process(rows[b], p, h, (2,))), b
    assert torch.equal(batch[1], rows[1])


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0.0),
        dict(logit_bias={3: 101}),
        dict(min_tokens=-1),
        dict(stop_token_ids=(-1,)),
        dict(logprobs=21),
        dict(seed=2**64),
    ],
)
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_extreme_penalty_and_temperature_sample_the_limit_not_nan():
    """The fuzzer's case: repetition_penalty 9.8e-270 sends every seen token's positive logit towards +inf;
    sampling must draw the limit, not raise on NaN probabilities. The penalty is taken at float32's least
    normal value (9.8e-270 itself is 0 there), which keeps the seen logits' order: the larger one takes all
    the mass, as it does for any penalty small enough."""
    sampler = Sampler()
    logits = torch.tensor([[2.0, -1.0, 3.0, 1.0, 30.0]])
    hist = History(prompt_ids=[0, 1, 2], output_ids=[])
    p = SamplingParams(temperature=1.0, repetition_penalty=9.768669705132132e-270, seed=0)
    drawn = {sampler.sample(logits, [p], ["r"], [hist])[0] for _ in range(40)}
    assert drawn == {2}  # 3 / p against 2 / p: e^(1/p) times more likely
    cold = SamplingParams(temperature=GREEDY_BELOW, seed=0)  # 1e38 / 1e-5 overflows too
    assert sampler.sample(torch.tensor([[1e38, 0.0, 3e38]]), [cold], ["c"])[0] in (0, 2)


def _generate(llm, params: SamplingParams, n: int = 8) -> list[int]:
    eng = llm.job_engine([PROMPTS[1]], [n])
    return offline.generate(eng, [PROMPTS[1]], [n], params)[0]


def test_engine_applies_bias_stop_ids_and_min_tokens(tiny_checkpoint):
    import afd

    llm = afd.LLM(tiny_checkpoint)
    greedy = _generate(llm, SamplingParams())
    assert _generate(llm, SamplingParams(logit_bias={11: 100.0})) == [11] * 8
    assert _generate(llm, SamplingParams(stop_token_ids=(greedy[0],))) == greedy[:1]
    barred = _generate(llm, SamplingParams(stop_token_ids=(greedy[0],), min_tokens=3))
    assert greedy[0] not in barred[:3]


def test_drafts_on_the_device_count_as_output():
    """A verification row's MTP drafts are a device tensor the host never reads: they penalise (and count
    toward min_tokens) exactly as the same tokens appended to the output on the host do. Both sides add
    whole counts and run the same ops, so the rows are equal bit for bit."""
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=len(OUTPUT) + 3)
    rows = torch.stack([_row(1), _row(2)])
    plain = SamplingParams(logit_bias={4: 2.0})  # a row without penalties keeps its logits
    drafts = torch.tensor([20, 9, 9])
    for n in range(len(drafts) + 1):
        want = apply_penalties(rows, [p, plain], [History(PROMPT, OUTPUT + drafts[:n].tolist()), History([], [])], (2,))
        got = apply_penalties(rows, [p, plain], [History(PROMPT, OUTPUT, drafts[:n]), History([], [])], (2,))
        assert torch.equal(got, want), n
        assert (got[0, 2] == float("-inf")) == (n < 3)  # min_tokens counts the drafts
