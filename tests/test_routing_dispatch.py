"""layout.routing attention across real processes: the attention rank routes and sends each token only to the
FFN nodes holding one of its experts (afd/dataplane/dispatch.py). Greedy tokens equal HF's for every family
at 1A2F, 1A3F and 2A2F, with and without ping-pong, with replicated experts and with an int8 exchange; and
the bytes on the wire are the formula's, under half of broadcast's at top-2 of 16 experts on 4 nodes."""

from __future__ import annotations

import os

import pytest
import torch
from cluster_helpers import Cluster, cluster_yaml, get, post
from hf_families import FAMILIES
from hf_reference import PROMPTS, make_hf_checkpoint
from metrics_text import samples, total

import afd
from afd.config.placement import default_placement
from afd.dataplane.protocol import dequantize, dispatch_bytes, exchange_bytes, quantize

pytestmark = pytest.mark.multiprocess
NEW_TOKENS = 12
SLOW = pytest.mark.slow  # the same paths as a default case; `make test-slow` (CI) runs them


def _case(family: str, A: int, F: int, micro_batches: int, default: bool = False):
    return pytest.param(family, A, F, micro_batches, marks=[] if default else [SLOW])


# Every family at 1A2F, 1A3F (the tiny checkpoints' 6, 6 and 8 routed experts: 2 or more per node) and 2A2F,
# with ping-pong (2 micro-batches) and without. The default run: each family once, 1A3F and 2A2F once each,
# ping-pong twice. (2A2F once hung at its first job on a loaded machine: two FFN nodes had taken the two
# attention ranks' pairs at different headers and grouped their steps differently; an FFN node now waits for
# every attention rank's pair before its first step, ffn_node/server.py FFNServer._adopt.)
DEFAULT = {("longcat_flash", 1, 3, 2), ("deepseek_v3", 1, 2, 1), ("qwen3_moe", 1, 2, 1), ("qwen3_moe", 2, 2, 2)}
CASES = [
    _case(family, A, F, mb, default=(family, A, F, mb) in DEFAULT)
    for family in FAMILIES
    for A, F in ((1, 2), (1, 3), (2, 2))
    for mb in (2, 1)
]


def _ffn_log(llm, f: int) -> str:
    with open(os.path.join(llm._local.dir, f"ffn{f}.log")) as fh:
        return fh.read()


@pytest.mark.parametrize("family,A,F,micro_batches", CASES)
def test_routed_generation_equals_hf(llm_pool, families, family, A, F, micro_batches):
    fam = FAMILIES[family]
    llm = llm_pool.get(
        families.path(family, fam.multi),
        attention_nodes=A,
        ffn_nodes=F,
        micro_batches=micro_batches,
        routing="attention",
        block_size=4,
        max_restarts=0,  # a node that fails fails the job at once, with its log
    )
    assert llm.generate_ids(PROMPTS, NEW_TOKENS) == families.ref_ids(family, fam.multi, NEW_TOKENS)
    assert all("(routing attention)" in _ffn_log(llm, f) for f in range(F))


def test_replicated_experts_equal_hf_and_reach_the_nodes(families, tiny_checkpoint):
    """Experts 2 and 3 (of 6) on both nodes: each token's slot on them goes to one holder, by token. afd.LLM
    takes the placement by node name, as the YAML does, and hands its nodes its config whole; the nodes' logs
    say what each loaded."""
    placement = {"ffn0": "0-3", "ffn1": "2-5"}  # a dict: not LLMPool's (hashable) key
    with afd.LLM(
        tiny_checkpoint, ffn_nodes=2, micro_batches=2, placement=placement, max_restarts=0, block_size=4
    ) as llm:
        assert llm.generate_ids(PROMPTS, NEW_TOKENS) == families.ref_ids("longcat_flash", "zero_experts", NEW_TOKENS)
        assert "experts 0-3 of 6 loaded (routing attention)" in _ffn_log(llm, 0)
        assert "experts 2-5 of 6 loaded (routing attention)" in _ffn_log(llm, 1)


# ---- int8 under routing attention ------------------------------------------------------------------------

TEACHER_STEPS = 8
"""Positions per prompt where the logits are compared, each fed HF's greedy tokens before it."""


