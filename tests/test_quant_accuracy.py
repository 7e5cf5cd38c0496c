"""8-bit activations against HF's dequantized model (issue 27, item 4), teacher-forced on the tiny FP8 fixtures
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
    with bench.simulated(fp8.hf, method, stored_fp8=True, block=BLOCK):
        sim = bench.hf_teacher_forced(fp8.hf, prompts, ids)
    return {
        "afd_vs_hf": bench.agreement(got, ref),
        "afd_vs_sim": bench.agreement(got, sim),
        "sim_vs_hf": bench.agreement(sim, ref),
    }


def _brief(r: dict) -> dict:
    keys = ("top1_agreement", "logit_err_median", "logit_err_max")
    return {k: {m: round(v[m], 5) for m in keys} for k, v in r.items()}


def test_afd_computes_the_schemes_numbers(tmp_path):
    """Fast: LongCat-Flash, fp8 and w8a8, the fixture's 4 prompts. afd lands where HF with the scheme simulated
    lands (bench.simulated: written from the formats' definitions, not afd's code): both quantize the same
    values but for those within fp32 noise (another order of sums, MLA absorbed) of a rounding boundary, so
    afd against the simulation stays far below the scheme's own error, which a wrong scale, group or
    layer left out would reach. Measured (32 positions): afd against the simulation, median below 1e-5 of
    the largest logit; the simulation against HF, 3-9 %."""
    family = Fp8Family(tmp_path, "longcat_flash")
    r = {m: _measure(family, m, PROMPTS) for m in ("fp8", "w8a8")}
    for m, v in r.items():
        assert v["afd_vs_sim"]["logit_err_median"] <= 1e-3, _brief(r)
        assert v["afd_vs_sim"]["logit_err_median"] <= 0.05 * v["sim_vs_hf"]["logit_err_median"], _brief(r)
        assert v["afd_vs_sim"]["logit_err_max"] <= 0.1, _brief(r)


@pytest.mark.slow
def test_8bit_activations_move_the_logits_within_the_schemes_error(fp8):
    prompts = bench.prompts(fp8.cfg.vocab_size) + PROMPTS
    report = {m: _brief(_measure(fp8, m, prompts)) for m in ("fp8", "w8a8")}
    print(f"{fp8.family}, teacher-forced, {len(prompts) * STEPS} positions: {report}")
