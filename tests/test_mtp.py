"""MTP speculative decoding: lossless greedy, the acceptance transformers' layers predict, the
MTP forward against them, the rejection rule's distribution, and the paths that refuse it.

Each family's checkpoint carries an MTP module written by tests/hf_mtp.py whose drafts are right a
share of the time set by its weights (noise 0.1 on a main model damped to 0.1): LongCat-Flash's about
two thirds, DeepSeek-V3's about a quarter, so both accepted and rejected drafts occur in every run.
"""

from __future__ import annotations

import pytest
import torch
from hf_mtp import MTPReference, add_mtp, expected
from hf_reference import PROMPTS, greedy_with_logits, max_rel_err

import afd
from afd.dataplane.exchange import LocalMoE
from afd.engine import offline
from afd.engine.kv_cache import KVCache, blocks_needed
from afd.engine.request import Request
from afd.engine.runner import ModelRunner, StepSeq
from afd.engine.sampling import SamplingParams

NEW_TOKENS = 32
FAMILIES = ("longcat_flash", "deepseek_v3")


@pytest.fixture(scope="module")
def ckpts(families, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp")
    plain = {
        "longcat_flash": families.path("longcat_flash", "zero_experts"),
        "deepseek_v3": families.path("deepseek_v3", "grouped"),
    }
    return {f: add_mtp(plain[f], str(root / f"{f}_mtp"), f, noise=0.1, damp=0.1) for f in FAMILIES}


@pytest.fixture(scope="module")
def refs(ckpts):
    """family -> (MTPReference, HF's greedy ids per prompt), made on first use."""
    cache: dict = {}

    def ref(family: str):
        if family not in cache:
            r = MTPReference(ckpts[family], family)
            cache[family] = r, [ids for ids, _ in greedy_with_logits(r.main, PROMPTS, NEW_TOKENS)]
        return cache[family]

    return ref


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_hfs_and_acceptance_is_the_references(ckpts, refs, family):
    """Greedy tokens with MTP on (N = 1, 2) equal those with it off and HF's, with logits within 1e-4 of
    the off run's at every token; the drafts and accepted tokens afd counts are exactly those that
    transformers' layers running the same MTP module over whole sequences predict."""
    ref, hf_ids = refs(family)
    off_logits: list = []
    off = afd.LLM(ckpts[family], block_size=4).generate_ids(PROMPTS, NEW_TOKENS, logits_out=off_logits)
    assert off == hf_ids and all(len(ids) == NEW_TOKENS for ids in off)
    for n in (1, 2):
        llm = afd.LLM(ckpts[family], block_size=4, speculative_tokens=n)
        logits: list = []
        assert llm.generate_ids(PROMPTS, NEW_TOKENS, logits_out=logits) == hf_ids, f"N={n}"
        assert max(max_rel_err(a, b) for a, b in zip(logits, off_logits)) <= 1e-4
        want = [sum(c) for c in zip(*(expected(ref, p, ids, n) for p, ids in zip(PROMPTS, hf_ids)))]
        got = llm.spec_decode
        assert [got["num_drafts"], got["num_draft_tokens"], got["num_accepted_tokens"]] == want, f"N={n}"
        assert 0.1 < got["num_accepted_tokens"] / got["num_draft_tokens"] < 0.9  # both outcomes, often
        assert sum(got["num_accepted_tokens_per_pos"]) == got["num_accepted_tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_forward_matches_transformers(ckpts, refs, family):
    """The MTP module over the paged cache, in chunks (prefill, then single-token decode steps, then a
    chained draft on its own hidden state), gives transformers' layers' logits at every position."""
    ref, hf_ids = refs(family)
    seq = PROMPTS[0] + hf_ids[0]
    H = ref.hidden(seq)
    want = ref.main.lm_head(ref.mtp(seq[1:], H[:-1])).detach()  # [T - 1, V]
    llm = afd.LLM(ckpts[family], block_size=4, speculative_tokens=1)
    kv = KVCache(llm.cfg, 32, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(llm.attn, LocalMoE(llm.ffn, llm.backend), kv, torch.device("cpu"), mtp=llm.mtp)
    table: list[int] = []
    kv.grow(table, len(seq))
    hidden = runner.execute([StepSeq(seq, 0, table)]).hidden
    assert hidden is not None
    torch.testing.assert_close(hidden, H, rtol=1e-4, atol=1e-4)
    ends = [len(PROMPTS[0]) + 3, len(PROMPTS[0]) + 4, len(PROMPTS[0]) + 5, len(seq) - 1]
    start, h_last = 0, None
    for end in ends:  # positions [start, end): tokens seq[start + 1 .. end]
        out = runner.mtp_step([StepSeq(seq[start + 1 : end + 1], start, table)], hidden[start:end])
        h_last, logits = out.hidden, out.logits
        assert max_rel_err([logits[0]], [want[end - 1]]) <= 1e-4, end
        start = end
    draft = int(logits[0].argmax())
    chained_want = ref.main.lm_head(ref.mtp(seq[1:] + [draft], torch.cat([H[:-1], ref.mtp(seq[1:], H[:-1])[-1:]]))[-1])
    chained = runner.mtp_step([StepSeq([draft], len(seq) - 1, table)], h_last).logits
    assert max_rel_err([chained[0]], [chained_want.detach()]) <= 1e-4


def test_rejected_drafts_roll_the_kv_cache_back(ckpts):
    """After every step a running request's block table holds exactly the blocks of its cached tokens and
    of the positions its chained draft wrote in the MTP cache (rejected drafts' blocks are freed), and
    with a cache too small for all prompts at once (preemption, recompute with drafts pending) the tokens
    still equal those of decoding one at a time."""
    llm = afd.LLM(ckpts["longcat_flash"], block_size=4, speculative_tokens=2)
    moe = LocalMoE(llm.ffn, llm.backend)
    per = [NEW_TOKENS] * len(PROMPTS)
    engine = llm.job_engine(PROMPTS, per, moe)
    out: list[list[int]] = [[] for _ in PROMPTS]
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            Request(str(i), list(p), SamplingParams(), NEW_TOKENS, lambda o, i=i: out[i].extend(o.new_token_ids))
        )
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            assert len(req.block_table) == blocks_needed(req.num_computed + max(0, req.num_drafts - 1), 4)
            assert req.num_computed == req.num_tokens - 1
    assert engine.scheduler.kv.allocator.num_free == engine.scheduler.kv.allocator.num_blocks
    want = afd.LLM(ckpts["longcat_flash"], block_size=4).generate_ids(PROMPTS, NEW_TOKENS)
    assert out == want
    # a cache that holds the longest request alone: the scheduler preempts, drafts and all
    small = llm.job_engine(PROMPTS[:1], per[:1], moe)
    small.scheduler.max_num_seqs = len(PROMPTS)
    small.scheduler.max_tokens = 64
    got = offline.generate(small, PROMPTS, per, SamplingParams())
    assert got == want and small.scheduler.num_preemptions > 0


@pytest.mark.slow  # CI runs it in make test-slow; a default case covers the same path
@pytest.mark.multiprocess
@pytest.mark.parametrize("F", [1, 2], ids=["1A1F", "1A2F-routed"])
def test_afd_speculates_across_the_data_plane(ckpts, refs, F):
    """DeepSeek-V3's MTP block sends its MoE input to the FFN nodes (FLAG_MTP steps): HF's greedy tokens, and
    the colocated run's acceptance counters; at 1A2F the attention node routes the MTP layer's tokens too."""
    _, hf_ids = refs("deepseek_v3")
    llm = afd.LLM(ckpts["deepseek_v3"], attention_nodes=1, ffn_nodes=F, block_size=4, speculative_tokens=2)
    assert llm.generate_ids(PROMPTS, NEW_TOKENS) == hf_ids
    colocated = afd.LLM(ckpts["deepseek_v3"], block_size=4, speculative_tokens=2)
    colocated.generate_ids(PROMPTS, NEW_TOKENS)
    assert llm.spec_decode == colocated.spec_decode and llm.spec_decode["num_accepted_tokens"] > 0


@pytest.mark.slow  # the default fake-NPU case covers the same checks without drafts
@pytest.mark.multiprocess
def test_drafts_never_reach_the_host_on_the_fake_npu(ckpts, refs, tmp_path):
    """One host sync per step with MTP: a DeepSeek-V3 1A1F cluster drafting 2 tokens a step on the fake NPU
    learns only its sampled tokens on the host, once per step (the drafts stay on the device from the MTP module
    to the next step's verification), and its greedy tokens are HF's."""
    from cluster_helpers import Cluster, cluster_yaml, post
    from npu_fake import check_one_host_sync_per_step, on_devices, snapshot, sync_env

    _, hf_ids = refs("deepseek_v3")
    path = cluster_yaml(tmp_path, ckpts["deepseek_v3"], name="mtp-npu", engine={"speculative_tokens": 2})
    on_devices(path)
    report = tmp_path / "fake-npu"
    with Cluster(path, env=sync_env(report)) as c:
        c.start_all()
        c.wait_ready(timeout=120)
        for prompt, want in zip(PROMPTS, hf_ids):
            body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
            code, out = post(c.url("attn0"), "/v1/completions", body)
            assert code == 200 and out["choices"][0]["token_ids"] == want, out
        check_one_host_sync_per_step(c.url("attn0"), snapshot(report, c), {"attn0": "attention", "ffn0": "ffn"})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_afd_1a1f_longcat_n1(ckpts, refs):
    _, hf_ids = refs("longcat_flash")
    llm = afd.LLM(ckpts["longcat_flash"], attention_nodes=1, ffn_nodes=1, block_size=4, speculative_tokens=1)
    assert llm.generate_ids(PROMPTS, NEW_TOKENS) == hf_ids


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "family,n,extra",
    [
        ("deepseek_v3", 2, []),  # `afd serve`'s 1A1F cluster
        pytest.param("longcat_flash", 1, ["--colocated"], marks=pytest.mark.slow),
    ],
)
def test_afd_serve_speculates_and_counts(ckpts, refs, tmp_path, family, n, extra):
    """Concurrent completions through `afd serve --speculative-tokens N` are HF's greedy tokens, and
    /metrics counts drafts and accepted tokens under vLLM's names."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_helpers import get, post
    from metrics_text import total
    from serve_helpers import Served, free_port_run

    _, hf_ids = refs(family)
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    s = Served(
        [ckpts[family], "--port", str(port), "--speculative-tokens", str(n), *extra], tmp_path / "serve.log", [url]
    )
    try:
        s.wait_ready()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(
                pool.map(
                    lambda p: post(
                        url,
                        "/v1/completions",
                        {"prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True},
                    ),
                    PROMPTS,
                )
            )
        code, body = get(url, "/metrics")
    finally:
        assert s.stop() == 0
    for (status, out), ids in zip(results, hf_ids):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == ids
    text = body.decode()
    drafted, accepted = (total(text, f"afd_spec_decode_num_{k}_total") for k in ("draft_tokens", "accepted_tokens"))
    assert total(text, "afd_spec_decode_num_drafts_total") > 0 and 0 < accepted < drafted
    assert (
        sum(total(text, "afd_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(n))
        == accepted
    )


def test_speculation_is_refused_where_it_cannot_run(ckpts, tiny_checkpoints, tmp_path):
    from cluster_helpers import cluster_yaml

    from afd.config.loader import load
    from afd.config.schema import ClusterConfigError
    from afd.model.checkpoint import CheckpointError
    from afd.model.config import ConfigError

    with pytest.raises(ValueError, match="attention_tp 1"):
        afd.LLM(ckpts["deepseek_v3"], attention_nodes=1, ffn_nodes=1, attention_tp=2, speculative_tokens=1)
    with pytest.raises(ValueError, match="0 .off., 1 or 2"):
        afd.LLM(ckpts["deepseek_v3"], speculative_tokens=3)
    for layout, needle in (({"attention_tp": 2}, "layout.attention_tp 2"), ({"attention_tp": 2, "kvp": 2}, "kvp")):
        path = cluster_yaml(tmp_path, ckpts["deepseek_v3"], layout=layout, engine={"speculative_tokens": 1})
        with pytest.raises(ClusterConfigError, match=f"engine.speculative_tokens: .*{needle}"):
            load(str(path))
    path = cluster_yaml(tmp_path, ckpts["deepseek_v3"], engine={"speculative_tokens": 3})
    with pytest.raises(ClusterConfigError, match="engine.speculative_tokens: must be 0"):
        load(str(path))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.mtp\.layers\.0\..*' not found"):  # no MTP module
        afd.LLM(tiny_checkpoints["zero_experts"], speculative_tokens=1)
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text('{"model_type": "qwen3_moe"}')
    with pytest.raises(ConfigError, match="qwen3_moe has no multi-token-prediction module"):
        afd.LLM(str(qwen), dummy_weights=True, speculative_tokens=1)


def test_an_ffn_node_without_the_mtp_layer_drops_an_mtp_step():
    """A peer whose header asks for the MTP layer from an FFN node started without it is dropped with
    the reason, never served wrong layers (afd.dataplane.protocol, FLAG_MTP)."""
    from types import SimpleNamespace

    from afd.dataplane.protocol import FLAG_MTP, StepHeader
    from afd.observability.timing import Timers
    from ffn_node.loop_time import LoopTime
    from ffn_node.peers import Peers
    from ffn_node.server import FFNServer

    server = FFNServer.__new__(FFNServer)
    server.ffn = SimpleNamespace(mtp_layers=(), cfg=SimpleNamespace(moe_layers=(0, 1)))
    server.plane = SimpleNamespace(
        irecv=lambda t, r: None, wait=lambda w, r, what: None, check=lambda: None, abort=lambda *a: None
    )
    server.peers = peers = Peers(server.plane, torch.device("cpu"))
    peers.active, peers.next_step, peers.names = [0], {0: 0}, {0: "attn0"}
    peers.headers = {0: StepHeader(0, (3,), FLAG_MTP).encode()}
    server.metrics, server.timers = None, Timers()
    server.time = LoopTime(None, server.timers, None, None)
    assert server._recv_headers() == {}
    assert "holds no MTP layer" in server.peers.gone[0]
