"""`afd.LLM`: offline generation on the serving engine, colocated (both halves in this process) or
across AFD node processes on this machine, called as vLLM's `vllm.LLM` is (`generate`, `chat`,
`SamplingParams`, vLLM's keywords: afd.entrypoints.llm_params; its outputs: afd.entrypoints.llm_outputs)."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from afd.backend import get_backend
from afd.cluster.local import LocalCluster, reports_logits
from afd.cluster.local_config import local_job
from afd.cluster.topology import resolve_model_path, with_model_defaults
from afd.config.flags import flat_overrides, with_overrides
from afd.config.loader import check_routing
from afd.dataplane.exchange import LocalMoE, MoEExchange
from afd.engine import offline
from afd.engine.engine import Engine
from afd.engine.factory import Job, build_engine
from afd.engine.graph import graph_report
from afd.engine.load import Halves
from afd.engine.offline import Completion, OfflineRequest
from afd.engine.sampling import SamplingParams
from afd.engine.tokenizer import Tokenizer, load_tokenizer
from afd.entrypoints.llm_inputs import Prompt, conversations_of, prompts_of, render, requests_of
from afd.entrypoints.llm_nodes import _add_counters, run_on_nodes
from afd.entrypoints.llm_outputs import RequestOutput, completion_output
from afd.entrypoints.llm_params import SamplingParams as VLLMSamplingParams
from afd.entrypoints.llm_params import default_sampling_params, llm_options, per_prompt
from afd.model.config import parse_dtype
from afd.model.mtp import family_mtp
from afd.model.registry import family, load_config


class LLM:
    """Offline generation, as vLLM's `LLM`: `generate(prompts, SamplingParams(...))` and `chat(messages)`
    return vLLM's `RequestOutput`s.

    model: an HF checkpoint directory of a supported family, or `demo`. With `dummy_weights=True` (vLLM's
    `load_format="dummy"`), only its config.json is read and the weights are seeded random (`weights_seed`).
    """

    def __init__(self, model: str, **options: Any):
        """`options`: vLLM's LLM keywords (afd.entrypoints.llm_params.llm_options; README "Offline, in Python"),
        any field of the configuration by name (afd.config.schema, checked as the cluster YAML is; the dummy
        weights' seed is `weights_seed`), and where it runs: `device` (cpu; colocated only), and colocated
        (both halves in this process) unless `attention_nodes` or `ffn_nodes` is given (or colocated=False):
        then that many node processes on this machine (afd.cluster.local), started by the first generate()
        and kept until close(), the end of a `with` block, or the LLM's collection. With attention_tp > 1
        (tensor_parallel_size) every attention node is that many processes (afd.model.tp); colocated, one
        attention node whose ranks each hold every expert. Offline, micro_batches defaults to 1.
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
        options = {"micro_batches": 1, **llm_options(options)}
        self.config = with_model_defaults(local_job(resolve_model_path(model), A, F, **options))
        """The job's configuration (a cluster YAML's: afd.config.schema)."""
        model, lay, eng = self.config.model.path, self.config.layout, self.config.engine
        self.graph_report: dict | None = None
        """The last generate()'s graph-mode counters (afd.engine.graph.graph_report; attention node 0's)."""
        self.speculative_tokens = eng.speculative_tokens
        self.spec_decode: dict | None = None
        self.cfg = load_config(model)
        self.tokenizer: Tokenizer | None = load_tokenizer(model)
        self.dtype = parse_dtype(self.config.model.dtype)
        self.max_model_len = min(
            self.config.model.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings
        )
        """The context limit of a prompt and its output (vLLM's max_model_len)."""
        self._request_ids = itertools.count()
        self.cluster = None if colocated and lay.attention_tp == 1 else self.config
        """The node processes' config (theirs as it is: every field reaches them), or None: colocated."""
        if self.speculative_tokens:
            family_mtp(self.cfg)  # refuses a family without an MTP module here, not in a node process
        if self.cluster:
            lay.tp.check_model(self.cfg.num_attention_heads)
            check_routing(self.config, self.cfg)
            if lay.attention_tp > 1 and not family(self.cfg.model_type).attention_half.supports_tp:
                raise ValueError(
                    f"attention_tp: {self.cfg.model_type}'s attention half has no TP layers yet "
                    "(MLA families do: longcat_flash, deepseek_v3)"
                )
            if device != "cpu":
                raise ValueError("multi-process afd.LLM runs on the CPU; launch nodes for devices (afd launch)")
            return
        if eng.sampling_seed is not None:  # as vLLM (and afd serve --seed): the default generator
            torch.manual_seed(eng.sampling_seed)
        self.backend = get_backend(device)
        halves = Halves.load(self.config, model, self.cfg, self.backend)
        assert halves.ffn is not None  # colocated: every expert is here
        self.attn, self.ffn, self.mtp = halves.attn, halves.ffn, halves.mtp

    # ---- vLLM's API ---------------------------------------------------------------------------------------

    def generate(
        self,
        prompts=None,
        sampling_params: VLLMSamplingParams | list[VLLMSamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        *,
        prompt_token_ids: list[list[int]] | None = None,
        **params: Any,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: prompts (a string, {"prompt": ...}, {"prompt_token_ids": [...]}, token
        ids, or a list of these) and one SamplingParams for all or one per prompt (default: vLLM's,
        over the checkpoint's generation_config.json) -> one RequestOutput per prompt, with n outputs.
        `params`: SamplingParams fields as keywords, instead of sampling_params (e.g. max_tokens=8)."""
        if prompts is None and prompt_token_ids is not None:  # vLLM's older keyword
            prompts = [{"prompt_token_ids": p} for p in prompt_token_ids]
        return self._generate(prompts_of(prompts, self.tokenizer), sampling_params, use_tqdm, lora_request, params)

    def chat(
        self,
        messages,
        sampling_params: VLLMSamplingParams | list[VLLMSamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: a conversation (a list of {"role", "content"} messages) or a list of them,
        rendered with the tokenizer's chat template (or `chat_template`), then generate()."""
        if mm_processor_kwargs:
            raise ValueError("chat(): afd takes text only (mm_processor_kwargs)")
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        prompts = [
            render(self.tokenizer, c, chat_template, add_generation_prompt, continue_final_message, kwargs)
            for c in conversations_of(messages)
        ]
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, {})

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> VLLMSamplingParams:
        """vLLM's: SamplingParams() over the checkpoint's generation_config.json (temperature, top_p, top_k,
        repetition_penalty, max_new_tokens)."""
        return default_sampling_params(self.config.model.path)

    def _generate(self, prompts: list[Prompt], sampling_params, use_tqdm, lora_request, params) -> list[RequestOutput]:
        if lora_request is not None:
            raise ValueError("afd has no LoRA adapters (lora_request)")
        sps = per_prompt(sampling_params, params, len(prompts), self.get_default_sampling_params)
        requests, owner = requests_of(prompts, sps, self.max_model_len)
        offline.validate_prompts(self.cfg, [r.prompt_ids for r in requests], [r.max_tokens for r in requests])
        done = self._run(requests, bool(use_tqdm))
        outs = [RequestOutput(str(next(self._request_ids)), p.text, p.ids) for p in prompts]
        for (i, j), c in zip(owner, done):
            outs[i].outputs.append(completion_output(j, c, self.tokenizer, sps[i].detokenize))
        return outs

    def _run(self, requests: list[OfflineRequest], progress: bool) -> list[Completion]:
        """The completions of a job's sequences, on this process's engine (with the tokenizer: text, stop
        strings and its EOS ids, as a server's) or the node processes (afd.entrypoints.llm_nodes)."""
        if not self.cluster:
            return self._colocated(requests, self.tokenizer, None, progress)
        tok = self.tokenizer
        eos = tok.eos_token_ids if tok is not None and tok.eos_token_ids else tuple(self.cfg.eos_token_ids)
        return run_on_nodes(requests, self._on_nodes, tok, eos)

    # ---- afd's own --------------------------------------------------------------------------------------

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
        """Generated token ids per prompt (greedy by default; EOS: the model config's ids). `logits_out`, if
        given, receives each step's fp32 logits. A `seed` seeds every prompt's sampling alike, wherever the
        prompt runs."""
        per = offline.validate_prompts(self.cfg, prompt_token_ids, max_tokens)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if self.cluster:
            return self._on_nodes(prompt_token_ids, per, params, ignore_eos, logits_out)
        requests = [OfflineRequest(p, n, params, ignore_eos=ignore_eos) for p, n in zip(prompt_token_ids, per)]
        return [c.token_ids for c in self._colocated(requests, None, logits_out, progress)]

    def _colocated(self, requests: list[OfflineRequest], tok: Tokenizer | None, logits_out, progress: bool):
        """One job on this process's engine (afd.engine.offline.run)."""
        engine = self.job_engine([r.prompt_ids for r in requests], [r.max_tokens for r in requests], tokenizer=tok)
        out = offline.run(engine, requests, logits_out, progress=progress)
        self.graph_report = graph_report(engine.runner.attn)
        self.spec_decode = engine.spec.stats.report() if engine.spec else None
        return out

    def _on_nodes(self, prompts, per, params: SamplingParams, ignore_eos: bool, logits_out: list | None):
        """One job on the node processes: ids per prompt (and each step's logits into `logits_out`)."""
        assert self.cluster is not None
        out, reports = self._nodes().generate(prompts, per, params, ignore_eos, logits=logits_out is not None)
        if logits_out is not None:
            logits_out.extend(reports_logits(reports, len(prompts)))
        self.graph_report = reports[0].get("graph")  # attention node 0's
        if self.speculative_tokens:
            self.spec_decode = _add_counters([r["spec_decode"] for r in reports])
        return out

    def job_engine(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        moe: MoEExchange | None = None,
        tokenizer: Tokenizer | None = None,
        **options: Any,
    ) -> Engine:
        """A colocated LLM's engine for one job (afd.engine.factory.build_engine over this LLM's halves):
        `options` are config fields over the LLM's own (e.g. micro_batches=2, graph_mode="compile"); `moe`
        another exchange than the in-process experts; `tokenizer`: text, stop strings and its EOS ids (else
        no text and the model config's EOS ids)."""
        cfg = with_overrides(self.config, flat_overrides(options)) if options else self.config
        return build_engine(
            cfg,
            self.attn,
            moe or LocalMoE(self.ffn, self.backend),
            self.backend.device,
            mtp=self.mtp if cfg.engine.speculative_tokens else None,
            job=Job(prompts, max_tokens),
            tokenizer=tokenizer,
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
