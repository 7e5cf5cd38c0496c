"""What the MoE exchange of a cluster YAML costs on the wire, by formula: what `afd check-config` prints.

Broadcast (routing ffn) sends every token to every FFN node; dispatch (routing attention) sends a token
to the nodes holding its chosen experts, with its K ids and weights: fanout x (hidden bytes + 8K) per token,
plus an 8-byte count per node, layer and micro-batch. The expected fanout is that of uniform routing
(afd.config.placement.expected_fanout); a real router's skew moves it, and afd_exchange_bytes_total
counts what was sent (afd.dataplane.protocol.dispatch_bytes, per message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd.dataplane.protocol import COUNT_BYTES, element_bytes, exchange_table, hidden_bytes, row_bytes

if TYPE_CHECKING:
    from afd.config.placement import Placement


def per_token(hidden: int, dtype, top_k: int, exchange_dtype: str, nodes: int, fanout: float) -> dict[str, float]:
    """Bytes per token per MoE layer an attention rank sends (to_ffn) and receives (to_attention), for
    broadcast to `nodes` FFN nodes and for dispatch at `fanout` nodes per token (counts left out: they are
    per micro-batch, not per token)."""
    back = hidden * element_bytes(dtype)
    return {
        "broadcast to_ffn": nodes * hidden_bytes(hidden, dtype, exchange_dtype),
        "broadcast to_attention": nodes * back,
        "dispatch to_ffn": fanout * row_bytes(hidden, dtype, top_k, exchange_dtype),
        "dispatch to_attention": fanout * back,
    }


def exchange_report(cfg, model_cfg, placement: Placement) -> str:
    """The placement, each token's fan-out and the bytes per token per layer, for the YAML's routing."""
    from afd.config.placement import format_experts, max_fanout, routed_fanout

    lay = cfg.layout
    groups, keep = model_cfg.expert_groups
    K, H, F = model_cfg.experts_per_token, model_cfg.hidden_size, len(placement.nodes)
    lines = [f"expert placement ({model_cfg.n_routed_experts} routed experts, top-{K}, routing {cfg.routing}):"]
    for name, held in zip(placement.nodes, placement.held):
        lines.append(f"  {name:<10} {len(held):>4} experts: {format_experts(held)}")
    replicated = [e for e in range(placement.n_routed) if len(placement.holders(e)) > 1]
    if replicated:
        lines.append(f"  replicated: {format_experts(replicated)} (their tokens split across holders)")
    if cfg.routing == "ffn":
        lines.append("  every token goes to every FFN node (broadcast)")
        lines.append(exchange_table(H, len(model_cfg.moe_layers), F, cfg.model.dtype, lay.exchange_dtype))
        return "\n".join(lines)
    fan = routed_fanout(placement, K, groups, keep, model_cfg.identity_experts)  # identity picks stay home
    bound = max_fanout(placement, K, groups, keep)
    lines.append(
        f"  fan-out per token: {fan:.2f} of {F} FFN nodes expected (uniform routing), at most {bound}"
        + (f" (topk_group {keep} of {groups} groups)" if groups > 1 and keep < groups else "")
        + (" (identity picks stay on the attention side)" if model_cfg.identity_experts else "")
    )
    cost = per_token(H, cfg.model.dtype, K, lay.exchange_dtype, F, fan)
    lines.append(
        f"  bytes per token per MoE layer (layout.exchange_dtype {lay.exchange_dtype}, model {cfg.model.dtype}, "
        f"hidden {H}; afd.dataplane.protocol):"
    )
    for what, b in cost.items():
        lines.append(f"    {what:<24} {b:>12.1f}")
    ratio = cost["dispatch to_ffn"] / cost["broadcast to_ffn"]
    lines.append(
        f"  dispatch/broadcast sent: {ratio:.2f}x; plus {COUNT_BYTES} B per FFN node, layer and micro-batch (counts)"
    )
    return "\n".join(lines)
