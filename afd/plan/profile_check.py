"""The cluster itself (`afd profile` without --no-cluster): the YAML's model at 1A1F on this machine
(afd.cluster.local, the nodes `afd launch` starts), overlap, exchange dtype and routing as the YAML says and
one micro-batch. Per batch
size it measures

- the decode step of attention node 0 (its step reports: seconds, ffn_wait), to hold the fitted pieces and
  the link against the step they should add up to;
- the FFN node's compute per MoE layer pass against the token-expert rows it computed, from its own
  per-layer counters (afd_ffn_layer_compute_seconds_total{layer}, afd_expert_tokens_total, afd_ffn_tokens_total
  on its /metrics) read before and after a job of one-token prompts: every forward step of that job,
  the prefill included, is a pass of exactly `batch` rows, so no prefill has to be subtracted (the FFN half's
  cost does not depend on the context).

The nodes are started once and take an untimed warm-up job, then two jobs per batch size.
"""

from __future__ import annotations

import statistics
import time
import urllib.request


def ffn_counters(text: str) -> dict[str, float]:
    """An FFN node's /metrics text -> {"compute": Σ over layers of afd_ffn_layer_compute_seconds_total,
    "tokens": afd_ffn_tokens_total (rows received, summed over layer passes), "rows": Σ afd_expert_tokens_total
    (token-expert rows its routed experts computed; identity experts' not)}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"compute": 0.0, "tokens": 0.0, "rows": 0.0}
    names = {
        "afd_ffn_layer_compute_seconds_total": "compute",
        "afd_ffn_tokens_total": "tokens",
        "afd_expert_tokens_total": "rows",
    }
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def _with_metrics_port(cluster_doc):
    """cluster_doc, with a free metrics port on every FFN node (a local cluster's have none): as
    afd.bench.dispatch_parts.MetricsCluster does it."""
    from afd.cluster.host import free_ports

    def doc(spec):
        d = cluster_doc(spec)
        used = {p for n in d["nodes"] for p in n["ports"].values() if p}
        ffn = [n for n in d["nodes"] if n["role"] == "ffn"]
        for node, port in zip(ffn, [p for p in free_ports(len(ffn) + len(used)) if p not in used]):
            node["ports"]["metrics"] = port
        return d

    return doc


def cluster_steps(config, batch_sizes, context: int, steps: int, log=print) -> list[dict]:
    """[{batch, step, wait_fraction, ffn_seconds, ffn_rows}] per batch size: the median decode step (seconds,
    after 2 warm-up steps) of attention node 0 and the share of it spent waiting on the FFN node; the FFN
    node's compute seconds and routed rows per MoE layer pass. config: an afd.LLM's resolved configuration
    (its model path resolved, its dtype the checkpoint's)."""
    from unittest import mock

    import yaml

    from afd.cluster import local
    from afd.cluster.local_spec import LocalClusterSpec
    from afd.model.registry import load_config
    from afd.plan.profile_measure import synthetic_prompts

    mod = config.model
    spec = LocalClusterSpec(
        mod.path,
        1,
        1,
        dtype=str(mod.dtype),
        quantization=mod.quantization,
        dummy_weights=mod.dummy_weights,
        seed=mod.seed,
        overlap=config.layout.overlap,
        micro_batches=1,
        exchange_dtype=config.layout.exchange_dtype,
        routing=config.layout.routing,
        block_size=config.engine.block_size,
    )
    vocab = load_config(mod.path).vocab_size
    out = []
    with local.LocalCluster(spec) as cluster:
        with mock.patch.object(local, "cluster_doc", _with_metrics_port(local.cluster_doc)):
            cluster.start()
        with open(f"{cluster.dir}/cluster.yaml") as fh:
            ffn = next(n for n in yaml.safe_load(fh)["nodes"] if n["role"] == "ffn")
        url = f"http://{ffn['host']}:{ffn['ports']['metrics']}/metrics"

        def scrape() -> dict[str, float]:
            with urllib.request.urlopen(url, timeout=10) as r:
                return ffn_counters(r.read().decode())

        # untimed: the nodes' first job pays for their first-use costs (allocator, lazy inits)
        cluster.generate(synthetic_prompts(max(batch_sizes), context, vocab, offset=40_000), 4, ignore_eos=True)
        for b in batch_sizes:
            t0 = time.perf_counter()
            _, reports = cluster.generate(synthetic_prompts(b, context, vocab, 50_000 + b), steps + 3, ignore_eos=True)
            decode = [s for s in reports[0]["steps"][1:] if s["tokens"] == b][2:]
            total = sum(s["seconds"] for s in decode)
            before = scrape()
            cluster.generate(synthetic_prompts(b, 1, vocab, 60_000 + b), steps + 3, ignore_eos=True)
            after = scrape()
            d = {k: after[k] - before[k] for k in after}
            passes = d["tokens"] / b  # layer passes: each carried the job's b one-token sequences
            out.append(
                {
                    "batch": b,
                    "step": statistics.median(s["seconds"] for s in decode),
                    "wait_fraction": sum(s["ffn_wait"] for s in decode) / total if total else 0.0,
                    "ffn_seconds": d["compute"] / passes if passes else 0.0,
                    "ffn_rows": d["rows"] / passes if passes else 0.0,
                }
            )
            log(f"cluster 1A1F batch {b}: {time.perf_counter() - t0:.1f}s")
        cluster.close()
    return out
