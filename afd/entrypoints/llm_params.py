"""vLLM's `SamplingParams` and `LLM(...)` keywords as `afd.LLM` takes them: the same names and defaults
(temperature 1.0, max_tokens 16), converted to the engine's own (afd.engine.sampling.SamplingParams) and
to the cluster configuration's fields. What afd cannot honour is refused with a ValueError naming it.

Names, defaults and meanings are vLLM's (vllm/sampling_params.py, SamplingParams; vllm/entrypoints/llm.py,
LLM; https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html): read, not copied.
"""

from __future__ import annotations

import dataclasses
import json
import os
from argparse import ArgumentTypeError
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from afd.config.fieldspec import dtype_arg
from afd.config.flags import SECTIONS
from afd.engine import sampling

_UNSUPPORTED = {
    # field: (its default, what to do instead); a non-default value is refused
    "best_of": (None, "ask for n samples"),
    "prompt_logprobs": (None, None),
    "include_stop_str_in_output": (False, None),
    "spaces_between_special_tokens": (True, None),
    "logits_processors": (None, "use logit_bias"),
    "truncate_prompt_tokens": (None, "cut the prompt's token ids before generate()"),
    "guided_decoding": (None, None),
    "structured_outputs": (None, None),
    "allowed_token_ids": (None, "use logit_bias"),
    "bad_words": (None, "use logit_bias"),
    "extra_args": (None, None),
}


