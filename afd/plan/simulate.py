"""A discrete-event simulation of one decode step of an AFD cluster: what `afd plan`
predicts a layout's TPOT and waits from.

The step is a DAG of tasks on resources that each run one task at a time: every attention rank's compute,
every FFN node's compute, and each direction of each (attention rank, FFN node) link. A task starts when
its inputs are ready and its resource is free (start = max(ready, free)), in the order afd issues it; where
the node processes share a host's cores, its compute tasks share them as the kernel time-slices
(afd.plan.timeline). Per MoE layer and micro-batch:

    attention rank   attn_pre ─ send ──▶ link a→f ─▶ FFN node (once every rank's rows are in) ─▶ link f→a
                     ... attn_window (other micro-batches' work) ... wait for y ─ attn_post

in afd.engine.runner's order: `for l: for i: finish(l-1, i); start(l, i)`, with start = attn_pre + submit
(the send; + the wait, without overlap) and finish = attn_window + wait + attn_post. A dense layer is one
attention-side task. Times come from the CostModel (afd.plan.costs), sizes from afd.plan.scenario.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

from afd.plan.scenario import Scenario
from afd.plan.timeline import Timeline


@dataclass(frozen=True)
class StepPrediction:
    """One decode step, predicted. Busy and wait times are per resource (one attention rank, one FFN node,
    one link direction: the busiest of each kind; under uniform routing they are all alike)."""

    step_time: float
    """Seconds from the step's start to the last attention rank's last task: the TPOT in decode."""
    attention_busy: float
    """One attention rank's compute, step overhead included."""
    attention_wait: float
    """Time that rank's compute stood idle waiting for the MoE's result."""
    ffn_busy: float
    link_busy: float
    bytes_to_ffn: float
    """Bytes the whole cluster sends to the FFN nodes in the step (counts included under dispatch)."""
    bytes_to_attention: float
    tokens: int
    """Tokens the step produces: one per sequence on every attention node."""
    devices: int
    """Attention ranks plus FFN nodes."""
    host_cpu: float = 0.0
    """With CostModel.host_cores: the CPU seconds every node process of the step takes together (their compute
    and the messages' CPU), which the host's cores must supply within the step; 0 without a shared host."""
    host_cores: int = 0

    @property
    def tpot(self) -> float:
        return self.step_time

    @property
    def ffn_idle_share(self) -> float:
        return 1.0 - self.ffn_busy / self.step_time if self.step_time else 0.0

    @property
    def bottleneck(self) -> str:
        """The resource kind with the most busy time: what a faster one of would shorten the step most."""
        if self.host_cores and self.host_cpu / self.host_cores >= self.step_time * (1 - 1e-9):
            return "host CPU"  # the cores are busy the whole step: no one node's speed-up would shorten it
        busy = {"attention": self.attention_busy, "ffn": self.ffn_busy, "link": self.link_busy}
        return max(busy, key=busy.__getitem__)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens / self.step_time / self.devices if self.step_time else 0.0

    def to_dict(self) -> dict:
        extra = ("tpot", "ffn_idle_share", "bottleneck", "tokens_per_s_per_device")
        return asdict(self) | {k: getattr(self, k) for k in extra}


def program(scenario: Scenario) -> list[tuple[str, int, int]]:
    """One attention rank's tasks, (kind, layer, micro-batch), in the order afd.engine.runner issues them.
    `wait` is the wait for the MoE's result (no time of its own); `pre` sends when it ends."""
    moe, lay = set(scenario.shape.moe_layers), scenario.layout

    def start(layer: int, i: int) -> list[tuple[str, int, int]]:
        if layer not in moe:
            return [("dense", layer, i)]
        return [("pre", layer, i)] if lay.overlap else [("pre", layer, i), ("wait", layer, i)]

    def finish(layer: int, i: int) -> list[tuple[str, int, int]]:
        if layer not in moe:
            return []
        wait = [("wait", layer, i)] if lay.overlap else []
        return [("window", layer, i), *wait, ("post", layer, i)]

    out: list[tuple[str, int, int]] = []
    last = scenario.shape.num_layers - 1
    for layer in range(last + 1):
        for i in range(lay.micro_batches):
            out += (finish(layer - 1, i) if layer else []) + start(layer, i)
    for i in range(lay.micro_batches):
        out += finish(last, i)
    return out