class _RoutedQuantizedMoE:
    """RoutedMoE's numbers in process: the router and the identity experts on the unquantized MoE input (the
    attention side's), the routed experts on its int8 round trip (what crosses)."""

    def __init__(self, llm, exchange_dtype: str):
        from afd.dataplane.exchange import LocalMoE

        self.inner, self.llm, self.exchange_dtype = LocalMoE(llm.ffn, llm.backend), llm, exchange_dtype
        self.timers = self.inner.timers

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor):
        from afd.dataplane.exchange import Ready

        ffn, backend, E = self.llm.ffn, self.llm.backend, self.llm.cfg.n_routed_experts
        weights, ids = ffn.layer(layer).router(m, backend)  # [T, K]
        zero_w = (weights * (ids >= E)).sum(dim=-1, keepdim=True)  # [T, 1]
        x = dequantize(quantize(m, self.exchange_dtype), self.exchange_dtype, torch.empty_like(m))
        y = ffn.routed(backend, layer, x, weights, torch.where(ids < E, ids, -1))
        return Ready((m * zero_w).to(m.dtype) + y)


def _logits(llm, seqs: list[list[int]], moe=None) -> list[torch.Tensor]:
    """The next-token logits after each sequence: through the nodes, or in process over `moe`."""
    from afd.engine import offline
    from afd.engine.sampling import SamplingParams

    logits: list = []
    if moe is None:
        llm.generate_ids(seqs, 1, ignore_eos=True, logits_out=logits)
    else:
        engine = llm.job_engine(seqs, [1] * len(seqs), moe=moe)
        offline.generate(engine, seqs, [1] * len(seqs), SamplingParams(temperature=0.0), True, logits)
    return [steps[0] for steps in logits]


@SLOW
def test_routed_int8_exchange_is_the_in_process_quantization_and_near_hf(llm_pool, families, tiny_checkpoint):
    """As tests/test_exchange_dtype.py holds routing ffn's int8: the cluster computes what the same quantization
    does in process (here routed on the unquantized input, as the attention node routes before quantizing), up
    to fp32 sums elsewhere; and against HF's logits on HF's greedy tokens, int8's bounds there."""
    ref = families.ref("longcat_flash", "zero_experts")
    seqs, hf = [], []
    for p, (ids, steps) in zip(PROMPTS, ref):
        for k in range(min(TEACHER_STEPS, len(ids))):
            seqs.append(p + ids[:k])
            hf.append(steps[k])
    llm = llm_pool.get(
        tiny_checkpoint, ffn_nodes=2, routing="attention", exchange_dtype="int8", max_restarts=0, block_size=4
    )
    got = _logits(llm, seqs)
    colocated = afd.LLM(tiny_checkpoint)
    for a, b in zip(got, _logits(colocated, seqs, _RoutedQuantizedMoE(colocated, "int8"))):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(got, hf)) / len(hf)
    errs = sorted(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, hf))
    same = llm.generate_ids(PROMPTS, NEW_TOKENS) == families.ref_ids("longcat_flash", "zero_experts", NEW_TOKENS)
    print(
        f"routed int8: top-1 {agree:.3f}, logit err median {errs[len(errs) // 2]:.4f} max {errs[-1]:.4f}; "
        f"free-running tokens equal HF's: {same}"
    )
    assert agree >= 0.9 and errs[-1] < 0.02


# ---- bytes: 1A4F, top-2 of 16 experts --------------------------------------------------------------------

BYTES_MODEL = dict(
    seed=4, hidden_size=128, n_routed_experts=16, moe_topk=2, zero_expert_num=0, expert_ffn_hidden_size=16
)
"""LongCat-Flash without identity experts: every slot crosses. H = 128 fp32 rows (512 bytes) against the 16
bytes of a row's ids and weights."""


@pytest.fixture(scope="module")
def bytes_model(tmp_path_factory) -> str:
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("routing") / "longcat-16x2"), **BYTES_MODEL)


class _RouteCounter:
    """The colocated experts, and per MoE call the rows each FFN node of `owner` would get: the router run
    here on the same hidden states (up to fp32 summation order) as the attention node's."""

    def __init__(self, llm, owner: torch.Tensor):
        from afd.dataplane.exchange import LocalMoE

        self.inner, self.llm, self.owner = LocalMoE(llm.ffn, llm.backend), llm, owner
        self.timers = self.inner.timers
        self.rows: list[list[int]] = []  # per (layer, micro-batch) call: [F]
        self.slots = torch.zeros(len(owner), dtype=torch.int64)  # [E]: tokens per expert

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor):
        _, ids = self.llm.ffn.layer(layer).router(m, self.llm.backend)  # [T, K]
        node = self.owner[ids]  # [T, K]
        self.rows.append([int((node == f).any(dim=-1).sum()) for f in range(int(self.owner.max()) + 1)])
        self.slots += torch.bincount(ids.reshape(-1), minlength=len(self.owner))
        return self.inner.submit(layer, micro_batch, m)


