"""The sampler's device ops, over a batch of logits rows [R, V] (R rows, V the vocabulary): structured
outputs' token bitmask, temperature, top-k / top-p, the draw, speculative decoding's rejection rule and
log-probabilities. Nothing here reads a value on the host: per-row parameters come in as device tensors, and
the sampler reads the result once (afd.engine.sampling).
"""

from __future__ import annotations

import torch

F32_MAX = torch.finfo(torch.float32).max


def probs(
    logits: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor | None,
    k_max: int,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, V] fp32, temp [R] (> 0), top_k [R] int64 (0: no cut; None when no row cuts) whose largest
    is k_max, top_p [R] (1: no cut; None likewise), min_p [R] (0: no cut; None likewise) -> the distributions
    [R, V] to draw from, each summing to 1. The order is vLLM's: temperature, min-p, then top-k and top-p."""
    # An extreme repetition penalty (1e-270) or a small temperature can overflow a logit to +inf, and
    # softmax over +inf is NaN; the largest finite float keeps the limit (those tokens tie).
    logits = (logits / temp[:, None]).clamp(max=F32_MAX)
    V = logits.shape[-1]
    if min_p is not None:  # the most likely token always stays (its p is the max): a row is never emptied
        p0 = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(p0 < min_p[:, None] * p0.amax(-1, keepdim=True), float("-inf"))
    if top_k is not None:
        k_max = min(k_max, V)
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        kth = torch.where((top_k > 0)[:, None], kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))  # tokens tied with the k-th stay
    p = torch.softmax(logits, dim=-1)
    if top_p is not None:
        sp, idx = p.sort(dim=-1, descending=True)
        # keep a token while the mass before it is under top_p; the most likely one always stays, even for
        # a top_p that rounds to 0 in float32 (the API takes any positive double: 1e-300 dropped every
        # token, and the draw over all zeros returned token 0)
        drop = (sp.cumsum(-1) - sp >= top_p[:, None]) & (top_p < 1)[:, None]
        drop[:, 0] = False
        p = torch.zeros_like(p).scatter_(1, idx, sp.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)  # the rejection rule compares p(draft) with a uniform: p must sum to 1
    return p


def apply_bitmask(x: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Structured outputs: in x [R, V], the logits of the tokens a row's grammar forbids become -inf, in place.
    rows [Rc] (int64) are the constrained rows, mask [Rc, ceil(V / 32)] int32 their allowed tokens (bit t % 32
    of word t // 32; afd.engine.grammar.fill_masks), both on x's device; the other rows are not touched."""
    bits = torch.arange(32, device=x.device, dtype=torch.int32)
    allowed = ((mask[:, :, None] >> bits) & 1).bool().flatten(1)[:, : x.shape[1]]  # [Rc, V]
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))


def noise(shape: tuple[int, ...], device: torch.device, gens: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential(1) noise [R, ...]: row i from gens[i] when it has a generator (a seeded request), the
    others from the device's default generator, in one op."""
    e = torch.empty(shape, device=device).exponential_()
    for i, g in gens.items():
        e[i].exponential_(generator=g)
    return e


def uniform(n: int, device: torch.device, gens: dict[int, torch.Generator]) -> torch.Tensor:
    """U[0, 1) [n], row i from gens[i] where given (as `noise`)."""
    u = torch.rand(n, device=device)
    for i, g in gens.items():
        u[i : i + 1].uniform_(generator=g)
    return u


def draw(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """One token per row of p [R, V] (any scale), given Exponential(1) noise e [R, V]: argmax p / e is
    distributed as p (the exponential race), with no host read; torch.multinomial draws one sample the same
    way (aten/src/ATen/native/Distributions.cpp) but first checks p's values on the host. A noise value of
    exactly 0 (which a device generator may draw) would make 0 / 0 a NaN that argmax takes for the largest,
    drawing a token of probability 0: the noise is kept above 0."""
    return (p / e.clamp_min(torch.finfo(e.dtype).tiny)).argmax(dim=-1)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor, e: torch.Tensor):
    """Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023) for drafts x ~ q [R, V] checked
    against the targets p [R, V] (draft [R], u [R] uniform, e [R, V] Exponential(1)): keep x with probability
    min(1, p(x) / q(x)), else draw from normalize(max(0, p - q)). Each token returned is distributed as p,
    whatever q is. Returns (token [R], kept [R] bool)."""
    px, qx = p.gather(1, draft[:, None])[:, 0], q.gather(1, draft[:, None])[:, 0]
    # a row without a draft (q all zero) keeps nothing: u * 0 < p(x) would keep its placeholder token
    kept = (u * qx < px) & (qx > 0)
    residual = (p - q).clamp_min(0)
    # an all-zero residual comes only from rounding (a rejection needs p(x) < q(x), so p > q somewhere)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return torch.where(kept, draft, draw(residual, e)), kept


def logprobs(logits: torch.Tensor, tok: torch.Tensor, k: int) -> torch.Tensor:
    """The raw distribution's (vLLM's default: before penalties and temperature) log-probability of tok [R]
    and its k most likely tokens: [R, 1 + 2k] fp64 (logprob, k ids, k logprobs; ids are exact in fp64)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    cols = [lp.gather(1, tok[:, None])]
    if k:
        top = lp.topk(k, dim=-1)
        cols += [top.indices, top.values]
    return torch.cat([c.double() for c in cols], dim=1)
