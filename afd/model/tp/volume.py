"""Communication volume of attention-side TP by formula: the bytes one rank sends in its TP group.

Torch-free, so that `afd check-config` can print it for a model and layout without loading anything. The
figures are exactly what afd.model.tp.comm.TPComm counts (afd_tp_comm_bytes_total), so a measured counter
can be checked against them (tests/test_tp_volume.py does, for every mode).

Notation: G ranks, T tokens in the micro-batch, s = ceil(T / G) rows per token shard, Tp = G * s (T padded),
H the hidden size, b bytes per element, NH heads of v_head_dim v, and

    share(n, k) = n * (k - 1) // k      the part of an n-byte tensor one rank sends in a bandwidth-optimal
                                        collective over k ranks (ring / recursive halving)

Per call: AllReduce of [T, X] sends 2 * share(T*X*b, G); ReduceScatter to and AllGather from [Tp, X] send
share(Tp*X*b, G) (padding included); FC2's all_to_all sends share(Tp*NH/G*v*b, D) in its ODP group of
D = G / P ranks and its ReduceScatter share(P*s*H*b, P) in its OTP group of P ranks.

Per MLA (`gather` before it, o_proj after it):

    allreduce    all_reduce 2*share(T*H*b, G)
    sp           all_gather share(Tp*H*b, G)  + reduce_scatter share(Tp*H*b, G)
    flashcomm1   all_gather share(Tp*W*b, G)  + reduce_scatter share(Tp*H*b, G)
                 W = q_lora_rank + kv_lora_rank + qk_rope_head_dim (the latents; H without a q LoRA)
    flashcomm2   all_gather share(Tp*W*b, G)  + all_to_all share(Tp*NH/G*v*b, D) + reduce_scatter
                 share(P*s*H*b, P)

Per dense MLP (gather before gate/up, down_proj row-parallel): allreduce all_reduce 2*share(T*H*b, G);
every sharded mode all_gather share(Tp*H*b, G) + reduce_scatter share(Tp*H*b, G).

Per MoE layer, allreduce only: the MoE output's all_gather share(Tp*H*b, G) (each rank sends its slice of
the replicated rows to the FFN side, and the ranks gather the results); sharded modes keep their shard.

A decoder layer is 2 MLA + 2 dense MLPs + its MoE (LongCat-Flash), or 1 MLA + 1 dense MLP (DeepSeek-V3:
the dense MLP below first_k_dense_replace, the shared experts above it) + its MoE if it has one.

Once per micro-batch, not per layer: the vocab-parallel embedding's reduce (as an MLP's row-parallel
output: all_reduce 2*share(T*H*b, G), or reduce_scatter share(Tp*H*b, G)) and the logits: sharded modes
all_gather the stream share(Tp*H*b, G), then every mode all_gathers the B last tokens' vocabulary slices,
share(G*B*ceil(V/G)*b, G).

A sharded mode below its token threshold runs, and counts, as allreduce (afd.config.tp.plan).

With KVP (layout.kvp N), each MLA adds the merge's all_to_all inside the N ranks of a head group: the
partial outputs [T, N*NH/G, v] (b bytes) and their log-sum-exps [T, N*NH/G] (fp32), share(., N) of each.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from afd.config.tp import MODES, ShardPlan, TPConfig, TPConfigError, plan

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")

FAMILY_LAYERS = {"longcat_flash": (2, 2), "deepseek_v3": (1, 1)}
"""(MLAs, dense MLPs) per decoder layer of the families whose attention half TP can cut (their
AttentionHalf.supports_tp); Qwen3-MoE's GQA attention has no TP layers."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

TABLE_TOKENS = (1, 16, 256, 4096)


def share(n: int, parts: int) -> int:
    """What one rank sends of an n-byte tensor in a collective over `parts` ranks (TPComm._share)."""
    return n * (parts - 1) // parts


def family_layers(cfg) -> tuple[int, int]:
    """(MLAs, dense MLPs) per decoder layer; raises for a family without attention TP."""
    if cfg.model_type not in FAMILY_LAYERS:
        raise TPConfigError(
            f"layout.attention_tp: {cfg.model_type} has no attention TP (its attention half has "
            f"no TP layers; MLA families do: {', '.join(FAMILY_LAYERS)}), so no TP "
            "communication to compute"
        )
    return FAMILY_LAYERS[cfg.model_type]


