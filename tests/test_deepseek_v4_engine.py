"""DeepSeek-V4 through afd's real engine against HF transformers 5.24 (DeepseekV4ForCausalLM) on tiny random
checkpoints made here (tests/hf_deepseek_v4.py): colocated, greedy tokens identical over 64 new tokens and every
step's logits close, on three configs that together cover every layer type, hash and learned MoE, hc_mult 2 and
4, contexts past the sliding window and past the HCA rate; chunked prefill, prefix caching (off), 1,024-token
prompts, bf16's first step, graph mode (eager); 1A1F, 2A1F and 1A2F under layout.routing attention, and `afd
serve`. V4 is not in tests/test_families.py's shared suite yet (its hash layers need routing attention across
processes)."""

from __future__ import annotations

import pytest
import torch
from hf_deepseek_v4 import BASE, V4_CONFIGS, hf_greedy, make_v4_checkpoint
from hf_reference import PROMPTS, max_rel_err

import afd

NEW_TOKENS = 64
# fp32 on both sides, but not the same kernels in the same order (grouped expert GEMMs, per-sequence attention
# over the paged planes, batch shapes): rounding differs at ~1e-6 of the largest logit (measured: <= 4e-6) and
# grows through the layers; 1e-4 leaves room for another CPU's BLAS, while a wrong op is far above it.
LOGITS_REL_TOL = 1e-4


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """name -> (checkpoint path, HF's greedy ids and logits per prompt), made once per module."""
    root = tmp_path_factory.mktemp("v4")
    made: dict = {}

    def get(name: str):
        if name not in made:
            path = make_v4_checkpoint(str(root / name), **V4_CONFIGS[name])
            made[name] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS))
        return made[name]

    return get


# ---- afd's engine, colocated ------------------------------------------------------------------------------


def _assert_matches(ours: list[list[int]], logits: list, ref) -> None:
    for i, (ref_ids, ref_logits) in enumerate(ref):
        assert len(ref_ids) == NEW_TOKENS  # no early EOS: every step is compared
        assert ours[i] == ref_ids, f"prompt {i}"
        assert max_rel_err(logits[i], ref_logits) <= LOGITS_REL_TOL, f"prompt {i}"


@pytest.mark.parametrize("name", list(V4_CONFIGS))
def test_colocated_greedy_tokens_and_logits_match_hf(v4, name):
    path, ref = v4(name)
    logits: list = []
    llm = afd.LLM(path, dtype="float32", block_size=4)
    _assert_matches(llm.generate_ids(PROMPTS, NEW_TOKENS, logits_out=logits), logits, ref)


def test_chunked_prefill_batched_and_odd_blocks_match_hf(v4):
    """afd's runner driven directly: every prompt prefilled 5 tokens a step, all sequences in one batch cut into
    two micro-batches, blocks of 3 tokens. Windows and compressed entries close across chunk, block and step
    boundaries, from the planes earlier steps wrote; HF prefilled each prompt whole."""
    from afd.dataplane.exchange import LocalMoE
    from afd.engine.kv_cache import KVCache
    from afd.engine.runner import ModelRunner, StepSeq

    path, ref = v4("all_types")
    llm = afd.LLM(path, dtype="float32")
    kv = KVCache(llm.cfg, 256, 3, torch.float32, torch.device("cpu"))
    runner = ModelRunner(llm.attn, LocalMoE(llm.ffn, llm.backend), kv, torch.device("cpu"), micro_batches=2)
    seqs = [list(p) for p in PROMPTS]
    done = [0] * len(seqs)  # tokens in the cache
    tables = [kv.new_table() for _ in seqs]
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(len(s) - len(p) < NEW_TOKENS for s, p in zip(seqs, PROMPTS)):
        step, rows = [], []
        for k, s in enumerate(seqs):
            if len(s) - len(PROMPTS[k]) >= NEW_TOKENS:
                continue
            n = min(5, len(s) - done[k])
            kv.grow(tables[k], done[k] + n)
            step.append(StepSeq(s[done[k] : done[k] + n], done[k], tables[k]))
            rows.append(k)
        out = runner.execute(step).logits
        for r, k in enumerate(rows):
            done[k] += len(step[r].token_ids)
            kv.release_window(tables[k], done[k])
            if done[k] == len(seqs[k]):  # its last token is in: the row is a real next-token prediction
                logits[k].append(out[r])
                seqs[k].append(int(out[r].argmax()))
    _assert_matches([s[len(p) :] for s, p in zip(seqs, PROMPTS)], logits, ref)


