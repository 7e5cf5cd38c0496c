"""The family contract: what every model family's attention half, FFN half and MTP block provide.

A family subclasses these (afd/model/<family>/attention.py, ffn.py, mtp.py) and the registry
(afd.model.registry) names its classes. The runner, KV cache, data plane, FFN server, loader and graph
mode call only what is declared here: a required hook is abstract, an optional one has its default here,
so the code that uses a half never probes it with getattr/hasattr (tests/test_layout.py checks that).

Decoder layer i of any family is

    h, m = pre_moe(i, x, rope, meta, kv)     # m: the MoE input that crosses to the FFN half, None if dense
    h = post_moe(i, h, m, rope, meta, kv)    # the work that needs no MoE output (the overlap window)
    x = h + FFNHalf(i, m)                    # on the FFN nodes, for MoE layers only
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from afd.model.attention_metadata import AttentionMetadata
from afd.model.config import ModelConfig
from afd.model.tp.comm import SINGLE, TPComm

if TYPE_CHECKING:
    from afd.backend import Backend
    from afd.model.experts import Experts
    from afd.quant.scheme import QuantSpec

Rope = tuple[torch.Tensor, ...]
"""The rotary tables `embed` makes once per step and every layer reads (cos, sin)."""


class LoadedModule(nn.Module, ABC):
    """What afd.model.checkpoint asks of every module it builds from a checkpoint (both halves and the
    MTP layer)."""

    keep_in_fp32: ClassVar[tuple[str, ...]] = ()
    """Parameter / buffer name suffixes kept fp32 when the model serves fp16 (HF's
    `_keep_in_fp32_modules`, under afd's names). Read by afd.model.checkpoint.kept_in_fp32."""

    keep_in_fp32_strict: ClassVar[tuple[str, ...]] = ()
    """Name suffixes kept fp32, at the checkpoint's precision, in an fp16 or bf16 model (HF's
    `_keep_in_fp32_modules_strict`). Read by afd.model.checkpoint.kept_in_fp32."""

    unquantized: ClassVar[tuple[str, ...]] = ()
    """Name fragments of linears `--quantization` leaves in the model dtype, as the family's released checkpoint
    stores them in 16 bits (DeepSeek-V4's compressors and indexer weights). Read by
    afd.model.quant_layers.quantize_linears."""

    quant: QuantSpec | None = None
    """The scheme the half serves with (afd.quant), set by afd.model.checkpoint's builders: an FFN half's
    experts are 8-bit from the load; an attention half's or MTP layer's linears are quantized by
    afd.engine.factory once the half is cut for TP (afd.model.quant_layers)."""

    def post_load(self) -> None:
        """Called by afd.model.checkpoint once the weights are loaded and cast, before the CPU layout is
        applied: a family's last touch on the loaded values (default: nothing)."""


class AttentionHalf(LoadedModule):
    """Everything of the model but the routed experts: embeddings, attention (with its KV cache),
    dense MLPs, whatever of a layer runs beside the MoE, the final norm and the head.

    Its parameter names are the checkpoint's (the family's weights.py maps them)."""

    embed_tokens: nn.Module
    """Token ids -> embeddings [T, H]."""
    rotary: Any
    """The rotary tables of a step's positions (`cos_sin(positions, dtype)`), read by the default `embed`."""
    norm: nn.Module
    """The final norm (MTP drafting reads the main model's hidden state after it)."""
    lm_head: nn.Module
    """The head: hidden states -> vocabulary logits (MTP drafts through it too)."""

    supports_tp: ClassVar[bool] = False
    """afd.model.tp.shard can cut this half across the ranks of a TP group (its layers are the kinds
    shard knows: MLA and dense MLPs). Read by afd.model.tp.shard and afd.entrypoints.llm (which refuses
    attention_tp > 1 early for a half without it)."""

    supports_graph: ClassVar[bool] = True
    """Graph mode (afd.engine.graph) may compile this half's layers: they read the step's metadata through
    tensors only. A half that walks the sequences on the host (DeepSeek-V4's compressed attention) runs
    eager. Read by afd.engine.graph.wrap."""

    tp: TPComm = SINGLE
    """The TP group this half is cut for (afd.model.tp.shard sets it); SINGLE when it is whole."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, Rope]:
        """Token embeddings [T, H] and the rotary tables every layer of this step shares. Called by the
        runner once per micro-batch. Default: embed_tokens, and rotary's (cos, sin) at the step's positions."""
        x = self.embed_tokens(input_ids)
        return x, self.rotary.cos_sin(meta.positions, x.dtype)

    @abstractmethod
    def pre_moe(
        self, i: int, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i up to its MoE input: (h, m), m [T, H] the tensor sent to the FFN half, or None on a
        dense layer (nothing crosses). kv is layer i's slice of the KV cache (cfg.kv_cache_shape)."""

    @abstractmethod
    def post_moe(
        self, i: int, h: torch.Tensor, m: torch.Tensor | None, rope: Rope, meta: AttentionMetadata, kv: torch.Tensor
    ) -> torch.Tensor:
        """Layer i's work that does not need the MoE output (the window the exchange hides behind; a
        dense layer's MLP). The runner adds the MoE output to what this returns."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of the last layer's output x [T, H]. Default: the final norm, then the head."""
        return self.lm_head(self.norm(x)).float()

    def combine(self, i: int, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x for layer i + 1 from post_moe's h and the MoE output y [T, H]. Default: h + y. A family whose
        residual is not one [T, H] stream (DeepSeek-V4's mHC streams) expands y here."""
        return h + y

    def mtp_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """What the MTP module drafts from, of the last layer's output x: the final norm's output by default;
        DeepSeek-V4's MTP reads the mHC streams themselves. Read by afd.engine.runner."""
        return self.norm(x)

    def moe_reads_token_ids(self, i: int) -> bool:
        """Whether layer i's router needs the tokens' ids (DeepSeek-V4's hash-routed layers): the runner
        then passes them to the exchange with m. Default: no."""
        return False

    def prefetch_weights(self, i: int, phase: str) -> list[torch.Tensor]:
        """The weights graph mode (afd.engine.graph_half) prefetches at the end of layer i's `phase`
        graph ("pre" or "post"): those the next graph reads first. Default: none."""
        return []


class FFNHalf(LoadedModule):
    """The routed experts `held` of every MoE layer, and the routers that pick them.

    A family with an MoE MTP layer (DeepSeek-V3) takes `mtp` too: afd.model.checkpoint.build_ffn_half
    passes it only when the MTP module's MoE layers are to be held."""

    def __init__(self, cfg: ModelConfig, experts=None, serves_zero: bool = True):
        """The routed experts `experts` (ids of cfg.n_routed_experts, any order; all by default, none: an
        empty tuple, the routers alone, as the attention side routes with them); `serves_zero`: this
        holder also adds the identity ("zero") experts' share, in families that have them."""
        super().__init__()
        n = cfg.n_routed_experts
        held = tuple(range(n)) if experts is None else tuple(sorted(set(experts)))
        if any(not 0 <= e < n for e in held):
            raise ValueError(f"experts {held} outside [0, {n})")
        self.cfg, self.held, self.serves_zero = cfg, held, serves_zero

    mtp_layers: tuple[int, ...] = ()
    """MoE layers past the decoder's that this half also holds: the MTP module's (afd.model.mtp), which
    FLAG_MTP steps run (afd.dataplane.protocol). Read by the FFN server and its metrics."""

    @abstractmethod
    def forward(self, backend: Backend, i: int, m: torch.Tensor) -> torch.Tensor:
        """This node's share of layer i's MoE output on m [T, H]: the FFN server's one call per layer. A
        family whose router reads token ids (AttentionHalf.moe_reads_token_ids) also takes `token_ids` [T]."""

    def routed(
        self, backend: Backend, i: int, m: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """This node's share of layer i's MoE output on m [T, H] routed by the attention side (weights [T, K]
        fp32, ids [T, K], -1 where another node computes the slot): the experts alone, no router."""
        experts = cast("Experts", self.layer(i).experts)
        return experts(backend, m, weights, ids)

    @abstractmethod
    def layer(self, i: int) -> nn.Module:
        """Layer i's MoE: a module with `router.classifier` (nn.Linear) and `experts`
        (afd.model.experts.Experts), which metrics and weight prefetch read."""

    def extra_checkpoint_keys(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(key, shape) of tensors a hub-layout checkpoint holds that afd never reads but transformers
        needs to load it; afd.model.demo writes them (as zeros). Default: none."""
        return iter(())


class MTPBlock(nn.Module, ABC):
    """The transformer block of a family's multi-token-prediction module (afd.model.mtp.MTPLayer wraps
    it): a decoder layer's split, on its own KV cache layer."""

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Its KV cache layer, addressed by the main model's block tables."""

    @abstractmethod
    def pre_moe(
        self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As AttentionHalf.pre_moe for the block: (h, m), m None when the block is dense."""

    @abstractmethod
    def post_moe(
        self, h: torch.Tensor, m: torch.Tensor | None, rope: Rope, meta: AttentionMetadata, kv: torch.Tensor
    ) -> torch.Tensor:
        """As AttentionHalf.post_moe for the block; the caller adds the MoE output."""
