"""The family conformance suite: every registered family through every shared path, against HF
transformers on the same tiny checkpoints (tests/hf_families.py; made once per session, conftest.py).

What one family does and the others do not (DeepSeek's dense-first layers and shared experts, Qwen3's
mlp_only_layers, LongCat's identity experts, ...) is tested in that family's own file."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from bf16_parity import (
    MAX_MEAN_REL,
    MIN_CLOSE,
    MIN_TOP1,
    afd_teacher_forced,
    grouped_mm_runs,
    hf_bf16,
    hf_router,
    hf_teacher_forced,
    parity,
    random_sequences,
)
from cluster_helpers import post
from conftest import REF_TOKENS
from hf_families import FAMILIES
from hf_reference import PROMPTS, max_rel_err
from hub_cache import lay_out
from serve_helpers import Served, free_port_run

import afd
from afd.backend.cpu import ROW_MAJOR_ENV
from afd.model import registry
from afd.model.checkpoint import SafetensorsReader, build_ffn_half
from afd.model.config import ConfigError, eos_ids
from afd.model.registry import config_from_hf, load_config

COLOCATED = [(f, name) for f, fam in FAMILIES.items() for name in fam.configs]

# fp32 on both sides, but not the same kernels in the same order (MLA's absorbed decode, grouped expert
# GEMMs, another batch shape): rounding differs at ~1e-6 of the largest logit and grows through the
# layers; 1e-4 leaves room for another CPU's BLAS picking other kernels, while a wrong op is far above.
LOGITS_REL_TOL = 1e-4


# DeepSeek-V4 is held to HF in tests/test_deepseek_v4.py until it runs every shared path here
# (bf16, serving, routing ffn; its hash layers need layout.routing attention across processes).
OWN_SUITE = {"deepseek_v4"}


def test_every_registered_family_is_in_the_suite():
    assert set(FAMILIES) == set(registry.FAMILIES) - OWN_SUITE


# ---- config.json: a missing key takes HF's default ----------------------------------------------------


def _hf_config(family: str):
    import transformers

    return getattr(transformers, FAMILIES[family].hf_config)


def _hf_view(hf, ours) -> dict:
    """HF's value of every afd field, in afd's terms."""
    out = {}
    for f in dataclasses.fields(ours):
        if f.name == "rope_theta":
            out[f.name] = hf.rope_parameters["rope_theta"]
        elif f.name == "eos_token_ids":
            out[f.name] = eos_ids(hf.eos_token_id)
        elif f.name == "zero_expert_num":
            out[f.name] = hf.zero_expert_num or 0  # HF's MoE reads `zero_expert_num or 0`
        elif f.name == "head_dim" and hf.model_type == "qwen3_moe":  # Qwen3MoeAttention's fallback
            out[f.name] = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        elif f.name == "mlp_only_layers":
            out[f.name] = tuple(hf.mlp_only_layers)
        elif f.name.startswith("rope_") and not hasattr(hf, f.name):  # rope_type and YaRN's rope_<key>
            out[f.name] = hf.rope_parameters.get(f.name, hf.rope_parameters.get(f.name[5:]))
        else:
            out[f.name] = getattr(hf, f.name)
    return out


def _full_config(family: str) -> dict:
    return _hf_config(family)(**FAMILIES[family].base).to_dict()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_defaults_are_hf_defaults(family):
    ours = config_from_hf({"model_type": family})
    assert dataclasses.asdict(ours) == _hf_view(_hf_config(family)(), ours)


@pytest.mark.parametrize(
    "family,key", [(f, k) for f in FAMILIES for k in sorted(set(_full_config(f)) - {"model_type"})]
)
def test_missing_key_takes_hf_default_or_is_named(family, key):
    """Each key of a saved config.json left out in turn: afd reads what transformers would build, or
    refuses naming the key. (Before the family configs, afd's own defaults for LongCat's rope_theta,
    zero_expert_num and routed_scaling_factor differed from HF's.)"""
    d = {k: v for k, v in _full_config(family).items() if k != key}
    try:
        ours = config_from_hf(d)
    except ConfigError as e:
        assert f"'{key}'" in str(e)
        return
    hf = _hf_config(family)(**{k: v for k, v in d.items() if k != "model_type"})
    assert dataclasses.asdict(ours) == _hf_view(hf, ours)


# ---- fp32: colocated, across processes, `afd serve` ---------------------------------------------------


def _assert_matches_hf(family: str, ours: list[list[int]], logits: list, ref) -> None:
    """The same greedy tokens (and stop) and every step's logits within LOGITS_REL_TOL."""
    for i, (ref_ids, ref_logits) in enumerate(ref):
        if FAMILIES[family].full_length:
            assert len(ref_ids) == REF_TOKENS  # no early EOS: every step is compared
        assert ours[i] == ref_ids, f"prompt {i}"
        assert max_rel_err(logits[i], ref_logits) <= LOGITS_REL_TOL, f"prompt {i}"


@pytest.mark.parametrize("family,name", COLOCATED)
def test_colocated_greedy_tokens_and_logits_match_hf(families, family, name):
    logits: list = []
    llm = afd.LLM(families.path(family, name), dtype="float32", block_size=4)
    _assert_matches_hf(
        family, llm.generate_ids(PROMPTS, REF_TOKENS, logits_out=logits), logits, families.ref(family, name)
    )


def _across_processes() -> list:
    """(family, A, F, overlap, micro_batches) cases. The default suite runs 1A1F for the families whose
    offline worker no other default case runs (LongCat-Flash's 1A1F is tests/test_dataplane.py's); the
    other layouts, and LongCat's, run in make test-slow."""
    layouts = [(1, 1, True, 1), (2, 1, False, 1), (1, 2, True, 2)]  # 1A2F: the experts split over two nodes
    return [
        pytest.param(family, *lay, marks=[pytest.mark.slow] if lay[:2] != (1, 1) or family == "longcat_flash" else [])
        for family in FAMILIES
        for lay in layouts
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("family,A,F,overlap,micro_batches", _across_processes())
def test_afd_across_processes_equals_hf(families, family, A, F, overlap, micro_batches):
    """afd.LLM's offline worker on node processes: greedy tokens and every step's logits."""
    name = FAMILIES[family].multi
    llm = afd.LLM(
        families.path(family, name),
        attention_nodes=A,
        ffn_nodes=F,
        overlap=overlap,
        micro_batches=micro_batches,
        block_size=4,
    )
    logits: list = []
    out = llm.generate_ids(PROMPTS, REF_TOKENS, logits_out=logits)
    _assert_matches_hf(family, out, logits, families.ref(family, name))


TOP_LOGPROBS = 5


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, families, tmp_path_factory) -> tuple[str, list]:
    """One `afd serve` cluster (1A1F) per family, asked for every prompt at once, greedy, with the
    logprobs of the chosen and the top tokens: (family, [(HTTP code, body)] per prompt)."""
    family = request.param
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    model, env = families.path(family, FAMILIES[family].multi), {}
    if family == "qwen3_moe":  # served by a hub name, from a cache laid out as the hub does, offline
        cache = log.parent / "hub"
        lay_out(cache, "afd-tests/tiny-qwen3-moe", model)
        model, env = "afd-tests/tiny-qwen3-moe", {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    s = Served([model, "--port", str(port)], log, [url], env)
    try:
        s.wait_ready()
        body = {"max_tokens": REF_TOKENS, "temperature": 0, "return_token_ids": True, "logprobs": TOP_LOGPROBS}
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: post(url, "/v1/completions", {**body, "prompt": p}), PROMPTS))
    finally:
        assert s.stop() == 0
    return family, results