def test_1024_token_prompts_decode_with_the_compressed_state(v4):
    """Long context: 1,024- and 700-token prompts, 128x the window, 64 HCA entries and 256 CSA
    entries of which the indexer keeps 3 per query; 16 new tokens identical to HF's, logits within tolerance."""
    path, _ = v4("all_types")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1024, 700)]
    ref = hf_greedy(path, prompts, 16)
    logits: list = []
    out = afd.LLM(path, dtype="float32", block_size=16).generate_ids(prompts, 16, logits_out=logits)
    for i, (ids, ref_logits) in enumerate(ref):
        assert out[i] == ids, f"prompt {i}"
        assert max_rel_err(logits[i], ref_logits) <= LOGITS_REL_TOL, f"prompt {i}"


def test_prefix_caching_is_off_for_v4_with_a_log_line_and_the_same_tokens(v4, caplog):
    """V4's window gives its early blocks back as a sequence advances, so its scheduler turns prefix caching
    off (afd.engine.scheduler) and says why; asked for, it decodes what it decodes without (no hits)."""
    from test_prefix_cache_engine import NEW, generate

    llm = afd.LLM(v4("all_types")[0], block_size=4)
    off, computed_off, *_ = generate(llm, False)
    with caplog.at_level("INFO", logger="afd.engine.scheduler"):
        on, computed_on, (queries, hits), *_ = generate(llm, True)
    assert on == off and all(len(t) == NEW for t in on)
    assert hits == 0 and computed_on == computed_off
    assert "prefix caching off: the model keeps state kinds (window, " in caplog.text


# ---- across processes -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "A,F,micro_batches",
    [
        (1, 1, 2),
        pytest.param(1, 1, 1, marks=pytest.mark.slow),
        *(pytest.param(a, f, m, marks=pytest.mark.slow) for a, f in ((2, 1), (1, 2)) for m in (1, 2)),
    ],
)
def test_across_processes_routed_on_the_attention_side_equals_hf(v4, A, F, micro_batches):
    """afd.LLM's offline worker on node processes at 1A1F, 2A1F and 1A2F (the experts split over two FFN nodes),
    each with one micro-batch and with ping-pong (2). Hash layers route by token id, which only the attention
    side has: under layout.routing attention the router runs there (afd.dataplane.dispatch) and the FFN nodes
    get the expert ids with the rows (routing ffn is refused before any node starts: test below)."""
    path, ref = v4("all_types")
    logits: list = []
    opts = dict(routing="attention", micro_batches=micro_batches, block_size=4)
    with afd.LLM(path, attention_nodes=A, ffn_nodes=F, **opts) as llm:
        out = llm.generate_ids(PROMPTS, NEW_TOKENS, logits_out=logits)
    _assert_matches(out, logits, ref)


def test_routing_ffn_is_refused_before_any_node_starts(v4, tmp_path):
    """Hash layers need the token ids on the router's side: routing ffn is a config error naming the fix, in
    afd.LLM and in `afd launch`'s startup check, not a node that fails at its first hash layer."""
    from afd.cluster.local_config import local_config
    from afd.config.loader import check_routing, from_dict
    from afd.config.schema import ClusterConfigError
    from afd.model.registry import load_config

    path, _ = v4("all_types")
    with pytest.raises(ValueError, match="set layout.routing: attention"):
        afd.LLM(path, attention_nodes=1, ffn_nodes=1, routing="ffn")
    mcfg = load_config(path)
    doc = local_config(1, 1, {"model": {"path": path}, "layout": {"routing": "ffn"}}).to_dict()
    with pytest.raises(ClusterConfigError, match="routers read the token ids"):
        check_routing(from_dict(doc), mcfg)
    check_routing(from_dict({**doc, "layout": {**doc["layout"], "routing": "attention"}}), mcfg)