def _latent_width(cfg) -> int:
    """What flashcomm1/2 gather per token before an MLA: the q and kv latents, or H without a q LoRA (the
    MLA then gathers the hidden state, as sp does)."""
    if cfg.q_lora_rank is None:
        return cfg.hidden_size
    return cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _row_parallel(p: ShardPlan, H: int, b: int) -> Counter:
    """A row-parallel output [T, H] into the stream: AllReduce, or ReduceScatter of the padded rows."""
    if p.sharded:
        return Counter(reduce_scatter=share(p.padded * H * b, p.size))
    return Counter(all_reduce=2 * share(p.tokens * H * b, p.size))


def _gather(p: ShardPlan, width: int, b: int) -> Counter:
    """The stream's shards [s, width] -> every token's rows [Tp, width]; nothing when replicated."""
    return Counter(all_gather=share(p.padded * width * b, p.size)) if p.sharded else Counter()


def mla_bytes(cfg, tp: TPConfig, p: ShardPlan, b: int) -> Counter:
    """One MLA: the gather of its input (hidden state or latents), then o_proj."""
    H = cfg.hidden_size
    c = _gather(p, _latent_width(cfg) if p.latents else H, b)
    if tp.kvp > 1:  # the KVP merge (afd/model/kvp.py): partial outputs and LSEs of the head group's heads
        heads = cfg.num_attention_heads // tp.size * tp.kvp
        c["all_to_all"] += share(p.tokens * heads * cfg.v_head_dim * b, tp.kvp) + share(p.tokens * heads * 4, tp.kvp)
    if not p.fc2:
        return c + _row_parallel(p, H, b)
    P, D = tp.fc2_otp, tp.odp
    heads_width = cfg.num_attention_heads // tp.size * cfg.v_head_dim  # this rank's o_proj input columns
    c["all_to_all"] += share(p.padded * heads_width * b, D)  # [D, P, s, heads_width] out of the ODP group
    c["reduce_scatter"] += share(P * p.shard * H * b, P)  # [P*s, H] partial over the OTP group
    return c


def mlp_bytes(cfg, p: ShardPlan, b: int) -> Counter:
    """One dense MLP: the gather of its input, then down_proj."""
    return _gather(p, cfg.hidden_size, b) + _row_parallel(p, cfg.hidden_size, b)


def _full(c: Counter) -> dict[str, int]:
    return {k: c.get(k, 0) for k in COLLECTIVES}


@dataclass(frozen=True)
class Volume:
    """Bytes one rank sends for one micro-batch of `tokens` tokens, by collective."""

    tokens: int
    mode: str
    """The mode that runs: the configured one, or allreduce below its threshold."""
    moe_layer: dict[str, int]
    """A decoder layer with an MoE, its MoE-output all_gather (allreduce) included."""
    dense_layer: dict[str, int]
    """A decoder layer without one (DeepSeek-V3's first_k_dense_replace layers)."""
    step: dict[str, int]
    """Once per micro-batch: the embedding's reduce and the logits' gathers (of `seqs` last tokens)."""
    to_ffn: tuple[int, ...]
    """Per TP rank: the bytes of MoE input it sends to each FFN node per MoE layer (the same returns)."""

    @property
    def layer_total(self) -> int:
        return sum(self.moe_layer.values())


