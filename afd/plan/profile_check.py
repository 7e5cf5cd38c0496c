"""The cluster itself (`afd profile` without --no-cluster): the YAML's model at 1A1F on this machine
(afd.cluster.local, the nodes `afd launch` starts), with the YAML's overlap, exchange dtype, routing and
attention TP and one micro-batch. Per batch size it measures

- the attention side where it runs: attention node 0's runner times each layer's pieces (the job asks for
  `layer_times`: afd.plan.profile_measure.node_samples) and reports each step (seconds, ffn_wait): the
  attention-side fits, and the step the fitted FFN half and link are held against;
- the FFN node's compute per MoE layer pass against the token-expert rows it computed, from its own
  per-layer counters (afd_ffn_layer_compute_seconds_total{layer}, afd_expert_tokens_total, afd_ffn_tokens_total
  on its /metrics, served as LocalCluster's ffn_metrics asks) read before and after a job of one-token
  prompts: every forward step of that job, the prefill included, is a pass of exactly `batch` rows, so no
  prefill has to be subtracted (the FFN half's cost does not depend on the context);
- over that same job, the CPU time of every node process (/proc): what the node processes spend per step
  beyond the pieces and the compute is the messages' CPU (afd.plan.profile_fit.message_cpu).

The nodes are started once and take an untimed warm-up job, then two jobs per batch size and round, the
batch sizes swept in alternating order (machine drift hits all alike).
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


def cluster_steps(
    model, config, batch_sizes, context: int, steps: int, repeats: int = 1, log=print, routing: str = "ffn"
) -> tuple[list, list[dict]]:
    """(the node's median StepSample per batch size, [{batch, step, wait_fraction, ffn_seconds, ffn_rows,
    cpu_per_step}] per batch size): attention node 0's pieces per layer and decode step (after 2 warm-up
    steps) over `steps` steps x `repeats` runs, the runner's median step, the share of it spent waiting on the
    FFN node; the FFN node's compute seconds and routed rows per MoE layer pass; every node process's CPU per
    step. model: an afd.LLM's resolved model section (its path resolved, its dtype the checkpoint's); config:
    the YAML's ClusterConfig (layout, block size); routing: the cluster's (the YAML's is not used: the profile
    measures each)."""
    from afd.cluster.cpus import process_cpu_seconds
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job
    from afd.model.registry import load_config
    from afd.plan.profile_measure import median_sample, node_samples, synthetic_prompts

    lay = config.layout
    job = local_job(
        model.path,
        1,
        1,
        dtype=str(model.dtype),
        quantization=model.quantization,
        dummy_weights=model.dummy_weights,
        seed=model.seed,
        overlap=lay.overlap,
        micro_batches=1,
        exchange_dtype=lay.exchange_dtype,
        routing=routing,
        block_size=config.engine.block_size,
        attention_tp=lay.attention_tp,
        tp_comm=lay.tp_comm,
        flashcomm2_otp=lay.flashcomm2_otp,
        tp_comm_min_tokens=lay.tp_comm_min_tokens,
        kvp=lay.kvp,
    )
    cfg = load_config(model.path)
    vocab, moe = cfg.vocab_size, len(cfg.moe_layers)
    samples: dict[int, list] = {b: [] for b in batch_sizes}
    decode: dict[int, list[dict]] = {b: [] for b in batch_sizes}
    ffn: dict[int, dict[str, float]] = {
        b: dict.fromkeys(("compute", "tokens", "rows", "cpu"), 0.0) for b in batch_sizes
    }
    with LocalCluster(job, ffn_metrics=True) as cluster:
        cluster.start()
        (url,) = cluster.metrics_urls.values()
        pids = [cluster.process(n).pid for n in cluster.processes.procs]

        def scrape() -> dict[str, float]:
            with urllib.request.urlopen(url, timeout=10) as r:
                return ffn_counters(r.read().decode()) | {"cpu": sum(process_cpu_seconds(p) for p in pids)}

        # untimed: the nodes' first job pays for their first-use costs (allocator, lazy inits)
        cluster.generate(synthetic_prompts(max(batch_sizes), context, vocab, offset=40_000), 4, ignore_eos=True)
        for r in range(repeats):
            for b in batch_sizes if r % 2 == 0 else tuple(reversed(batch_sizes)):
                t0 = time.perf_counter()
                prompts = synthetic_prompts(b, context, vocab, 50_000 + r * 1000 + b)
                _, reports = cluster.generate(prompts, steps + 3, ignore_eos=True, layer_times=True)
                samples[b] += node_samples(reports[0], b, moe, cfg.num_layers - moe, lay.overlap)
                decode[b] += [s for s in reports[0]["steps"][1:] if s["tokens"] == b][2:]
                before = scrape()
                cluster.generate(synthetic_prompts(b, 1, vocab, 60_000 + r * 1000 + b), steps + 3, ignore_eos=True)
                after = scrape()
                for k in after:
                    ffn[b][k] += after[k] - before[k]
                log(
                    f"cluster 1A1F routing {routing} round {r + 1}/{repeats} batch {b}: {time.perf_counter() - t0:.1f}s"
                )
        cluster.close()
    out = []
    for b in batch_sizes:
        total = sum(s["seconds"] for s in decode[b])
        passes = ffn[b]["tokens"] / b  # layer passes: each carried the job's b one-token sequences
        out.append(
            {
                "batch": b,
                "step": statistics.median(s["seconds"] for s in decode[b]),
                "wait_fraction": sum(s["ffn_wait"] for s in decode[b]) / total if total else 0.0,
                "ffn_seconds": ffn[b]["compute"] / passes if passes else 0.0,
                "ffn_rows": ffn[b]["rows"] / passes if passes else 0.0,
                # every node process's CPU per forward step of that job (a step is `moe` layer passes)
                "cpu_per_step": ffn[b]["cpu"] * moe / passes if passes else 0.0,
            }
        )
    return [median_sample(samples[b]) for b in batch_sizes], out
