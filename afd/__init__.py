"""afd: Attention-FFN Disaggregated serving for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "afd.entrypoints.llm",
    "SamplingParams": "afd.entrypoints.llm_params",
    "RequestOutput": "afd.entrypoints.llm_outputs",
    "CompletionOutput": "afd.entrypoints.llm_outputs",
    "Logprob": "afd.entrypoints.llm_outputs",
}
"""vLLM's offline names (`from afd import LLM, SamplingParams`), each from where it lives."""


def __getattr__(name):
    # Lazy so that `import afd` (the CLI, the node commands) does not pay for torch before it needs it.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