def volume(cfg, tp: TPConfig, tokens: int, dtype_bytes: int, seqs: int = 1) -> Volume:
    """The bytes one TP rank sends for a micro-batch of `tokens` tokens (`seqs` sequences) of model cfg."""
    n_mla, n_mlp = family_layers(cfg)
    tp.check_model(cfg.num_attention_heads)
    p, b, H, G = plan(tp, tokens), dtype_bytes, cfg.hidden_size, tp.size
    if G == 1:
        zero = _full(Counter())
        return Volume(tokens, tp.mode, zero, zero, zero, (tokens * H * b,))
    dense: Counter[str] = Counter()
    for _ in range(n_mla):
        dense += mla_bytes(cfg, tp, p, b)
    for _ in range(n_mlp):
        dense += mlp_bytes(cfg, p, b)
    moe = dense.copy()
    if not p.sharded:  # each rank's slice of the MoE output [s, H] -> [Tp, H] on every rank
        moe["all_gather"] += share(p.padded * H * b, G)
    vocab_slice = -(-cfg.vocab_size // G)
    step = _row_parallel(p, H, b) + _gather(p, H, b) + Counter(all_gather=share(G * seqs * vocab_slice * b, G))
    rows = tuple(hi - lo for lo, hi in (p.span(r) for r in range(G)))
    return Volume(
        tokens,
        tp.mode if p.sharded else "allreduce",
        _full(moe),
        _full(dense),
        _full(step),
        tuple(n * H * b for n in rows),
    )


def step_bytes(cfg, tp: TPConfig, tokens: int, dtype_bytes: int, seqs: int = 1) -> dict[str, int]:
    """Everything one rank sends in one step of one micro-batch: every layer plus the step's extras."""
    v = volume(cfg, tp, tokens, dtype_bytes, seqs)
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.num_layers - n_moe
    return {k: n_moe * v.moe_layer[k] + n_dense * v.dense_layer[k] + v.step[k] for k in COLLECTIVES}


# ---- `afd check-config` ------------------------------------------------------------------------------


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table_otp(size: int) -> int:
    """flashcomm2's P for a table row when the layout does not set one: G's largest proper divisor."""
    return next(size // d for d in range(2, size + 1) if size % d == 0)


def mode_configs(tp: TPConfig) -> list[TPConfig]:
    """A TPConfig per mode at the layout's size: the layout's own for its mode (thresholds included),
    vllm-ascend's thresholds (DEFAULT_MIN_TOKENS) for the others."""
    out = []
    for mode in MODES:
        if mode == tp.mode:
            out.append(tp)
        else:
            out.append(TPConfig(tp.size, mode, _table_otp(tp.size) if mode == "flashcomm2" else None))
    return out


def volume_table(cfg, tp: TPConfig, dtype: str = "float32", tokens: tuple[int, ...] = TABLE_TOKENS) -> str:
    """Bytes one rank sends in its TP group per MoE layer, per mode (rows) and micro-batch size (columns),
    the configured mode marked: what `afd check-config` prints for a layout with attention_tp > 1."""
    b = DTYPE_BYTES[dtype]
    head = [
        f"TP communication per attention rank and MoE layer ({cfg.model_type}, attention_tp {tp.size}, {dtype})",
        "  bytes one rank sends in its TP group, as afd_tp_comm_bytes_total counts them (afd.model.tp.volume)",
    ]
    width = 12
    cols = "".join(f"{'T=' + str(t):>{width}}" for t in tokens)
    lines = [f"    {'mode':<20}{cols}"]
    for mc in mode_configs(tp):
        label = mc.mode + (f" (P={mc.otp})" if mc.mode == "flashcomm2" else "")
        cells = []
        for t in tokens:
            v = volume(cfg, mc, t, b)
            mark = "*" if v.mode != mc.mode else ""
            cells.append(f"{mark + _human(v.layer_total):>{width}}")
        lines.append(f"  {'>' if mc is tp else ' '} {label:<20}{''.join(cells)}")
    step = [sum(volume(cfg, tp, t, b, seqs=t).step.values()) for t in tokens]
    lines.append(f"    {'+ per step':<20}" + "".join(f"{_human(n):>{width}}" for n in step))
    ffn = [volume(cfg, tp, t, b).to_ffn[0] for t in tokens]
    lines.append(f"    {'to each FFN node':<20}" + "".join(f"{_human(n):>{width}}" for n in ffn))
    notes = [
        "  >  the configured mode (layout.tp_comm); * below the mode's token threshold: runs, and counts, as allreduce",
        "  allreduce includes each MoE layer's all_gather of the MoE output",
        f"  + per step: once per micro-batch in the configured mode ({tp.mode}), not per layer: the "
        "embedding's reduce and",
        "    the logits of T sequences (a decode step)",
        "  to each FFN node: the MoE input rank 0 sends per MoE layer, in every mode (its token shard, or its "
        "slice of a",
        "    replicated micro-batch); the output comes back the same size",
    ]
    n_dense = cfg.num_layers - len(cfg.moe_layers)
    if n_dense:
        notes.append(
            f"  the {n_dense} dense layer(s) send nothing to the FFN side and, in allreduce, gather no MoE output"
        )
    return "\n".join(head + lines + notes)


def check_config_report(cluster, model_cfg) -> str | None:
    """The table for a loaded cluster YAML (afd.config.loader.ClusterConfig, its dtype resolved) whose
    attention nodes have attention_tp > 1; None when there is none, or a line saying why not when the model
    (`model_cfg`) is not readable here."""
    layout = cluster.layout
    size = getattr(layout, "attention_tp", 1)
    if size <= 1:
        return None
    tp = TPConfig(
        size,
        getattr(layout, "tp_comm", "allreduce"),
        getattr(layout, "flashcomm2_otp", None),
        getattr(layout, "tp_comm_min_tokens", None),
        getattr(layout, "kvp", 1),
    )
    if model_cfg is None:
        return f"(model {cluster.model.path} not readable here: no TP communication volume to show)"
    return volume_table(model_cfg, tp, cluster.model.dtype)