def simulate(scenario: Scenario, explicit: bool = False) -> StepPrediction:
    """The step's timeline. Every attention rank runs the same tasks at the same times, and so does every
    FFN node when the placement gives each the same share, so by default one of each stands for all (each
    FFN task still waits for the rows of every rank, which arrive together); `explicit` simulates every
    rank, node and link (the same answer, at up to A·G·F times the cost: the tests hold them equal)."""
    lay, c = scenario.layout, scenario.costs
    F, M = lay.ffn_nodes, lay.micro_batches
    rows = [[scenario.ffn_rows(i, f) for i in range(M)] for f in range(F)]  # [F][M]
    msgs = [[scenario.messages(i, f) for i in range(M)] for f in range(F)]  # [F][M]
    alike = all(rows[f] == rows[0] and msgs[f] == msgs[0] for f in range(F))
    # more node processes than the host's cores, or messages that need one to be delivered (message_cpu)
    shared = c.host_cores > 0 and (c.host_cores < lay.attention_ranks + F or c.message_cpu > 0)
    rx = c.message_cpu / 2 if shared else 0.0  # the receiving process's half of a message's CPU
    explicit = explicit or bool(shared)  # the nodes then slow each other: no one of them stands for all
    ranks = range(lay.attention_ranks if explicit else 1)
    nodes = range(F if explicit or not alike else 1)
    submit = c.submit_dispatch if lay.routing == "attention" else c.submit
    handling = c.ffn_message_dispatch if lay.routing == "attention" else c.ffn_message
    attention: dict[str, Callable[[float], float]] = {
        "pre": lambda t: c.moe_layer.attn_pre(t) + submit(t),
        "window": c.moe_layer.attn_window,
        "post": c.moe_layer.attn_post,
        "dense": c.dense_layer,
    }

    tl = Timeline(c.host_cores if shared else 0)
    for r in ranks:
        tl.run(("attention", r), (), c.step_overhead(lay.batch), core=True)
    y: defaultdict[tuple[int, int, int], list[int]] = defaultdict(list)
    """(layer, micro-batch, rank) -> the tasks that bring each FFN node's result to the rank."""
    last_ffn: dict[int, tuple[int]] = {}  # FFN node -> its last task so far
    to_ffn = to_attention = 0.0
    for kind, layer, i in program(scenario):
        if kind == "wait":
            for r in ranks:
                tl.run(("attention", r), y.pop((layer, i, r)), 0.0)
            continue
        ends = [tl.run(("attention", r), (), attention[kind](lay.tokens(i)), core=True) for r in ranks]
        if kind != "pre":
            continue
        arrived: defaultdict[int, list[int]] = defaultdict(list)  # FFN node -> the tasks bringing each rank's rows
        for r, end in zip(ranks, ends):
            for f in nodes:
                t = end
                for k, size in enumerate(msgs[f][i][0]):  # dispatch: the count, then the rows, one after the other
                    if k and c.rendezvous:  # the rows' receive, posted once the count is in and the node is free
                        t = tl.run(("notice", f, r), (t, *last_ffn.get(f, ())), c.link.latency)
                        if rx:  # the rank's transport thread wakes to the notice and sends the rows
                            t = tl.run(("rx", "attention", r), (t,), rx, core=True)
                    t = tl.run(("a2f", r, f), (t,), c.link(size))
                    if rx:  # its transport thread, on a host core
                        t = tl.run(("rx", "ffn", f), (t,), rx, core=True)
                arrived[f].append(t)
        for f in nodes:
            work = c.moe_layer.ffn(rows[f][i]) + handling * lay.attention_ranks  # every rank's message
            done = tl.run(("ffn", f), arrived[f], work, core=True)
            last_ffn[f] = (done,)
            for r in ranks:
                home = tl.run(("f2a", f, r), (done,), c.link(msgs[f][i][1]))
                if rx:
                    home = tl.run(("rx", "attention", r), (home,), rx, core=True)
                y[layer, i, r].append(home)
        to_ffn += sum(sum(msgs[f][i][0]) for f in range(F))  # one rank's, to every node
        to_attention += sum(msgs[f][i][1] for f in range(F))
    tl.solve()

    def most(kind: str, what: dict) -> float:
        return max((v for k, v in what.items() if k[0] == kind), default=0.0)

    step = tl.finish
    host_cpu = 0.0
    if c.host_cores:
        host_cpu = host_demand(scenario, most("attention", tl.busy), [tl.busy["ffn", f] for f in nodes], msgs)
        step = max(step, host_cpu / c.host_cores)
    return StepPrediction(
        step_time=step,
        attention_busy=most("attention", tl.busy),
        attention_wait=most("attention", tl.idle),
        ffn_busy=most("ffn", tl.busy),
        link_busy=max(most("a2f", tl.busy), most("f2a", tl.busy)),
        bytes_to_ffn=to_ffn * lay.attention_ranks,
        bytes_to_attention=to_attention * lay.attention_ranks,
        tokens=lay.attention_nodes * lay.batch,
        devices=lay.devices,
        host_cpu=host_cpu,
        host_cores=c.host_cores,
    )


def host_demand(scenario: Scenario, attention_busy: float, ffn_busy: list[float], msgs: list) -> float:
    """CPU seconds a step takes from a shared host: every attention rank's compute (each as busy as the busiest:
    they run alike), every FFN node's (those simulated; one stands for all when they are alike), and every
    message's CPU (CostModel.message_cpu) over the MoE layers, micro-batches and (rank, node) pairs."""
    lay, c = scenario.layout, scenario.costs
    F = lay.ffn_nodes
    ffn = sum(ffn_busy) * F / len(ffn_busy) if ffn_busy else 0.0
    # to it and back; with a rendezvous, the rows after a count also take its notices' round
    per_rank = sum(
        len(msgs[f][i][0]) + 1 + (len(msgs[f][i][0]) - 1 if c.rendezvous else 0)
        for f in range(F)
        for i in range(lay.micro_batches)
    )
    messages = per_rank * len(scenario.shape.moe_layers) * lay.attention_ranks
    return lay.attention_ranks * attention_busy + ffn + messages * c.message_cpu
