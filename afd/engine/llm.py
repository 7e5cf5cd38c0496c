"""`afd.LLM`: offline generation on the serving engine, colocated (both halves in this process) or
across AFD node processes on this machine."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from afd.backend import get_backend
from afd.cluster.config import ClusterConfig
from afd.cluster.flags import flat_overrides, with_overrides
from afd.cluster.local import LocalCluster
from afd.cluster.local_config import local_config
from afd.cluster.local_spec import LocalClusterSpec, reports_logits
from afd.cluster.topology import resolve_model_path, with_checkpoint_dtype
from afd.dataplane.exchange import LocalMoE, MoEExchange
from afd.engine import offline
from afd.engine.engine import Engine
from afd.engine.factory import Job, build_engine
from afd.engine.graph import graph_report
from afd.engine.sampling import SamplingParams
from afd.engine.tokenizer import load_tokenizer
from afd.model.checkpoint import build_attention_half, build_ffn_half, build_mtp_layer, open_reader, serving_quant
from afd.model.config import parse_dtype
from afd.model.mtp import family_mtp
from afd.model.registry import family, load_config


@dataclass
class CompletionOutput:
    """One generated sequence, as vLLM's `CompletionOutput` has it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    """"stop" (an EOS token, kept as the last id) or "length" (max_tokens reached)."""