def _routed_in_process(model: str, owner: torch.Tensor) -> _RouteCounter:
    """One job per prompt at one micro-batch: the served cluster's steps below (a prefill, then a decode
    step per further token), so the same (layer, micro-batch) calls."""
    from afd.engine import offline
    from afd.engine.sampling import SamplingParams

    llm = afd.LLM(model)
    counter = _RouteCounter(llm, owner)
    for p in PROMPTS:
        engine = llm.job_engine([p], [NEW_TOKENS], moe=counter)
        offline.generate(engine, [p], [NEW_TOKENS], SamplingParams(temperature=0.0), True, None)
    return counter


def _serve(tmp_path, model: str, routing: str) -> tuple[list, dict, list[dict]]:
    """(token ids per prompt, attn0's samples, each FFN node's) of PROMPTS served one at a time at 1A4F."""
    path = cluster_yaml(tmp_path, model, ffn=4, name=routing, layout={"routing": routing, "micro_batches": 1})
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        out = []
        for p in PROMPTS:  # one at a time: each request's steps hold its tokens alone
            body = {
                "prompt": p,
                "max_tokens": NEW_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
                "return_token_ids": True,
            }
            code, r = post(c.url(), "/v1/completions", body)
            assert code == 200, r
            out.append(r["choices"][0]["token_ids"])
        attn = samples(get(c.url(), "/metrics")[1].decode())
        ffn = [
            samples(get(f"http://127.0.0.1:{c.node(f'ffn{f}')['ports']['metrics']}", "/metrics")[1].decode())
            for f in range(4)
        ]
    return out, attn, ffn


def test_routed_bytes_are_the_formulas_and_under_half_of_broadcast(tmp_path, bytes_model):
    """afd_exchange_bytes_total{to_ffn} of routing attention against (a) what the same requests cost under
    routing ffn, broadcast: F * tokens * H * 4 per layer (exchange_bytes; tests/test_exchange_dtype.py holds a
    broadcast cluster's counter to that formula, so a second, 1A4F broadcast cluster here would only repeat
    it), at most half of it, and (b) the sum over (layer, micro-batch) of dispatch_bytes, the rows per node
    from the router run in process on the same tokens. The FFN nodes' own afd_ffn_tokens_total and
    afd_expert_tokens_total must equal those rows and slots: the counter could otherwise agree with a formula
    fed the attention node's own wrong rows."""
    from afd.model.registry import load_config

    cfg = load_config(bytes_model)
    E, K, H, L = 16, 2, cfg.hidden_size, len(cfg.moe_layers)
    names = [f"ffn{f}" for f in range(4)]
    placement = default_placement(E, names)
    owner = torch.empty(E, dtype=torch.int64)
    for f, held in enumerate(placement.held):
        owner[list(held)] = f
    _, attn, ffn = _serve(tmp_path, bytes_model, "attention")

    tokens = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)  # the prefill makes the first token
    broadcast = len(names) * exchange_bytes(tokens, H, "float32")["to_ffn"] * L
    sent = total(attn, "afd_exchange_bytes_total", direction="to_ffn")
    print(f"routed {sent:.0f} B, broadcast {broadcast:.0f} B: {sent / broadcast:.3f}")
    assert sent <= 0.5 * broadcast

    counter = _routed_in_process(bytes_model, owner)
    assert len(counter.rows) == L * sum(NEW_TOKENS for _ in PROMPTS)  # one call per layer and step
    want = [dispatch_bytes(rows, H, "float32", K) for rows in counter.rows]
    assert sent == sum(w["to_ffn"] for w in want)
    assert total(attn, "afd_exchange_bytes_total", direction="to_attention") == sum(w["to_attention"] for w in want)
    for f in range(4):
        assert total(ffn[f], "afd_ffn_tokens_total") == sum(rows[f] for rows in counter.rows), f
        for e in placement.held[f]:
            assert total(ffn[f], "afd_expert_tokens_total", expert=str(e)) == int(counter.slots[e]), (f, e)