def test_routing_left_unset_is_attention_where_each_process_starts(v4):
    """vLLM's users never name a routing: unset, a token-id router's family settles on attention from its
    config.json (afd.cluster.topology.with_model_defaults, applied by every node, afd.LLM and check-config),
    at one FFN node as at two; a family whose router does not read the ids keeps the default."""
    from afd.cluster.local_config import local_config
    from afd.cluster.topology import with_model_defaults
    from afd.config.loader import check_routing, from_dict
    from afd.model.registry import load_config

    path, _ = v4("all_types")
    for F in (1, 2):
        unset = from_dict(local_config(1, F, {"model": {"path": path}}).to_dict())
        assert unset.layout.routing is None
        check_routing(unset, load_config(path))  # not refused: every process resolves it before it runs
        assert with_model_defaults(unset).routing == "attention"
    demo = from_dict(local_config(1, 1, {"model": {"path": "demo"}}).to_dict())
    assert with_model_defaults(demo).routing == "ffn" and with_model_defaults(demo).layout.routing is None
    with afd.LLM(path, attention_nodes=1, ffn_nodes=1, block_size=4) as llm:
        assert llm.config.routing == "attention"


def test_bf16_first_step_is_hfs(tmp_path):
    """bf16 (HF's fp32-kept mHC, sinks, ape and norms kept fp32 here too): the prompt's next-token logits
    within bf16 rounding of HF's bf16 model (measured: <= 1.6% of the largest logit) and the same token."""
    from transformers import DeepseekV4ForCausalLM

    path = make_v4_checkpoint(str(tmp_path / "bf16"), weight_std=0.05, **V4_CONFIGS["all_types"])
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager").eval()
    llm = afd.LLM(path, dtype="bfloat16", block_size=4)
    assert llm.attn.layers[1].hc_attn.fn.dtype == llm.attn.layers[1].attn.attn_sink.dtype == torch.float32
    logits: list = []
    out = llm.generate_ids(PROMPTS, 1, logits_out=logits)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float()
        assert out[i][0] == int(ref.argmax()), f"prompt {i}"
        assert (logits[i][0] - ref).abs().max() <= 0.05 * ref.abs().max(), f"prompt {i}"


