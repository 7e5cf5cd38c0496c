"""A hardware spec and a model's shape -> the CostModel `afd profile` measures here (afd.plan.costs), by a
roofline: each kernel takes max(FLOPs / peak compute, bytes / memory bandwidth) plus one launch, and a piece
of a layer (attention before the exchange, the ScMoE window, after it; the FFN node's MoE) is the sum of its
kernels (afd.plan.roofline_ops lists them). The sums are exact at any x (`Roofline.time`); the CostModel is
their least-squares line over the x a plan will use, each with its largest relative error, as a profile's.

Attention TP (tp_comm allreduce, afd's default) adds its collectives as ops on the spec's intra-node fabric,
with afd.model.tp.volume's bytes: a ring's bytes over the bandwidth plus a latency per hop.

What a roofline leaves out, so what makes it a lower bound on time: peaks no kernel reaches (scale them with
`compute_eff`, `memory_eff`), kernels not overlapping, caches, the sharded TP modes (sp, flashcomm), and the
exchange (the link is the spec's fabric, for the simulator to apply)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from afd.model.config import ModelConfig
from afd.model.deepseek_v4.config import DeepseekV4Config
from afd.model.longcat_flash.config import LongcatFlashConfig
from afd.plan import roofline_v4
from afd.plan.costs import CostModel, LayerCosts, Linear, Link, fit
from afd.plan.hardware import HardwareSpec, SpecError
from afd.plan.roofline_ops import Op, Precision, attention_pieces, ffn_ops, router, step_ops

MODEL_DTYPES = {"bfloat16": ("bf16", 2), "float16": ("fp16", 2), "float32": ("fp32", 4)}
QUANT_GEMM = {"fp8": "fp8", "w8a8": "int8", "w8a16": None}
"""--quantization's methods (afd.quant.scheme) -> the compute their GEMMs run at (None: the model dtype's);
each stores weights in 1 byte."""
DEFAULT_TOKENS = (8, 16, 32, 64, 128, 256)
PIECES = ("attn_pre", "attn_window", "attn_post", "ffn", "dense", "step")


def precision(spec: HardwareSpec, dtype: str, quantization: str | None) -> Precision:
    """Bytes and compute keys of `dtype` under `quantization`; SpecError if the device cannot run them (fp8
    on a3)."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"roofline dtype {dtype!r}: expected one of {', '.join(MODEL_DTYPES)}")
    key, act = MODEL_DTYPES[dtype]
    if quantization is not None and quantization not in QUANT_GEMM:
        raise ValueError(f"quantization {quantization!r}: expected one of {', '.join(QUANT_GEMM)} or none")
    gemm_key = key if quantization is None else (QUANT_GEMM[quantization] or key)
    for k in {key, gemm_key}:
        try:
            spec.flops(k)
        except SpecError as e:
            raise SpecError(f"{e}: {dtype}{' with ' + quantization if quantization else ''} cannot run there") from None
    return Precision(act=act, weight=act if quantization is None else 1, model_key=key, gemm_key=gemm_key)


