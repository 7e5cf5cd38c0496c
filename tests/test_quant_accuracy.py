"""8-bit activations against HF's dequantized model, teacher-forced on the tiny FP8 fixtures
of tests/test_fp8_checkpoint.py (block (16, 8)): how far fp8 and w8a8 move the logits, and that what moves them
is the scheme (HF with the scheme simulated in its F.linear lands where afd does). The reported figures, on
larger models with 128 x 128 blocks, are bench/quant_accuracy.py's (docs/bench/quant-accuracy.json)."""

from __future__ import annotations

import os
import sys

import pytest
from hf_reference import PROMPTS
from test_fp8_checkpoint import BLOCK, FAMILIES, Fp8Family

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import quant_accuracy as bench  # noqa: E402
import quant_sim  # noqa: E402

STEPS = 8
"""HF greedy tokens per prompt; afd is teacher-forced on each prefix."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fp8(request, tmp_path_factory) -> Fp8Family:
    return Fp8Family(tmp_path_factory.mktemp(f"qacc-{request.param}"), request.param)


def _measure(fp8: Fp8Family, method: str, prompts: list[list[int]]) -> dict:
    """afd against HF (dequantized, fp32), afd against HF with `method` simulated, and that simulation
    against HF: agreement and logit errors per position (bench.agreement)."""
    ids = bench.hf_greedy(fp8.hf, prompts, STEPS)
    ref = bench.hf_teacher_forced(fp8.hf, prompts, ids)
    _, got = bench.afd_teacher_forced(fp8.path, method, prompts, ids)
    with quant_sim.simulated(fp8.hf, method, stored_fp8=True, block=BLOCK):
        sim = bench.hf_teacher_forced(fp8.hf, prompts, ids)
    return {
        "afd_vs_hf": bench.agreement(got, ref),
        "afd_vs_sim": bench.agreement(got, sim),
        "sim_vs_hf": bench.agreement(sim, ref),
    }


def _brief(r: dict) -> dict:
    """{method: _measure(...)} with agreement, median and max error, rounded: what a failure prints."""
    keys = ("top1_agreement", "logit_err_median", "logit_err_max")
    return {m: {k: {n: round(v[n], 5) for n in keys} for k, v in per.items()} for m, per in r.items()}


def test_afd_computes_the_schemes_numbers(tmp_path):
    """Fast: LongCat-Flash, fp8 and w8a8, the fixture's 4 prompts. afd lands where HF with the scheme simulated
    lands (bench/quant_sim.py: written from the formats' definitions, not afd's code): both quantize the same
    values but for those within fp32 noise (another order of sums, MLA absorbed) of a rounding boundary, so
    afd against the simulation stays far below the scheme's own error, which a wrong scale, group or
    layer left out would reach. Measured (32 positions): afd against the simulation, median below 1e-5 of
    the largest logit; the simulation against HF, 3-9 %."""
    family = Fp8Family(tmp_path, "longcat_flash")
    r = {m: _measure(family, m, PROMPTS) for m in ("fp8", "w8a8")}
    print(_brief(r))
    for m, v in r.items():
        assert v["afd_vs_sim"]["logit_err_median"] <= 1e-3, (m, _brief(r))
        assert v["afd_vs_sim"]["logit_err_median"] <= 0.05 * v["sim_vs_hf"]["logit_err_median"], (m, _brief(r))
        assert v["afd_vs_sim"]["logit_err_max"] <= 0.1, (m, _brief(r))


def test_8bit_activations_move_the_logits_within_the_schemes_error(fp8):
    """Both families, 20 prompts x 8 positions, against HF's dequantized model in fp32.

    Measured (transformers 5.24, torch 2.13, CPU): top-1 agreement / median / max logit error over the largest
    logit: DeepSeek-V3 fp8 0.85 / 0.072 / 0.87, w8a8 0.89 / 0.033 / 1.37; LongCat-Flash fp8 0.88 / 0.087 /
    0.37, w8a8 0.96 / 0.034 / 0.15; afd against the simulation: medians below 1e-5, max 0.018. The maxima,
    far from the medians, are most likely where the quantized input changes a token's experts (a whole
    expert's output, not a rounding error; the bench counts such changes on its models): they are bounded
    only to say the logits are not lost. The
    bounds: about 2.5x the measured medians and a tenth off the agreements; the scheme's own error is held
    by the simulation (as in the fast test), and w8a8 below fp8 (int8's half step is 1/254 of a token's
    absmax, e4m3's 2^-4 of each value: measured 2-2.6x apart), so int8 read as e4m3, or a scale applied
    twice, fails."""
    prompts = bench.prompts(fp8.cfg.vocab_size) + PROMPTS
    r = {m: _measure(fp8, m, prompts) for m in ("fp8", "w8a8")}
    print(f"{fp8.family}, teacher-forced, {len(prompts) * STEPS} positions: {_brief(r)}")
    for m, v in r.items():
        assert v["afd_vs_sim"]["logit_err_median"] <= 1e-3, (m, _brief(r))
        assert v["afd_vs_sim"]["logit_err_median"] <= 0.05 * v["sim_vs_hf"]["logit_err_median"], (m, _brief(r))
        assert v["afd_vs_hf"]["logit_err_max"] <= 3.0, (m, _brief(r))
    f8, i8 = r["fp8"]["afd_vs_hf"], r["w8a8"]["afd_vs_hf"]
    assert f8["top1_agreement"] >= 0.75 and f8["logit_err_median"] <= 0.2, _brief(r)
    assert i8["top1_agreement"] >= 0.8 and i8["logit_err_median"] <= 0.08, _brief(r)
    assert i8["logit_err_median"] < f8["logit_err_median"], _brief(r)
