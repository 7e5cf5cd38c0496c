"""Every family's tiny HF checkpoints and HF reference, in one table the conformance suite
(tests/test_families.py) and the session fixtures (tests/conftest.py) run over."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import hf_deepseek
import hf_qwen3
import hf_reference

# The fp32 fixtures' weight scale (0.2, 10x HF's init) makes the tiny models chaotic: bf16 rounding alone
# then flips expert choices often and HF's own sdpa and eager bf16 paths differ by up to 3 logits.
# At 0.05 (2.5x HF's init) routing and attention still vary per token while the differences stay at
# the rounding level. Expert sizes are multiples of 8 so that HF's default grouped_mm experts (16-byte
# strides) load: HF exactly as a user loads it.
BF16_WEIGHT_STD = 0.05


@dataclass(frozen=True)
class HFFamily:
    make: Callable[..., str]
    """make(path, seed=..., weight_std=..., **config overrides) -> path, saved by transformers."""
    greedy: Callable
    """greedy(path, prompts, new_tokens) -> per prompt (ids, per-step fp32 logits), HF generate."""
    configs: dict[str, dict]
    """Named tiny configs (make's keyword arguments): each runs colocated against HF."""
    multi: str
    """The config the multi-process paths run (one cluster per path and family)."""
    hf_config: str
    """transformers' config class, for the defaults HF gives a missing key."""
    base: dict
    """A full config's keyword arguments (what a saved config.json of the family holds)."""
    bf16: dict = field(default_factory=dict)
    """make's arguments for the bf16 parity checkpoint (with weight_std BF16_WEIGHT_STD)."""
    full_length: bool = True
    """HF generates every reference token without an EOS on every prompt, so every step is compared."""


FAMILIES = {
    "longcat_flash": HFFamily(
        hf_reference.make_hf_checkpoint,
        hf_reference.hf_greedy,
        hf_reference.TINY_CONFIGS,
        "zero_experts",
        "LongcatFlashConfig",
        hf_reference.BASE,
        dict(seed=0),
        full_length=False,  # some prompts end at EOS (the stop itself is compared)
    ),
    "qwen3_moe": HFFamily(
        hf_qwen3.make_qwen3_checkpoint,
        hf_qwen3.hf_greedy,
        hf_qwen3.TINY_CONFIGS,
        "sparse_step",  # dense and sparse layers, GQA, tied lm_head
        "Qwen3MoeConfig",
        {**hf_qwen3.BASE, "mlp_only_layers": [1]},
        dict(seed=0, moe_intermediate_size=16),
    ),
    "deepseek_v3": HFFamily(
        hf_deepseek.make_deepseek_checkpoint,
        hf_deepseek.hf_greedy,
        hf_deepseek.DEEPSEEK_CONFIGS,
        "grouped",  # dense-first, grouped routing
        "DeepseekV3Config",
        hf_deepseek.BASE,
        dict(seed=10, moe_intermediate_size=16),
    ),
}