@pytest.mark.multiprocess
def test_afd_serve_answers_concurrent_requests_with_hfs_tokens(v4, tmp_path):
    """`afd serve` (1A1F, routing attention), every prompt at once, greedy: HF's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_helpers import post
    from serve_helpers import Served, free_port_run

    path, ref = v4("hc2")
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    s = Served([path, "--port", str(port), "--routing", "attention"], tmp_path / "serve.log", [url])
    try:
        s.wait_ready()
        body = {"max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: post(url, "/v1/completions", {**body, "prompt": p}), PROMPTS))
    finally:
        assert s.stop() == 0
    for (code, got), (want, _) in zip(results, ref):
        assert code == 200, got
        assert got["choices"][0]["token_ids"] == want


def test_dummy_weights_route_by_valid_ids_and_a_bad_table_is_refused(v4, tmp_path):
    """afd's dummy reader (seeded floats: bench models) still gives hash layers valid expert ids; a checkpoint's
    tid2eid naming an expert that does not exist is refused at load, not an index error mid-step."""
    import shutil

    from safetensors.torch import load_file, save_file

    from afd.model.checkpoint import CheckpointError

    path = v4("all_types")[0]
    assert len(afd.LLM(path, dummy_weights=True, block_size=4).generate_ids([[1, 2, 3]], 4)[0]) == 4
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.ffn.gate.tid2eid"][5, 0] = BASE["n_routed_experts"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tid2eid"):
        afd.LLM(str(bad), block_size=4).generate_ids([[1, 2, 3]], 1)


def test_graph_mode_runs_v4_eager(v4):
    """V4's attention walks each sequence on the host, which a compiled decode graph would freeze at trace time:
    under graph_mode compile it runs eager (AttentionHalf.supports_graph), with the tokens of eager."""
    path, ref = v4("hc2")
    llm = afd.LLM(path, block_size=4, graph_mode="compile")
    assert llm.generate_ids(PROMPTS, NEW_TOKENS) == [ids for ids, _ in ref]
    assert llm.graph_report is None


def test_preempted_sequences_recompute_their_state_with_hfs_tokens(v4):
    """A cache of 24 free pages of 4 tokens for prompts that grow to 23 blocks, 4 at a time (each sequence holds
    its window's and compressed entries' pages): the newest sequences are preempted, their pages freed, and
    recomputed later (window keys, projections and compressed entries alike) to HF's greedy tokens."""
    from afd.engine.request import Request
    from afd.engine.sampling import SamplingParams
    from afd.engine.scheduler import Scheduler

    path, ref = v4("all_types")
    llm = afd.LLM(path, block_size=4)
    engine = llm.job_engine([[1] * 116], [4], enable_prefix_caching=False)  # 120 tokens: 30 blocks
    kv = engine.runner.kv
    kv.allocator.allocate(kv.allocator.num_free - 24)  # 24 pages left: fewer than the 4 sequences' windows
    engine.scheduler = engine.processor.scheduler = s = Scheduler(kv, 4, 64, False)
    out: list[list[int]] = [[] for _ in PROMPTS]
    for i, p in enumerate(PROMPTS):
        on_output = lambda o, i=i: out[i].extend(o.new_token_ids)  # noqa: E731
        engine.add_request(Request(str(i), list(p), SamplingParams(), NEW_TOKENS, on_output, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert s.num_preemptions > 0
    assert out == [ids for ids, _ in ref]


# ---- on the fake NPU ----------------------------------------------------------------------------------------

_ON_FAKE_NPU = r"""
import json, sys
import torch, torch_npu
from hf_reference import PROMPTS
import afd
llm = afd.LLM(sys.argv[1], dtype="float32", block_size=4, device="npu")
llm.generate_ids(PROMPTS[:2], 2)  # warm: one-time copies (rope tables) are not a step's
before = dict(torch.npu.STATS["host_sync_sites"])
ids = llm.generate_ids(PROMPTS[:2], int(sys.argv[2]))
after = torch.npu.STATS["host_sync_sites"]
syncs = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
print(json.dumps({"ids": ids, "syncs": syncs, "hazards": torch.npu.STATS["hazards"]}))
"""


def test_on_the_fake_npu_a_step_syncs_the_host_once_with_hfs_tokens(v4):
    """Colocated on the fake NPU, whose ops are the CPU's kernels: HF's greedy tokens, and one host sync per step
    (the sampled tokens). V4 attention stages each sequence's block tables through pinned memory; a plain
    torch.tensor(..., device=) per sequence and layer waited for the device."""
    import json
    import os
    import subprocess
    import sys

    from cluster_helpers import ROOT

    path, ref = v4("all_types")
    n = 8
    tests = ROOT / "tests"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests / "fakes"), str(tests)]),
        "AFD_FAKE_NPU_SYNC_SITES": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _ON_FAKE_NPU, path, str(n)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] == [ids[:n] for ids, _ in ref[:2]]
    assert got["hazards"] == []
    # n steps (one prefill, n - 1 decodes), each reading its sampled tokens and nothing else
    syncs = got["syncs"]
    assert all(k.startswith("device-to-host read") and " at engine/sampling.py:" in k for k in syncs), syncs
    assert sum(syncs.values()) == n, syncs
