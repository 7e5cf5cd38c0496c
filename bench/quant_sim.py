"""HF transformers running afd's quantization schemes, written from the formats' definitions
(afd/quant/scheme.py's docstring, docs/architecture/quantization.md) rather than afd's code, and the experts
HF's routers choose: what bench/quant_accuracy.py and tests/test_quant_accuracy.py hold afd's 8-bit logits
to, and how they tell a changed route from a rounding error. Needs tests/ on sys.path (fp8_checkpoint)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through int8 per row (absmax / 127, round to nearest) and back."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
    return (x / s).round().clamp(-127, 127) * s


def _fp8_groups(x: torch.Tensor, g: int = 128) -> torch.Tensor:
    """x [..., K] through e4m3 per row and g-wide group (absmax / 448) and back."""
    out = torch.empty_like(x)
    for a in range(0, x.shape[-1], g):
        c = x[..., a : a + g]
        s = c.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448
        out[..., a : a + g] = (c / s).to(torch.float8_e4m3fn).float() * s
    return out


@contextlib.contextmanager
def simulated(model, method: str, stored_fp8: bool, block: tuple[int, int] = (128, 128)):
    """HF's model with `method` written out from the scheme's definition, not afd's code: every F.linear but
    lm_head, the router and kv_b_proj (afd keeps those in dtype) takes its input through the per-token
    quantizer (fp8: groups of block[1], as afd's act_quant), its weight through int8 per channel (w8a8; w8a16
    on an unquantized checkpoint), FP8 `block`s (fp8 on an unquantized checkpoint; tests/fp8_checkpoint.py's
    quantizer) or as it is (FP8 values already); under w8a16 only the routed experts' weights. HF's eager
    experts and nn.Linear both call F.linear, looked up at call time."""
    from fp8_checkpoint import block_values, quantize_blocks

    keep = {model.lm_head.weight.data_ptr()}
    keep |= {p.data_ptr() for n, p in model.named_parameters() if "kv_b_proj" in n or ".gate." in n or "router" in n}
    experts = {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if ".experts." in n}
    linear = F.linear

    def weight(w):
        if method == "w8a8" or (method == "w8a16" and not stored_fp8):
            return _int8_rows(w)
        return w if stored_fp8 else block_values(*quantize_blocks(w, block), block)

    def quantized(x, w, b=None):
        if w.data_ptr() in keep or (method == "w8a16" and w.untyped_storage().data_ptr() not in experts):
            return linear(x, w, b)  # w8a16 quantizes the routed experts alone (afd.model.quant_layers)
        x = _int8_rows(x) if method == "w8a8" else _fp8_groups(x, block[1]) if method == "fp8" else x
        return linear(x, weight(w), b)

    F.linear = quantized
    try:
        yield
    finally:
        F.linear = linear


def _routers(model) -> list:
    """The router modules (DeepSeek's mlp.gate, LongCat's mlp.router): each returns (logits, weights, ids)."""
    return [m for n, m in model.named_modules() if n.endswith((".mlp.gate", ".mlp.router"))]


@contextlib.contextmanager
def routes(model, out: list, replay: list | None = None):
    """Appends every router call's (logits, weights [T, K], ids [T, K]) to `out`; with `replay`, a capture of
    the same forwards, each call returns the replayed choice instead (the routes frozen to another run's)."""
    calls = iter(replay) if replay is not None else None

    def hook(module, args, output):
        out.append(output)
        return next(calls) if calls is not None else None

    hooks = [r.register_forward_hook(hook) for r in _routers(model)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def routing_changed(a: list, b: list) -> float:
    """The share of (token, MoE layer) pairs whose expert set differs between two captures of `routes`."""
    ids = [
        (x[2].reshape(-1, x[2].shape[-1]).sort(-1)[0], y[2].reshape(-1, y[2].shape[-1]).sort(-1)[0])
        for x, y in zip(a, b)
    ]
    diff = sum(int((x != y).any(-1).sum()) for x, y in ids)
    return round(diff / sum(x.shape[0] for x, _ in ids), 4)
