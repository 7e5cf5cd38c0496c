"""The cost model every part of afd.plan shares: times of one MoE layer's pieces as linear functions of the
tokens they carry, and the link's latency and bandwidth. `afd profile` fits them from measurements on this
machine (afd.plan.profile); a hardware spec makes them from a roofline for a device that is not here
(afd.plan.hardware); the simulator (afd.plan.simulate) and `afd plan` read them.

Units: seconds, tokens, bytes. Every fit keeps its error, so that a plan built on it can say how far to
trust it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Linear:
    """t(x) = slope * x + intercept, as fitted (least squares) or derived; `rel_err` is the fit's largest
    relative error over the points it was fitted to (0 for a derived model)."""

    slope: float
    intercept: float
    rel_err: float = 0.0
    points: int = 0
    """How many measurements it was fitted to (0: derived from a hardware spec)."""

    def __call__(self, x: float) -> float:
        return max(0.0, self.slope * x + self.intercept) if x > 0 else 0.0

    def __post_init__(self):
        if self.slope < 0 or self.intercept < 0:
            raise ValueError(f"a time model must not be negative: slope {self.slope}, intercept {self.intercept}")


def fit(xs: list[float], ts: list[float]) -> Linear:
    """Least-squares line through (x, t), clipped so that neither coefficient is negative (a negative
    intercept from noise would predict negative times at small x)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError(f"a line needs at least two distinct x, got {sorted(set(xs))}")
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx)
    intercept = max(0.0, mt - slope * mx)
    err = max(abs(slope * x + intercept - t) / t for x, t in zip(xs, ts) if t > 0) if any(ts) else 0.0
    return Linear(slope, intercept, err, n)


@dataclass(frozen=True)
class Link:
    """One attention <-> FFN path: t(bytes) = latency + bytes / bandwidth."""

    latency: float
    """Seconds for a message of no bytes (the transport's per-message cost included)."""
    bandwidth: float
    """Bytes per second."""
    rel_err: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True)
class LayerCosts:
    """One decoder layer's times, per micro-batch.

    Attention side (per attention rank, x = tokens of the micro-batch on that rank): `attn_pre` is what runs
    before the MoE inputs can be sent (attention, the router under routing `attention`), `attn_window` what
    runs while they are away and does not need the MoE's result (LongCat-Flash's shortcut branch, DeepSeek's
    shared experts: the ScMoE window), `attn_post` what needs it (combine, residual). A dense layer has only
    `attn_pre`. FFN side (per FFN node, x = token-expert rows it computes): `ffn`."""

    attn_pre: Linear
    attn_window: Linear = field(default_factory=lambda: Linear(0.0, 0.0))
    attn_post: Linear = field(default_factory=lambda: Linear(0.0, 0.0))
    ffn: Linear = field(default_factory=lambda: Linear(0.0, 0.0))


@dataclass(frozen=True)
class CostModel:
    """What the simulator needs of a model on some hardware. `source` says where it came from: "profile
    FILE" (measured here) or "hardware NAME" (a roofline)."""

    source: str
    model: str
    """The model's name (its config.json path or hub name) the costs are for."""
    dtype: str
    moe_layer: LayerCosts
    """Every MoE layer costs the same (the families afd serves repeat one MoE layer shape)."""
    dense_layer: Linear
    """A dense layer's attention-side time (DeepSeek-V3's first layers, Qwen3's mlp_only_layers)."""
    step_overhead: Linear
    """Per decode step and attention rank, outside the layers: embed, logits, sampling, scheduling (x =
    sequences in the step)."""
    link: Link
    notes: tuple[str, ...] = ()
    attention_tp: int = 1
    """Ranks one attention node's heads were split over where the attention-side costs were measured or derived:
    they hold only at that TP (`afd plan` searches no other with a profile)."""
    submit: Linear = field(default_factory=lambda: Linear(0.0, 0.0))
    """Attention-side time to submit one micro-batch's exchange under routing `ffn` (x = tokens): posting its
    sends and receives, after attn_pre. A roofline counts it in the kernels' launches (0 here)."""
    submit_dispatch: Linear = field(default_factory=lambda: Linear(0.0, 0.0))
    """The same under routing `attention`, where the submit also routes the tokens and groups them by FFN node
    (afd.dataplane.dispatch). A roofline has the router in attn_pre already (0 here)."""
    ffn_message: float = 0.0
    """An FFN node's time per attention rank's message in a layer pass, outside its compute: the receive's
    handling, the result's send, its loop, on the node's own timeline (so ping-pong's two passes a layer pay it
    twice). `afd profile` measures it from the round trips attention node 0 waited for without overlap (the
    wait per MoE layer less the link both ways and the FFN compute); 0 under overlap (the wait is then what
    the window did not hide) and from a roofline."""
    ffn_message_dispatch: float = 0.0
    """ffn_message under routing `attention`: measured the same way on the cluster routed there, where each
    message comes as a count and then its rows, and the attention rank adds each node's partial back in (the
    combine, afd.dataplane.dispatch) before its wait ends."""
    host_cores: int = 0
    """CPU cores of the one host every node process of a plan on these costs shares (a CPU profile's machine:
    its plans run there, afd.entrypoints.plan writes them for one host); 0: each node has a device of its own.
    The simulator then runs every compute task on one of these cores as well as on its node, and holds the step
    to the host's CPU: at least every process's CPU of the step over these cores."""
    message_cpu: float = 0.0
    """Host CPU seconds one message (either way between an attention rank and an FFN node) costs its two node
    processes outside every timed piece and the FFN compute: the submit, the transport's threads, the receive's
    handling. `afd profile` measures it from the node processes' CPU time; it counts only under `host_cores`
    (on a device the host's CPU is not what the step waits for)."""
    rendezvous: bool = False
    """The data plane sends a message's bytes only once its receiver has posted the receive and said so (gloo's
    tcp transport: a send notice, a receive notice, then the bytes, gloo/transport/tcp/pair.cc). The FFN node
    posts routing ffn's rows ahead, but under routing attention the rows' receive waits for the count and for
    the node to finish the micro-batch before: the rows then wait for that, the notice's way back, and the
    attention rank's transport thread. A CPU profile's cluster runs gloo."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        d = json.loads(text)

        def lin(v: dict) -> Linear:
            return Linear(**v)

        layer = d["moe_layer"]
        return cls(
            d["source"],
            d["model"],
            d["dtype"],
            LayerCosts(*(lin(layer[k]) for k in ("attn_pre", "attn_window", "attn_post", "ffn"))),
            lin(d["dense_layer"]),
            lin(d["step_overhead"]),
            Link(**d["link"]),
            tuple(d.get("notes", ())),
            int(d.get("attention_tp", 1)),  # a cost model written before the field: TP 1
            lin(d["submit"]) if "submit" in d else Linear(0.0, 0.0),  # a cost model written before the field
            lin(d["submit_dispatch"]) if "submit_dispatch" in d else Linear(0.0, 0.0),
            float(d.get("ffn_message", 0.0)),
            float(d.get("ffn_message_dispatch", 0.0)),
            int(d.get("host_cores", 0)),
            float(d.get("message_cpu", 0.0)),
            bool(d.get("rendezvous", False)),
        )
