"""`afd.LLM` as a vLLM user calls it: text or ids in, outputs with text and ids; progress of long work."""

from __future__ import annotations

import logging

import pytest

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


# Fields an offline job's node processes do not need: the serving API's (name, template, context limit:
# afd.LLM checks prompt lengths itself), the serving engine's limits (a job's cache and batch hold exactly
# the job: afd.engine.factory), its shutdown grace, and the sampling seed (LLM(seed=...): not carried yet, the
# offline worker does not seed from it; requests with their own seed sample alike on nodes and colocated).
NOT_FOR_OFFLINE_NODES = {
    "path",  # carried as LocalClusterSpec.model
    "revision",  # a hub name's: afd.LLM hands its nodes the snapshot directory it resolved
    "download_dir",
    "max_model_len",
    "served_model_name",
    "chat_template",
    "kv_cache_bytes",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "shutdown_timeout",
    "enable_log_requests",  # an offline job's nodes open no API
    "enable_prefix_caching",  # a job prefills every prompt in its first step: there is nothing to reuse
    "zero_experts",  # routing ffn's identity-expert holder: a local cluster's is its first FFN node
}


def test_every_model_layout_and_engine_field_reaches_a_local_cluster_s_nodes():
    """afd.LLM hands its node processes a LocalClusterSpec copied field by field (afd.engine.llm._cluster_spec):
    a new config field left out there is silently not applied by the nodes (model.quantization once was)."""
    from dataclasses import fields

    from afd.cluster.local_spec import LocalClusterSpec
    from afd.cluster.schema import EngineSection, Layout, ModelSection

    carried = {f.name for f in fields(LocalClusterSpec)}
    missing = {
        f"{cls.__name__}.{f.name}"
        for cls in (ModelSection, Layout, EngineSection)
        for f in fields(cls)
        if f.name not in carried and f.name not in NOT_FOR_OFFLINE_NODES
    }
    assert not missing, f"carry these in LocalClusterSpec (and _cluster_spec, cluster_doc), or say why not: {missing}"