@dataclass
class SamplingParams:
    """How one prompt is sampled, as vLLM's `SamplingParams` (same names, same defaults). Fields afd does
    not implement exist so that setting one is our ValueError naming it, not a TypeError."""

    n: int = 1
    """Outputs per prompt; output i of a seeded prompt is sampled with seed + i (as the server does)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k cut."""
    seed: int | None = None
    """None: the LLM's seed (LLM(seed=...)) drives the sampling."""
    stop: str | list[str] | None = None
    """Strings that end the output; the text ends before one (token_ids keep the token that completed it)."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None: up to the context limit (LLM(max_model_len=...), else the model's)."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Each output token's logprob and this many top alternatives (0: the sampled token's alone)."""
    detokenize: bool = True
    """False: `text` stays empty (stop strings then need detokenize)."""
    logit_bias: dict[int, float] | None = None
    best_of: int | None = None
    min_p: float = 0.0
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    truncate_prompt_tokens: int | None = None
    guided_decoding: Any = None
    structured_outputs: Any = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict | None = None
    output_kind: Any = None
    """Accepted and ignored: offline outputs are always final (vLLM's FINAL_ONLY)."""

    def __post_init__(self):
        bad = [
            f"{name}={getattr(self, name)!r}" + (f" ({instead})" if instead else "")
            for name, (default, instead) in _UNSUPPORTED.items()
            if getattr(self, name) != default and not (name == "best_of" and self.best_of == self.n)
        ]
        if bad:
            raise ValueError(f"SamplingParams: afd does not implement {', '.join(bad)}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.top_k == -1:  # vLLM's older spelling of "no cut"
            self.top_k = 0
        if self.logprobs == -1:
            raise ValueError("logprobs=-1 (the whole vocabulary) is not supported; ask for at most 20")
        if self.stop is not None and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        self.engine_params(self.seed)  # the engine's checks (ranges, logit_bias, logprobs), now

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def engine_params(self, seed: int | None) -> sampling.SamplingParams:
        """The engine's sampling parameters of one output, sampled with `seed`."""
        return sampling.SamplingParams(
            temperature=self.temperature,
            min_p=self.min_p,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.logprobs,
        )

    def clone(self) -> SamplingParams:
        return dataclasses.replace(self)


GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json's sampling defaults as vLLM reads them (its generation_config="auto")."""


def default_sampling_params(model_dir: str) -> SamplingParams:
    """vLLM's `LLM.get_default_sampling_params()`: SamplingParams() over the recommendations of the
    checkpoint's generation_config.json."""
    path = os.path.join(model_dir, "generation_config.json")
    gen = {}
    if os.path.isfile(path):
        with open(path) as fh:
            gen = json.load(fh)
    return SamplingParams(**{ours: gen[hf] for hf, ours in GENERATION_CONFIG_FIELDS.items() if hf in gen})


def per_prompt(
    sampling_params: SamplingParams | list[SamplingParams] | None,
    fields: dict[str, Any],
    num_prompts: int,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    """generate()'s sampling per prompt: one SamplingParams for all, one each, or `fields` (SamplingParams
    fields as generate()'s keywords, afd's earlier form); None is `default()` (vLLM's defaults)."""
    if sampling_params is not None and fields:
        raise ValueError(f"give sampling_params or SamplingParams fields ({', '.join(fields)}), not both")
    if fields:
        try:
            sampling_params = SamplingParams(**fields)
        except TypeError as e:
            raise ValueError(f"generate(): {e} (SamplingParams' fields are vLLM's)") from None
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * num_prompts
    if len(sps) != num_prompts:
        raise ValueError(f"{len(sps)} sampling_params for {num_prompts} prompts")
    return [sp if sp is not None else default() for sp in sps]


# ---- LLM(...) keywords ------------------------------------------------------------------------------------

_ACCEPTED = {
    "trust_remote_code": "afd runs no code from a checkpoint: its families are afd's own",
    "gpu_memory_utilization": "an offline job's KV cache is sized to hold the job exactly",
    "swap_space": "nothing is swapped: an offline job is never preempted",
    "max_num_batched_tokens": "an offline job prefills each prompt it admits whole",
    "disable_log_stats": "afd logs no periodic stats",
    "tokenizer_mode": "afd reads tokenizer.json",
    "disable_custom_all_reduce": "afd's TP collectives are torch.distributed's",
    "enable_chunked_prefill": "afd always chunks prompts (an offline job's in one step)",
    "max_seq_len_to_capture": "graph mode buckets by batch size: graph_batch_sizes",
    "disable_async_output_proc": "outputs are processed on the engine thread",
}
"""vLLM keywords that change nothing in an afd.LLM, and why (any value is taken)."""

_REFUSED = {
    "pipeline_parallel_size": (1, None),
    "data_parallel_size": (1, "attention_nodes (each attention node is a data-parallel replica)"),
    "enable_expert_parallel": (False, "ffn_nodes (the experts are split across the FFN nodes)"),
    "tokenizer": (None, "a tokenizer.json in the checkpoint directory"),
    "revision": (None, None),
    "tokenizer_revision": (None, None),
    "download_dir": (None, None),
    "kv_cache_dtype": ("auto", None),
    "cpu_offload_gb": (0, None),
    "speculative_config": (None, "speculative_tokens (MTP drafts from the checkpoint's own module)"),
    "compilation_config": (None, "graph_mode and graph_batch_sizes"),
    "hf_overrides": (None, None),
    "generation_config": ("auto", None),
    "skip_tokenizer_init": (False, "give prompts as token ids; outputs' text is empty without tokenizer.json"),
}
"""vLLM keywords afd cannot honour -> (the value it takes, afd's equivalent or None)."""


def llm_options(options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's LLM keywords among `options` as afd's configuration fields (afd.config.schema); afd's own
    fields pass through. `seed` is vLLM's (sampling); the dummy weights' is `weights_seed`."""
    out = dict(options)
    afd_own = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)} - {"path", "seed"}
    vllm = {*_ACCEPTED, *_REFUSED, "tensor_parallel_size", "enforce_eager", "load_format", "seed"}
    unknown = sorted(set(out) - afd_own - vllm - {"weights_seed"})
    if unknown:
        raise ValueError(
            f"LLM: unknown option(s) {', '.join(map(repr, unknown))} (vLLM's taken here: "
            f"{', '.join(sorted(vllm))}; afd's own: the configuration's fields, {', '.join(sorted(afd_own))}, "
            "and weights_seed)"
        )
    refused = []
    for name, (ok, instead) in _REFUSED.items():
        if name in out and out.pop(name) != ok:
            refused.append(f"{name} ({'afd: ' + instead if instead else 'afd has no equivalent'})")
    if refused:
        raise ValueError(f"LLM: vLLM's {', '.join(refused)} cannot be honoured")
    for name in _ACCEPTED:
        out.pop(name, None)
    if "tensor_parallel_size" in out:
        tp = out.pop("tensor_parallel_size")
        if out.setdefault("attention_tp", tp) != tp:
            raise ValueError("tensor_parallel_size and attention_tp are the same thing: give one")
    if out.pop("enforce_eager", False):
        out["graph_mode"] = "eager"
    if "load_format" in out:
        fmt = out.pop("load_format")
        if fmt == "dummy":
            out["dummy_weights"] = True
        elif fmt not in ("auto", "safetensors"):
            raise ValueError(f"load_format {fmt!r}: afd reads safetensors (or 'dummy': seeded random weights)")
    if "dtype" in out:  # vLLM's spellings (half, float, torch.bfloat16) as afd's flag takes them
        try:
            out["dtype"] = dtype_arg(str(out["dtype"]).removeprefix("torch."))
        except ArgumentTypeError as e:
            raise ValueError(f"dtype: {e}") from None
    if "served_model_name" in out and isinstance(out["served_model_name"], list):
        out["served_model_name"] = out["served_model_name"][0]
    if "seed" in out and "sampling_seed" in out and out["seed"] != out["sampling_seed"]:
        raise ValueError("seed and sampling_seed are the same thing (vLLM's seed): give one")
    out["sampling_seed"] = out.pop("seed", out.get("sampling_seed", 0))  # vLLM's default: 0
    if "weights_seed" in out:
        out["seed"] = out.pop("weights_seed")
    return out
