"""`afd.LLM` as a vLLM user calls it: text or ids in, outputs with text and ids; progress of long work."""

from __future__ import annotations

import logging

import pytest
import yaml

import afd
from afd.model.progress import Progress


@pytest.fixture(scope="module")
def demo_llm():
    return afd.LLM("demo")


def test_generate_takes_text_and_returns_text_and_ids(demo_llm):
    tok = demo_llm.tokenizer
    out = demo_llm.generate(["Experts are", "Attention is"], max_tokens=6, ignore_eos=True, temperature=0)
    assert [o.prompt for o in out] == ["Experts are", "Attention is"]
    for o in out:
        c = o.outputs[0]
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert c.token_ids == demo_llm.generate_ids([o.prompt_token_ids], 6, ignore_eos=True)[0]
        assert c.text == tok.decode(c.token_ids) and c.finish_reason == "length" and len(c.token_ids) == 6


def test_generate_takes_one_prompt_or_ids_and_defaults_to_16_tokens(demo_llm):
    (one,) = demo_llm.generate("Experts are", ignore_eos=True, temperature=0)
    (ids,) = demo_llm.generate([one.prompt_token_ids], ignore_eos=True, temperature=0)
    assert ids.prompt is None and ids.outputs[0].token_ids == one.outputs[0].token_ids
    assert len(one.outputs[0].token_ids) == 16


def test_colocated_with_node_counts_is_refused():
    with pytest.raises(ValueError, match="colocated runs both halves"):
        afd.LLM("demo", colocated=True, attention_nodes=2)


def test_progress_writes_plain_lines_when_not_on_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="afd.progress"), Progress(4, "loading", "tensors", every_s=0) as p:
        for _ in range(4):
            p.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("loading: 4/4 tensors (100%") and "\r" not in "".join(lines)


def test_every_config_field_reaches_a_local_cluster_s_nodes():
    """A multi-process afd.LLM hands its nodes its own config, written whole as the YAML they start from: each
    section the nodes read back equals the LLM's, whatever field was set (once fields were copied one by one
    into a second spec, and a new one left out was silently not applied)."""
    from afd.cluster.local import LocalCluster
    from afd.config.loader import from_dict
    from afd.config.sections import SECTION_KEYS

    llm = afd.LLM(
        "demo",
        ffn_nodes=1,
        dummy_weights=True,
        enable_prefix_caching=False,
        max_num_seqs=3,
        kv_cache_bytes=1 << 26,
        comm_timeout=7.0,
        exchange_dtype="int8",
        block_size=8,
        sampling_seed=5,
    )
    assert llm.cluster is not None
    cluster = LocalCluster(llm.cluster)
    cluster.processes.start_all = lambda commands: None  # no node processes: the YAML is what is checked
    try:
        cluster.start()
        with open(f"{cluster.dir}/cluster.yaml") as f:
            nodes_read = from_dict(yaml.safe_load(f))
    finally:
        cluster.stop()
    for key in SECTION_KEYS:
        assert getattr(nodes_read, key) == getattr(llm.config, key), key
    assert nodes_read.engine.max_num_seqs == 3 and nodes_read.cluster.comm_timeout == 7.0


def test_a_job_s_engine_limits_reach_the_node_that_runs_it():
    """afd.LLM(max_num_seqs=3, enable_prefix_caching=False) with node processes: the attention node's engine
    runs at most 3 sequences at once, without prefix caching (its report says what it used), and five
    prompts still come back with the colocated engine's greedy tokens."""
    from afd.cluster.local import LocalCluster
    from afd.engine.sampling import SamplingParams

    prompts = [[3 + i, 4, 5, 6] for i in range(5)]
    llm = afd.LLM("demo", ffn_nodes=1, enable_prefix_caching=False, max_num_seqs=3)
    with LocalCluster(llm.cluster) as cluster:
        cluster.start()
        out, reports = cluster.generate(prompts, 4, SamplingParams(temperature=0), ignore_eos=True)
    assert reports[0]["limits"] == {"max_num_seqs": 3, "prefix_caching": False}
    assert reports[0]["steps"][0]["tokens"] == 3 * 4  # three prompts admitted, prefilled whole
    alone = afd.LLM("demo", enable_prefix_caching=False, max_num_seqs=3)
    assert out == alone.generate_ids(prompts, 4, ignore_eos=True)
