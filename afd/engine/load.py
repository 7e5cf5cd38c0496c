"""A model's halves loaded from a configuration: the one assembly an attention node, the colocated server and
afd.LLM share (an FFN node loads the experts it holds: ffn_node/node.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from afd.backend.base import Backend
from afd.config.schema import ClusterConfig
from afd.model.checkpoint import build_attention_half, build_ffn_half, build_mtp_layer, open_reader, serving_quant
from afd.model.config import ModelConfig, parse_dtype
from afd.model.halves import AttentionHalf, FFNHalf
from afd.model.mtp import MTPLayer

log = logging.getLogger("afd.engine")


@dataclass
class Halves:
    """What the attention side loads from the checkpoint (before any data plane forms)."""

    attn: AttentionHalf
    """The whole attention half (an attention node cuts it to its TP rank's share)."""
    mtp: MTPLayer | None = None
    """The MTP module, with engine.speculative_tokens."""
    ffn: FFNHalf | None = None
    """Every expert where the cluster has no FFN nodes (colocated); with layout.routing attention, the routers
    alone (an FFN half holding no expert); else None: the FFN nodes hold the experts."""

    @classmethod
    def load(cls, cfg: ClusterConfig, model_path: str, model_cfg: ModelConfig, backend: Backend) -> Halves:
        """The attention half, the MTP module with engine.speculative_tokens and, where the cluster has no FFN
        nodes, every expert (the MTP layer's too), in model.dtype under model.quantization."""
        reader = open_reader(model_path, cfg.model.dummy_weights, cfg.model.seed)
        quant = serving_quant(model_path, cfg.model.quantization, backend)
        dtype, device = parse_dtype(cfg.model.dtype), backend.device
        built = cls(build_attention_half(model_cfg, reader, dtype, device, quant))
        mtp = cfg.engine.speculative_tokens > 0
        if mtp:
            built.mtp = build_mtp_layer(model_cfg, reader, dtype, device, quant)
        if cfg.colocated:
            built.ffn = build_ffn_half(model_cfg, reader, dtype, device, mtp=mtp, quant=quant)
        elif cfg.routing == "attention":
            built.ffn = build_ffn_half(model_cfg, reader, dtype, device, experts=(), mtp=mtp)
        log.info("attention half loaded from %s%s", model_path, " with every expert" if cfg.colocated else "")
        return built
