"""The one place an engine is put together from a configuration: KV cache, graph mode, runner, scheduler.

Serving sizes the KV cache from `engine.kv_cache_bytes` and takes its limits from the config; an offline job
(`Job`) gets a cache that holds exactly the job, so nothing is preempted, and runs at most
`engine.max_num_seqs` sequences at once (as vLLM's LLM), each admitted one prefilling whole. Every path that
runs a model builds here: the serving node, the colocated server, the offline worker, `afd.LLM` and the
benchmarks (TP ranks > 0 build only the runner)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from afd.backend import get_backend
from afd.backend.base import Backend
from afd.config.schema import ClusterConfig
from afd.config.sections import EngineSection
from afd.dataplane.exchange import MoEExchange
from afd.engine.engine import ALONE_BACKOFF_MAX, IDLE_BACKOFF_MAX, Engine
from afd.engine.graph import GraphHalf, scratch_blocks, settings_of, wrap
from afd.engine.graph_warmup import warm_up
from afd.engine.half import MTPModule
from afd.engine.kv_cache import CacheConfig, KVCache, blocks_needed
from afd.engine.runner import ModelRunner
from afd.engine.scheduler import Scheduler
from afd.engine.tokenizer import Tokenizer
from afd.model.config import ConfigError, ModelConfig, parse_dtype
from afd.model.halves import AttentionHalf
from afd.model.mla import attach_backend
from afd.model.quant_layers import quantize_linears
from afd.model.state_spec import StateLayout
from afd.model.tp.comm import SINGLE, TPComm
from afd.observability.attention_metrics import AttentionMetrics

log = logging.getLogger("afd.engine")


@dataclass(frozen=True)
class Job:
    """An offline job: its prompts and their max_tokens size the engine (the same on every TP rank)."""

    prompts: list[list[int]]
    max_tokens: list[int]

    def seqs(self, eng: EngineSection) -> int:
        """The most sequences the job's engine runs at once."""
        return min(eng.max_num_seqs, max(1, len(self.prompts)))


def quantize_attention_side(attn: AttentionHalf, mtp: MTPModule | None, backend: Backend) -> None:
    """The linears of the attention half (cut for TP) and the MTP layer to their scheme's 8 bits, once."""
    for half in (attn, mtp):
        spec = half.quant if half is not None else None
        keep = half.unquantized if half is not None else ()
        if spec is not None and isinstance(half, nn.Module) and (n := quantize_linears(half, spec, backend, keep)):
            log.info("%s: %d linears quantized (%s)", type(half).__name__, n, spec.describe())