@dataclass(frozen=True)
class Roofline:
    """One model on one device: each piece's kernels, timed exactly at any x."""

    spec: HardwareSpec
    model: str
    dtype: str
    pieces: dict[str, tuple[Op, ...]]
    rows_per_token: float
    """Token-expert rows one FFN node computes per token an attention rank sends (K_routed * E_local / E)."""
    fabric: str = "inter_node"
    compute_eff: float = 1.0
    memory_eff: float = 1.0
    launch: float | None = None
    """Seconds per kernel launch; None: the spec's (an eager launch; graph mode takes less)."""
    notes: tuple[str, ...] = ()
    attn_tp: int = 1
    """Attention ranks per attention node its pieces are for (the CostModel's attention_tp)."""

    def op_time(self, op: Op, x: float) -> tuple[float, str]:
        """(seconds, what bounds it: compute, memory, or link for a TP collective) of one kernel at x."""
        launch = self.spec.launch_overhead if self.launch is None else self.launch
        if op.link_hops:  # a TP collective over the node's own fabric
            ln = self.spec.intra_node
            t = op.link_bytes_per_x * x / ln.bandwidth + op.link_hops * ln.latency + launch
            return t * op.share, "link"
        tc = op.flops(x) / (self.spec.flops(op.compute) * self.compute_eff)
        tm = op.nbytes(x) / (self.spec.memory_bandwidth * self.memory_eff)
        return (max(tc, tm) + launch) * op.share, ("compute" if tc > tm else "memory")

    def time(self, piece: str, x: float) -> float:
        """Seconds of `piece` (PIECES) at x tokens (rows for `ffn`, sequences for `step`); 0 at x <= 0."""
        if x <= 0:
            return 0.0
        return sum(self.op_time(op, x)[0] for op in self.pieces[piece])

    def bound(self, piece: str, x: float) -> str:
        """Which of compute, memory and link the piece's time is mostly spent on at x."""
        t = {"compute": 0.0, "memory": 0.0, "link": 0.0}
        for op in self.pieces[piece]:
            s, b = self.op_time(op, x)
            t[b] += s
        return max(t, key=lambda k: t[k]) if any(t.values()) else "-"

    def held_bytes(self, piece: str) -> float:
        """Weight bytes a device holds for one layer's `piece` (memory per device: `afd plan`)."""
        return sum(op.weight_bytes * op.share for op in self.pieces[piece])

    def _line(self, piece: str, xs: Sequence[float]) -> Linear:
        if not self.pieces[piece]:
            return Linear(0.0, 0.0)
        line = fit(list(xs), [self.time(piece, x) for x in xs])
        return Linear(line.slope, line.intercept, line.rel_err, 0)  # points 0: derived, not measured

    def cost_model(self, tokens: Sequence[float] = DEFAULT_TOKENS, rows: Sequence[float] | None = None) -> CostModel:
        """The CostModel over `tokens` per attention rank (and sequences per step) and `rows` per FFN node
        (default: the rows those tokens put on one node, tokens * rows_per_token)."""
        rows = rows if rows is not None else [t * self.rows_per_token for t in tokens]
        pre, win, post = (self._line(p, tokens) for p in ("attn_pre", "attn_window", "attn_post"))
        layer_lines = (pre, win, post, self._line("ffn", rows))
        layer = LayerCosts(*layer_lines)
        link = self.spec.link(self.fabric)
        fits = (
            f"fitted over tokens {list(tokens)} and rows {[round(r, 2) for r in rows]}; largest relative errors: "
            + ", ".join(
                f"{n} {v.rel_err:.1%}" for n, v in zip(("attn_pre", "attn_window", "attn_post", "ffn"), layer_lines)
            )
        )
        return CostModel(
            source=f"hardware {self.spec.name}",
            model=self.model,
            dtype=self.dtype,
            moe_layer=layer,
            dense_layer=self._line("dense", tokens),
            step_overhead=self._line("step", tokens),
            link=Link(link.latency, link.bandwidth),
            notes=(*self.notes, f"link: {self.fabric} ({link.fabric})", fits),
            attention_tp=self.attn_tp,
        )

    def describe(self, tokens: Sequence[float]) -> str:
        """A table of each piece's time (us) and bound at each token count: the docs' per-layer figures."""
        head = f"{'tokens':>7} {'rows':>7} " + " ".join(
            f"{p:>18}" for p in ("attn_pre", "attn_window", "attn_post", "ffn")
        )
        lines = [head]
        for t in tokens:
            r = t * self.rows_per_token
            cells = [(p, t) for p in ("attn_pre", "attn_window", "attn_post")] + [("ffn", r)]
            lines.append(
                f"{t:>7g} {r:>7.4g} "
                + " ".join(f"{self.time(p, x) * 1e6:>10.1f} {self.bound(p, x)[:3]:>7}" for p, x in cells)
            )
        return "\n".join(lines)


