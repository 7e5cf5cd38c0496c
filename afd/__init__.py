"""afd: Attention-FFN Disaggregated serving for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import afd` (the CLI, the node commands) does not pay for torch before it needs it.
    if name == "LLM":
        from afd.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "__version__"]