def build_runner(
    cfg: ClusterConfig,
    attn: AttentionHalf,
    moe: MoEExchange | None,
    device: torch.device,
    *,
    tp: TPComm = SINGLE,
    mtp: MTPModule | None = None,
    backend: Backend | None = None,
    job: Job | None = None,
    metrics: AttentionMetrics | None = None,
) -> ModelRunner:
    """The runner over a KV cache sized for `job`, or from the budget; the half in graph mode's wrapper
    when the config asks for it (the scratch block comes from the same cache)."""
    mcfg, dtype, N = attn.cfg, parse_dtype(cfg.model.dtype), tp.cfg.kvp
    eng, graph = cfg.engine, settings_of(cfg)
    pages = None
    if job is not None:  # with KVP, pool k holds blocks k, k + N, ... of every sequence: pool 0 the most
        lengths = [len(p) + n for p, n in zip(job.prompts, job.max_tokens)]
        blocks = N * max(1, sum(-(-blocks_needed(t, eng.block_size) // N) for t in lengths))
        blocks += scratch_blocks(graph, tp, device)
        layout = StateLayout(mcfg.state_kinds(), eng.block_size)
        if layout.paged_pool:  # every kind's pages of every sequence, its partly filled last ones included
            pages = max(1, sum(layout.peak_pages(t, t) for t in lengths)) + scratch_blocks(graph, tp, device)
    else:
        if eng.gpu_memory_utilization is not None:
            dev = backend or get_backend(device.type)
            eng = dataclasses.replace(eng, kv_cache_bytes=memory_share(dev, eng, _sharing(cfg, device)))
        budget = _without_mtp_layer(eng, mcfg, mtp if eng.speculative_tokens else None)
        per_rank = CacheConfig(block_size=eng.block_size, memory_budget_bytes=budget.kv_cache_bytes)
        blocks = N * per_rank.resolve_num_blocks(mcfg, dtype.itemsize)
    kv = KVCache(mcfg, blocks, eng.block_size, dtype, device, N, pages=pages)
    if backend is not None:  # MLA decode tries the backend's fused attention first (afd/model/mla.py)
        attach_backend(attn, backend)
        if mtp is not None:
            attach_backend(mtp, backend)
    quantize_attention_side(attn, mtp, backend or get_backend(device.type))
    half = wrap(attn, kv, graph, tp, backend)
    if isinstance(half, GraphHalf) and half.backend.capture_at_warmup:
        if job is not None:  # a micro-batch holds at most the running sequences; a sequence its own blocks
            rows = job.seqs(eng)
            longest = max(
                (blocks_needed(len(p) + n, eng.block_size) for p, n in zip(job.prompts, job.max_tokens)), default=1
            )
        else:
            rows = eng.max_num_seqs
            max_len = cfg.model.max_model_len or mcfg.max_position_embeddings
            longest = min(blocks_needed(max_len, eng.block_size), kv.allocator.num_free)
        warm_up(half, kv, rows, longest, None if moe is None else moe.idle)
    if metrics is not None:
        metrics.watch_graph(half)
        metrics.watch_kv_ranks(kv.allocator)
    lay, draft = cfg.layout, mtp if eng.speculative_tokens else None
    return ModelRunner(half, moe, kv, device, lay.micro_batches, lay.overlap, tp, draft)


def build_engine(
    cfg: ClusterConfig,
    attn: AttentionHalf,
    moe: MoEExchange,
    device: torch.device,
    *,
    tp: TPComm = SINGLE,
    mtp: MTPModule | None = None,
    backend: Backend | None = None,
    job: Job | None = None,
    metrics: AttentionMetrics | None = None,
    tokenizer: Tokenizer | None = None,
    eos_ids: tuple[int, ...] | None = None,
) -> Engine:
    """The engine of `cfg` over an attention half and its MoE exchange (remote, or LocalMoE colocated).
    Serving: limits from `cfg.engine`, and max_model_len the smaller of `model.max_model_len` (else the
    model's) and what the KV cache holds. A job: limits that schedule it whole. EOS ids: the tokenizer's,
    else the model config's, unless given."""
    mcfg: ModelConfig = attn.cfg
    eng = cfg.engine
    runner = build_runner(cfg, attn, moe, device, tp=tp, mtp=mtp, backend=backend, job=job, metrics=metrics)
    kv = runner.kv
    prefix = (eng.enable_prefix_caching, int(runner.mtp is not None))  # MTP: a block's hash covers the next token
    if job is not None:
        tokens = max(1, sum(len(p) for p in job.prompts), len(job.prompts) * (1 + eng.speculative_tokens))
        scheduler = Scheduler(kv, job.seqs(eng), tokens, *prefix)
        max_len = mcfg.max_position_embeddings
    else:
        scheduler = Scheduler(kv, eng.max_num_seqs, eng.max_num_batched_tokens, *prefix)
        num_blocks = kv.allocator.num_free  # what requests can have (graph mode's scratch block is taken)
        limit = cfg.model.max_model_len or mcfg.max_position_embeddings
        max_len = kv.max_tokens(num_blocks, eng.max_num_batched_tokens, limit)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB); max_model_len %d",
            num_blocks,
            eng.block_size,
            kv.data.numel() * kv.data.element_size() / 2**20,
            max_len,
        )
    if eos_ids is None:
        eos_ids = tokenizer.eos_token_ids if tokenizer is not None and tokenizer.eos_token_ids else None
    return Engine(
        runner,
        scheduler,
        tokenizer,
        eos_ids or mcfg.eos_token_ids,
        max_len,
        metrics,
        eng.speculative_tokens,
        IDLE_BACKOFF_MAX if len(cfg.attention_nodes) > 1 else ALONE_BACKOFF_MAX,
    )


def _sharing(cfg: ClusterConfig, device: torch.device) -> int:
    """The KV caches that size themselves from one memory at once: a device's is its rank's alone; on CPU every
    attention rank of a host takes its RAM, so the share is split among the most a host runs (exact on one
    host, where local clusters live; conservative for a CPU cluster spread unevenly)."""
    if device.type != "cpu":
        return 1
    ranks = Counter(p.node.host for p in cfg.processes if p.node.role == "attention" and p.node.device_type == "cpu")
    return max(ranks.values(), default=1)


def memory_share(backend: Backend, eng: EngineSection, sharing: int = 1) -> int:
    """KV-cache bytes under --gpu-memory-utilization u: what this rank may still take of u x its device's
    memory once the weights are in, free - (1 - u) x total (every process's use counts: two ranks on one
    device each given 0.5 share it instead of both claiming all of it), split among the `sharing` ranks that
    size their caches from the same memory (CPU: afd.engine.factory._sharing)."""
    u = eng.gpu_memory_utilization
    assert u is not None
    free, total = backend.memory_info()
    budget = int(free - (1 - u) * total) // sharing
    gib = 2**30
    if budget <= 0:
        raise ConfigError(
            f"--gpu-memory-utilization {u:g}: {(total - free) / gib:.1f} of {total / gib:.1f} GiB of {backend.device} "
            f"are in use after the weights loaded, at or above the {u:.0%} allowed: nothing is left for the KV "
            "cache (raise it, or size the cache with --kv-cache-bytes)"
        )
    log.info(
        "--gpu-memory-utilization %g: %.2f GiB for the KV cache (%.1f of %.1f GiB free on %s; %d rank(s) share it)",
        u,
        budget / gib,
        free / gib,
        total / gib,
        backend.device,
        sharing,
    )
    return budget


def _without_mtp_layer(eng: EngineSection, mcfg: ModelConfig, mtp: MTPModule | None) -> EngineSection:
    """The budget left for the main model's layers once the MTP block's cache layer (as many blocks) has
    its share."""
    if mtp is None:
        return eng
    main, extra = (
        math.prod(shape) for shape in (mcfg.kv_cache_shape(1, eng.block_size), mtp.kv_cache_shape(1, eng.block_size))
    )
    return dataclasses.replace(eng, kv_cache_bytes=eng.kv_cache_bytes * main // (main + extra))