def roofline(
    spec: HardwareSpec,
    cfg: ModelConfig,
    *,
    model: str = "",
    dtype: str = "bfloat16",
    quantization: str | None = None,
    context: int = 4096,
    attn_tp: int = 1,
    ffn_nodes: int = 1,
    routed_per_token: float | None = None,
    fabric: str = "inter_node",
    compute_eff: float = 1.0,
    memory_eff: float = 1.0,
    launch: float | None = None,
    routing: str | None = None,
) -> Roofline:
    """The roofline of `cfg` on `spec`. `context`: KV positions each decoding sequence reads (its length so
    far); `attn_tp`: attention ranks one attention node's heads are split over; `ffn_nodes`: FFN nodes the
    routed experts are split over evenly (E_local = ceil(E / ffn_nodes)); `routed_per_token`: experts a
    token reaches that compute (default K, or for LongCat-Flash K times the routed share of its router's
    outputs, n_routed / (n_routed + zero): a uniform router's expectation); `launch`: seconds per kernel
    instead of the spec's eager launch (graph mode: captured kernels start with little host cost); `routing`:
    where the router runs, as layout.routing (attention: in attn_pre; ffn: on every FFN node, for every token
    it is sent), by default as afd resolves it (attention with more than one FFN node)."""
    if context < 0 or attn_tp < 1 or ffn_nodes < 1:
        raise ValueError(f"context >= 0, attn_tp >= 1, ffn_nodes >= 1; got {context}, {attn_tp}, {ffn_nodes}")
    if not (0 < compute_eff <= 1 and 0 < memory_eff <= 1) or (launch is not None and launch < 0):
        raise ValueError(f"efficiencies in (0, 1], launch >= 0; got {compute_eff}, {memory_eff}, {launch}")
    spec.link(fabric)
    p = precision(spec, dtype, quantization)
    E, K = cfg.n_routed_experts, cfg.experts_per_token
    if routed_per_token is None:
        total = cfg.num_experts_total if isinstance(cfg, LongcatFlashConfig) else E
        routed_per_token = K * E / total
    e_local = math.ceil(E / ffn_nodes)
    rows_per_token = routed_per_token * e_local / E
    by_ids = cfg.routes_by_token_ids  # DeepSeek-V4's hash layers
    routing = routing or ("attention" if ffn_nodes > 1 or by_ids else "ffn")
    if routing not in ("attention", "ffn"):
        raise ValueError(f"routing {routing!r}: expected attention or ffn")
    if routing == "ffn" and by_ids:
        raise ValueError(
            f"routing ffn: {cfg.model_type}'s router reads the token ids, so it routes on the attention side"
        )
    if isinstance(cfg, DeepseekV4Config):
        pieces = roofline_v4.attention_pieces(cfg, p, context, attn_tp)
        pieces["step"] = step_ops(cfg, p, attn_tp) + roofline_v4.step_ops(cfg, p)
    else:
        pieces = attention_pieces(cfg, p, context, attn_tp)
        pieces["step"] = step_ops(cfg, p, attn_tp)
    if routing == "attention":
        pieces["attn_pre"].append(router(cfg, p))
    pieces["ffn"] = ffn_ops(cfg, p, e_local, 1.0 / rows_per_token if routing == "ffn" else None)
    notes = (
        f"roofline of {spec.name} ({spec.origin}): context {context}, attention TP {attn_tp}, {ffn_nodes} FFN "
        f"node(s) of {e_local} experts, {routed_per_token:g} routed experts per token, routing {routing}, {dtype}"
        + (f", quantization {quantization}" if quantization else "")
        + f", efficiency compute {compute_eff:g} memory {memory_eff:g}"
        + f", launch {(spec.launch_overhead if launch is None else launch) * 1e6:g} us per kernel",
        "a lower bound: peaks, no overlap between kernels, uniform routing; TP collectives as tp_comm allreduce",
    )
    return Roofline(
        spec,
        model or cfg.model_type,
        dtype,
        {k: tuple(v) for k, v in pieces.items()},
        rows_per_token,
        fabric,
        compute_eff,
        memory_eff,
        launch,
        notes,
        attn_tp,
    )
