"""KV-parallel attention (layout.kvp, afd/model/kvp.py): the same tokens and logits as without it, and
sequences longer than one rank's KV cache.

Block size 4 and prompts of 3 to 11 tokens: no prompt is a multiple of the block size, some sequences
have fewer blocks than there are KV ranks (those ranks attend over nothing for them), and decode batches
shrink from 5 to 3 to 1.
"""

from __future__ import annotations

import urllib.request

import pytest
import test_attention_tp
from hf_reference import hf_greedy, max_rel_err
from test_attention_tp import MAX_TOKENS, PROMPTS

import afd
from afd.engine.kv_cache import BlockAllocator

ckpt, hf = test_attention_tp.ckpt, test_attention_tp.hf  # the same checkpoint and HF reference (fixtures)


def generate(ckpt, tp: int, kvp: int, colocated: bool, mode: str = "allreduce"):
    llm = afd.LLM(
        ckpt,
        block_size=4,
        attention_tp=tp,
        kvp=kvp,
        tp_comm=mode,
        tp_comm_min_tokens=1,
        **({"colocated": True} if colocated else {"attention_nodes": 1, "ffn_nodes": 1}),
    )
    logits: list = []
    return llm.generate_ids(PROMPTS, MAX_TOKENS, logits_out=logits), logits


@pytest.mark.parametrize(
    "tp,kvp,colocated,mode",
    [
        (2, 2, True, "allreduce"),
        pytest.param(4, 4, False, "allreduce", marks=pytest.mark.slow),
        pytest.param(4, 4, True, "allreduce", marks=pytest.mark.slow),
        pytest.param(2, 2, False, "sp", marks=pytest.mark.slow),
        pytest.param(4, 2, False, "flashcomm1", marks=pytest.mark.slow),  # two head groups of two KV ranks
    ],
)
def test_kvp_equals_hf_and_the_path_without_it(ckpt, hf, tp, kvp, colocated, mode):
    ids, logits = generate(ckpt, tp, kvp, colocated, mode)
    _, plain = generate(ckpt, tp, 1, colocated, mode)
    for i, (hf_ids, hf_logits) in enumerate(hf):
        assert ids[i] == hf_ids, f"prompt {i}"
        assert max_rel_err(logits[i], plain[i]) <= 1e-4, f"prompt {i}: logits off the non-KVP path"
        assert max_rel_err(logits[i], hf_logits) <= 1e-4, f"prompt {i}: logits off HF"


@pytest.mark.slow  # two afd serve clusters; CI runs test-slow
def test_kvp_buys_context(ckpt, tmp_path):
    """Three 16-token blocks per rank (48 tokens): a 60-token prompt is refused on one KV rank and served,
    with HF's tokens, on two."""
    from cluster_helpers import post
    from serve_helpers import Served, free_port_run

    prompt = [(7 * i + 3) % 97 for i in range(60)]
    ref = hf_greedy(ckpt, [prompt], 4)[0][0]
    block_bytes = 2 * 2 * 16 * (8 + 4) * 4  # layers x MLAs per layer x block size x (C + R) x fp32
    results = {}
    for kvp in (1, 2):
        port = free_port_run(1)
        url = f"http://127.0.0.1:{port}"
        s = Served(
            [
                ckpt,
                "--port",
                str(port),
                "--kv-cache-bytes",
                str(3 * block_bytes),
                "--attention-tp",
                "2",
                "--kvp",
                str(kvp),
            ],
            tmp_path / f"kvp{kvp}.log",
            [url],
        )
        try:
            s.wait_ready()
            results[kvp] = post(
                url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            )
            with urllib.request.urlopen(f"{url}/metrics") as r:
                metrics = r.read().decode()
            assert ('afd_kv_cache_rank_usage_ratio{kv_rank="1"' in metrics) == (kvp == 2)
        finally:
            assert s.stop() == 0
    code, body = results[1]
    assert code == 400 and "48" in str(body), body  # the context one rank holds
    code, body = results[2]
    assert code == 200, body
    assert body["choices"][0]["token_ids"] == ref


def test_the_allocator_deals_blocks_round_robin():
    a = BlockAllocator(12, pools=3)
    table = a.allocate(5)
    assert [g % 3 for g in table] == [0, 1, 2, 0, 1]  # the i-th block from pool i % 3
    more = a.allocate(2, have=5)
    assert [g % 3 for g in more] == [2, 0]
    assert a.pool_usage() == [0.75, 0.5, 0.5]
    assert a.can_allocate(6, 3)  # indices 6, 7, 8: one block from each pool
    assert not a.can_allocate(6, 4)  # index 9 needs a second block from pool 0, which has one left
    a.free(table + more)
    assert a.num_free == 12 and a.pool_usage() == [0.0, 0.0, 0.0]


def test_kvp_must_divide_attention_tp():
    from afd.config.tp import TPConfig, TPConfigError

    with pytest.raises(TPConfigError, match="layout.kvp: 3 KV-parallel ranks must divide layout.attention_tp = 4"):
        TPConfig(4, kvp=3)


def test_kvp_without_tp_ranks_is_refused_colocated_too(tiny_checkpoint, capsys):
    """afd.LLM and afd serve --colocated check the TP flags as the YAML does, rather than dropping them."""
    from afd.config.schema import ClusterConfigError
    from afd.entrypoints.cli import main

    with pytest.raises(ClusterConfigError, match="layout.kvp"):
        afd.LLM(tiny_checkpoint, kvp=2)
    assert main(["serve", tiny_checkpoint, "--colocated", "--kvp", "2", "--print-config"]) != 0
    assert "layout.kvp" in capsys.readouterr().err