@dataclass
class GenerateOutput:
    """One prompt's result, as vLLM's `RequestOutput` has it: `outputs[0].text`, `outputs[0].token_ids`."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """Offline generation.

    model: an HF checkpoint directory of a supported family, or `demo`. With `dummy_weights=True`, only its
    config.json is read and the weights are seeded random.
    """

    def __init__(self, model: str, **options: Any):
        """`options`: where it runs, and any field of the configuration by name (afd.cluster.schema; e.g.
        dtype, dummy_weights, seed, block_size, overlap, micro_batches, attention_tp, tp_comm, kvp,
        speculative_tokens, graph_mode, graph_batch_sizes, compile_cache_dir), checked as the cluster YAML is.

        Where it runs: `device` (cpu; colocated only), and colocated (both halves in this process) unless
        `attention_nodes` or `ffn_nodes` is given (or `colocated=False`): then that many node processes on this
        machine (afd.cluster.local), started by the first generate() and kept until close(), the end of a
        `with` block, or the LLM's collection. With attention_tp > 1 every attention node is that
        many processes (afd.model.tp); colocated, that is one attention node whose ranks each hold every
        expert (a cluster without FFN nodes). Offline, micro_batches defaults to 1.
        speculative_tokens: `spec_decode` then holds the last generate()'s acceptance counters. Colocated,
        each generate() builds its graphs anew (the KV cache is sized per job): a warm compile cache makes
        that reloads."""
        device = options.pop("device", "cpu")
        attention_nodes, ffn_nodes = options.pop("attention_nodes", None), options.pop("ffn_nodes", None)
        colocated = options.pop("colocated", None)
        if colocated and (attention_nodes or ffn_nodes):
            raise ValueError("colocated runs both halves in this process; it takes no attention_nodes or ffn_nodes")
        if colocated is None:
            colocated = attention_nodes is None and ffn_nodes is None
        A, F = attention_nodes or 1, 0 if colocated else (1 if ffn_nodes is None else ffn_nodes)
        sections = flat_overrides({"micro_batches": 1, **options, "path": resolve_model_path(model)})
        self.config = with_checkpoint_dtype(local_config(A, F, sections, name="local-job", threads=1))
        """The job's configuration (a cluster YAML's: afd.cluster.schema)."""
        model, lay, eng = self.config.model.path, self.config.layout, self.config.engine
        self.graph_report: dict | None = None
        """The last generate()'s graph-mode counters (afd.engine.graph.graph_report; attention node 0's)."""
        self.speculative_tokens = eng.speculative_tokens
        self.spec_decode: dict | None = None
        self.cfg = load_config(model)
        self.tokenizer = load_tokenizer(model)
        self.dtype = parse_dtype(self.config.model.dtype)
        self.cluster = None if colocated and lay.attention_tp == 1 else _cluster_spec(self.config)
        if self.speculative_tokens:
            family_mtp(self.cfg)  # refuses a family without an MTP module here, not in a node process
        if self.cluster:
            lay.tp.check_model(self.cfg.num_attention_heads)
            if lay.attention_tp > 1 and not family(self.cfg.model_type).attention_half.supports_tp:
                raise ValueError(
                    f"attention_tp: {self.cfg.model_type}'s attention half has no TP layers yet "
                    "(MLA families do: longcat_flash, deepseek_v3)"
                )
            if device != "cpu":
                raise ValueError("multi-process afd.LLM runs on the CPU; launch nodes for devices (afd launch)")
            return
        self.backend = get_backend(device)
        reader = open_reader(model, dummy=self.config.model.dummy_weights, seed=self.config.model.seed)
        dev = self.backend.device
        quant = serving_quant(model, self.config.model.quantization, self.backend)
        self.attn = build_attention_half(self.cfg, reader, self.dtype, dev, quant)
        self.ffn = build_ffn_half(self.cfg, reader, self.dtype, dev, mtp=self.speculative_tokens > 0, quant=quant)
        self.mtp = build_mtp_layer(self.cfg, reader, self.dtype, dev, quant) if self.speculative_tokens else None

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        max_tokens: int | list[int] = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool = True,
    ) -> list[GenerateOutput]:
        """Text or token ids in (one prompt or a list); per prompt, the generated text and ids out."""
        texts, ids = self._prompt_ids(prompts)
        out = self.generate_ids(ids, max_tokens, temperature, top_p, top_k, seed, ignore_eos, progress=use_tqdm)
        eos = set(
            self.tokenizer.eos_token_ids if self.tokenizer and self.tokenizer.eos_token_ids else self.cfg.eos_token_ids
        )
        return [
            GenerateOutput(t, p, [CompletionOutput(0, self._decode(g), g, _finish(g, eos, ignore_eos))])
            for t, p, g in zip(texts, ids, out)
        ]

    def generate_ids(
        self,
        prompt_token_ids: list[list[int]],
        max_tokens: int | list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        ignore_eos: bool = False,
        logits_out: list | None = None,
        progress: bool = False,
    ) -> list[list[int]]:
        """Generated token ids per prompt. `logits_out`, if given, receives each step's fp32 logits.
        A `seed` seeds every prompt's sampling alike, wherever the prompt runs."""
        per = offline.validate_prompts(self.cfg, prompt_token_ids, max_tokens)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if self.cluster:
            out, reports = self._nodes().generate(
                prompt_token_ids, per, params, ignore_eos, logits=logits_out is not None
            )
            if logits_out is not None:
                logits_out.extend(reports_logits(self.cluster, reports, len(prompt_token_ids)))
            self.graph_report = reports[0].get("graph")  # attention node 0's
            if self.speculative_tokens:
                self.spec_decode = _add_counters([r["spec_decode"] for r in reports])
            return out
        engine = self.job_engine(prompt_token_ids, per)
        out = offline.generate(engine, prompt_token_ids, per, params, ignore_eos, logits_out, progress=progress)
        self.graph_report = graph_report(engine.runner.attn)
        self.spec_decode = engine.spec.stats.report() if engine.spec else None
        return out

    def job_engine(
        self, prompts: list[list[int]], max_tokens: list[int], moe: MoEExchange | None = None, **options: Any
    ) -> Engine:
        """A colocated LLM's engine for one job (afd.engine.factory.build_engine over this LLM's halves):
        `options` are config fields over the LLM's own (e.g. micro_batches=2, graph_mode="compile"); `moe`
        another exchange than the in-process experts."""
        cfg = with_overrides(self.config, flat_overrides(options)) if options else self.config
        return build_engine(
            cfg,
            self.attn,
            moe or LocalMoE(self.ffn, self.backend),
            self.backend.device,
            mtp=self.mtp if cfg.engine.speculative_tokens else None,
            job=Job(prompts, max_tokens),
        )

    _local: LocalCluster | None = None
    """The node processes of a multi-process LLM: started by the first generate(), kept until close()."""

    def _nodes(self) -> LocalCluster:
        if self._local is None or not self._local.running:
            assert self.cluster is not None  # a multi-process LLM
            local = LocalCluster(self.cluster)
            # at the latest when the LLM is collected or the interpreter exits: no process outlives it
            weakref.finalize(self, local.stop)
            local.start()
            self._local = local
        return self._local

    def close(self) -> None:
        """Stops the node processes of a multi-process LLM (the next generate() starts new ones)."""
        local, self._local = self._local, None
        if local is not None:
            local.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _prompt_ids(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: a string, a list of token ids, or a non-empty list of either")
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer.json: give prompts as token ids")
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            else:
                texts.append(None)
                ids.append(p)
        return texts, ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


def _cluster_spec(cfg: ClusterConfig) -> LocalClusterSpec:
    """The local cluster of a job's configuration."""
    m, lay, eng = cfg.model, cfg.layout, cfg.engine
    return LocalClusterSpec(
        m.path,
        len(cfg.attention_nodes),
        len(cfg.ffn_nodes),
        m.dtype,
        m.quantization,
        m.dummy_weights,
        m.seed,
        lay.overlap,
        lay.micro_batches,
        eng.block_size,
        speculative_tokens=eng.speculative_tokens,
        graph_mode=lay.graph_mode,
        graph_batch_sizes=eng.graph_batch_sizes,
        compile_cache_dir=eng.compile_cache_dir,
        attention_tp=lay.attention_tp,
        tp_comm=lay.tp_comm,
        flashcomm2_otp=lay.flashcomm2_otp,
        tp_comm_min_tokens=lay.tp_comm_min_tokens,
        kvp=lay.kvp,
        exchange_dtype=lay.exchange_dtype,
        routing=lay.routing,
        placement=_by_index(lay.placement, cfg),
        max_restarts=cfg.cluster.max_restarts,
        restart_backoff=cfg.cluster.restart_backoff,
    )


def _by_index(placement: dict | None, cfg: ClusterConfig) -> dict | None:
    """layout.placement keyed by FFN node index, as a local cluster names its nodes anew."""
    if placement is None:
        return None
    names = [n.name for n in cfg.ffn_nodes]
    return {str(names.index(k)): v for k, v in placement.items()}


def _add_counters(reports: list[dict]) -> dict:
    """The attention nodes' spec-decode counters, summed (afd.engine.speculative.SpecDecodeStats.report)."""
    out = dict(reports[0])
    for r in reports[1:]:
        for key, value in r.items():
            out[key] = [a + b for a, b in zip(out[key], value)] if isinstance(value, list) else out[key] + value
    return out


def _finish(ids: list[int], eos: set[int], ignore_eos: bool) -> str:
    return "stop" if not ignore_eos and ids and ids[-1] in eos else "length"