@pytest.mark.multiprocess
def test_afd_serve_answers_concurrent_requests_with_hfs_tokens(families, served):
    family, results = served
    for (code, got), want in zip(results, families.ref_ids(family, FAMILIES[family].multi)):
        assert code == 200, got
        assert got["choices"][0]["token_ids"] == want


@pytest.mark.multiprocess
def test_afd_serve_logprobs_are_hfs(families, served):
    """The logprobs of the chosen and the top tokens at every step are HF's log-softmax: a logprob is a
    logit minus their logsumexp, each within LOGITS_REL_TOL of the largest |logit|, hence 2x."""
    family, results = served
    for (_, got), (ids, ref_logits) in zip(results, families.ref(family, FAMILIES[family].multi)):
        lp = got["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids)
        for tok, chosen, top, ref in zip(ids, lp["token_logprobs"], lp["top_logprobs"], ref_logits):
            want, tol = torch.log_softmax(ref, dim=-1), 2 * LOGITS_REL_TOL * ref.abs().max().item()
            assert abs(chosen - want[tok].item()) <= tol
            assert len(top) == TOP_LOGPROBS
            for text, value in top.items():
                assert abs(value - want[int(text.removeprefix("token_id:"))].item()) <= tol, text


# ---- bf16 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_teacher_forced_logits_match_hf_bf16(families, family):
    """Tolerances and why: tests/bf16_parity.py. HF as a user loads it (its default experts), except where
    HF cannot run the fixture on the CPU: then HF's eager experts (grouped_mm_runs says which and why)."""
    path = families.path(family, "bf16")
    cfg = load_config(path)
    seqs = random_sequences(cfg.vocab_size)
    hf = hf_bf16(path) if grouped_mm_runs(cfg) else hf_bf16(path, experts_implementation="eager")
    got = parity(afd_teacher_forced(path, seqs), hf_teacher_forced(hf, seqs))
    assert got["top1"] >= MIN_TOP1, got
    assert got["close"] >= MIN_CLOSE, got
    assert got["mean_rel"] <= MAX_MEAN_REL, got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_router_precision_is_hfs(families, family, dtype, monkeypatch):
    """afd's router holds the values HF's holds after from_pretrained(dtype=...) and routes a batch as
    HF's does, bit for bit (the same elementwise ops and one small GEMM in the same dtype on both sides).
    DeepSeek keeps classifier and bias unrounded in fp32 (its strict fp32 list); LongCat rounds both to
    bf16 and upcasts them (its fp32 list is fp16-only); Qwen3 routes in dtype. Bit for bit holds only
    where both sides run the same GEMM kernel: afd's CPU weight layout (column-major) makes MKL take
    another kernel than HF's row-major weight, and the two round differently on some CPUs (an AVX-512
    EPYC; this machine under make test-avx2), so the layout is off here."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(ROW_MAJOR_ENV, "1")

    path = families.path(family, "bf16")
    cfg = load_config(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    ffn = build_ffn_half(cfg, SafetensorsReader(path), dtype, torch.device("cpu"))
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    for i in cfg.moe_layers:
        ours, theirs = ffn.layer(i).router, hf_router(hf, family, i)
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
