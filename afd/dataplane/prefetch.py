"""FFN-side weight prefetch in the communication gaps (docs/design/longcat-on-ascend.md#ffn-prefetch).

What is hinted is what the next compute reads, in the order it reads it, within a budget per layer that
the rule of docs/design/longcat-on-ascend.md#weight-prefetch computes from the measured gap
(afd.dataplane.prefetch_budget):

1. While the FFN node waits for layer l's inputs (FFNServer calls the schedule): layer l's router, then
   the w13 slices and then the w2 slices of the experts layer l chose the last time the host learned it,
   then layer l+1's router.
2. Optionally (PrefetchConfig.after_router), after layer l's router and before its grouped GEMMs
   (Experts calls `routed`), on backends whose grouped GEMM reads the group sizes on the host anyway
   (CPU): the experts chosen now, w13 then w2 slices, less those step 1 already hinted.

Why "the last time the host learned it" on a device: npu_prefetch takes a host tensor and a host byte
offset, and this step's chosen expert ids live on the device. Reading them there would stall the host
for every layer; instead each layer's per-expert counts (Experts.last_counts) are copied to pinned host
memory without blocking, and read once that copy has landed (an event's query(), never a wait): a step
or so late, and with several micro-batches only the one whose copy started (on CPU, where the counts are on
the host, the union over the step's micro-batches). Decode routing repeats from step to step for the same
sequences, so last step's experts are the best guess the host has for free; a wrong guess costs bandwidth
in a gap, never a result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from afd.backend import Backend
from afd.backend.base import PrefetchSpec
from afd.dataplane.prefetch_budget import GapBudget
from afd.model.halves import FFNHalf

WEIGHTS = ("router", "gate_up", "down")


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool | None = None
    """None: the backend's default (on only where the benchmark suite showed a gain)."""
    budget_bytes: int | None = None
    """None: computed per layer (bandwidth x measured gap, within the cache); else this many bytes."""
    weights: tuple[str, ...] = WEIGHTS
    """Which weights: router (the layer's, and the next layer's), gate_up (chosen experts' w13 slices),
    down (their w2 slices)."""
    next_layer: bool = True
    """Hint layer l+1's router too while waiting for layer l's inputs."""
    after_router: bool = False
    """Step 2 above, only where the backend reads the group sizes on the host (Backend.group_sizes_on_host).
    Off by default: on CPU, the one such backend, the hint is a synchronous read on the critical path and
    measured slower than step 1 alone (docs/benchmarks/suite.md, afd bench-suite --sections prefetch)."""

    def __post_init__(self):
        bad = [w for w in self.weights if w not in WEIGHTS]
        if bad:
            raise ValueError(f"prefetch.weights: unknown {bad}; choose from {', '.join(WEIGHTS)}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"prefetch.budget_bytes must be positive, got {self.budget_bytes}")

    def active(self, backend: Backend) -> bool:
        return backend.prefetch_by_default if self.enabled is None else self.enabled


class PrefetchSchedule:
    def __init__(self, ffn: FFNHalf, backend: Backend, cfg: PrefetchConfig, spec: PrefetchSpec | None = None):
        self.backend, self.cfg, self.ffn = backend, cfg, ffn
        spec = spec or backend.prefetch_spec() or PrefetchSpec(0.0, 0, "no prefetch on this backend")
        self.budget = GapBudget(spec, cfg.budget_bytes)
        self.layers = tuple(ffn.cfg.moe_layers) + tuple(ffn.mtp_layers)
        self._next = {a: b for a, b in zip(ffn.cfg.moe_layers, ffn.cfg.moe_layers[1:])}
        self.known: dict[int, list[int]] = {}
        """Layer -> local experts it chose the last time the host learned it (step 1's guess)."""
        self._landing: dict[int, tuple[torch.Tensor, Any]] = {}
        """Layer -> (pinned host copy of its counts, event): copies not yet known to have landed."""
        self._host: dict[int, torch.Tensor] = {}
        self._waited: set[int] = set()
        """Layers waited for (step 1) since their last compute: the next compute starts a new guess."""
        self._left: dict[int, int] = {}
        self._hinted: dict[int, set[int]] = {}
        """Layer -> experts step 1 hinted in this wait (step 2 skips them)."""
        self.last_budget: dict[int, int] = {}
        """Layer -> the budget its last wait was given (the afd_prefetch_budget_bytes gauge)."""
        self.bytes_total = 0
        self._untaken = 0
        # never where the sizes stay on the device: reading them there is the per-layer host sync avoided above
        if backend.group_sizes_on_host and cfg.after_router:
            for layer in self.layers:
                _experts(ffn, layer).before_gemm = partial(self.routed, layer)

    def observe_gap(self, layer: int, seconds: float) -> None:
        self.budget.observe(layer, seconds)

    def take_bytes(self) -> int:
        """Bytes hinted since the last call (the afd_prefetch_bytes counter's increment)."""
        n, self._untaken = self._untaken, 0
        return n

    def _hint(self, layer: int, weight: torch.Tensor, offset: int = 0, nbytes: int | None = None) -> None:
        left = self._left.get(layer, 0)
        if left <= 0:
            return
        size = weight.numel() * weight.element_size() - offset if nbytes is None else nbytes
        done = self.backend.prefetch(weight, min(left, size), None, offset)
        self._left[layer] = left - done
        self.bytes_total += done
        self._untaken += done

    def _slices(self, layer: int, experts: list[int]) -> None:
        """The w13 slices of `experts` (what the first GEMM reads), then their w2 slices."""
        ex = _experts(self.ffn, layer)
        for name, w in (("gate_up", ex.w13), ("down", ex.w2)):
            if name in self.cfg.weights:
                per = w.numel() // w.shape[0] * w.element_size()  # [H, 2I] or [I, H]: one expert's contiguous rows
                for g in experts:
                    self._hint(layer, w, g * per, per)

    def __call__(self, layer: int) -> int:
        """Step 1, while waiting for `layer`'s inputs; returns the bytes hinted."""
        before = self.bytes_total
        self._left[layer] = self.last_budget[layer] = self.budget(layer)
        self._waited.add(layer)
        self._learn(layer)
        if "router" in self.cfg.weights:
            self._hint(layer, _router(self.ffn, layer))
        guess = self.known.get(layer, [])
        self._hinted[layer] = set(guess)
        self._slices(layer, guess)
        nxt = self._next.get(layer)
        if self.cfg.next_layer and nxt is not None and "router" in self.cfg.weights:
            self._hint(layer, _router(self.ffn, nxt))
        return self.bytes_total - before

    def in_gap(self, layer: int, landed: Callable[[], bool]):
        """Step 1 as the FFN server runs it, while `layer`'s inputs are in flight: returns the event that starts
        the layer's measured gap (its span to the compute's start event is what observe_gap takes).

        On a device the hint is asynchronous and the events time the stream's stall for the inputs. Where waits
        block the host (CPU) the hint runs on the serving thread first: if the inputs had `landed` by its end,
        the gap was shorter than the hint and is taken as 0, so that the estimate shrinks the next hint (never
        feeds it its own time)."""
        gap = self.backend.timing_event()
        gap.record()
        self(layer)
        if not self.backend.stream_ordered_waits and landed():
            gap = self.backend.timing_event()
            gap.record()  # its span to the compute's start: the wait after the hint, ~0
        return gap

    def routed(self, layer: int, sizes: torch.Tensor) -> None:
        """Step 2: sizes [G] tokens per local expert, read on the host (a CPU tensor: no sync)."""
        chosen = [g for g, n in enumerate(sizes.tolist()) if n]
        self._slices(layer, [g for g in chosen if g not in self._hinted.get(layer, ())])

    def after_compute(self, layer: int) -> None:
        """Once `layer` has computed: its per-expert counts start their way to the host (step 1's guess)."""
        counts = _experts(self.ffn, layer).last_counts
        if counts.device.type == "cpu":  # the union over the layer's micro-batches of this step
            chosen = {g for g, n in enumerate(counts.tolist()) if n}
            if layer in self._waited:  # the first micro-batch since the wait: last step's guess is done
                self._waited.discard(layer)
            else:
                chosen |= set(self.known.get(layer, ()))
            self.known[layer] = sorted(chosen)
            return
        if layer in self._landing:  # the previous copy has not landed: keep waiting for it, not a newer one
            return
        host = self._host.get(layer)
        if host is None:  # one pinned buffer per layer, reused: a new copy starts only once the last landed
            host = self._host[layer] = torch.empty(counts.shape, dtype=counts.dtype).pin_memory()
        host.copy_(counts, non_blocking=True)  # pinned: queued on the stream, no host wait
        event = self.backend.timing_event()  # any event: only query() is used
        event.record()
        self._landing[layer] = (host, event)

    def _learn(self, layer: int) -> None:
        landing = self._landing.get(layer)
        if landing is not None and landing[1].query():
            del self._landing[layer]
            self.known[layer] = [g for g, n in enumerate(landing[0].tolist()) if n]


def _layer(ffn: FFNHalf, layer: int) -> Any:
    return ffn.layer(layer)  # the family's MoE layer: router.classifier and experts (FFNHalf.layer)


def _router(ffn: FFNHalf, layer: int) -> torch.Tensor:
    return _layer(ffn, layer).router.classifier.weight


def _experts(ffn: FFNHalf, layer: int) -> Any:
    return _layer(ffn, layer).experts
