"""MLA's decode prolog on Ascend: torch_npu.npu_mla_prolog_v3 (NpuBackend.mla_prolog).

One kernel for everything MLA computes before attention on a decode step: q down-projection, RMSNorm, up-projection,
absorption through W_UK and rope; kv down-projection, RMSNorm and rope, written into the paged latent and rope
caches through cache_index. It is what the LongCat-Flash recipe on Atlas A3 runs before FIA
(docs/design/longcat-on-ascend.md#mla-absorb). Its documented shapes are fixed, so it fits the full-size
DeepSeek-V3 / LongCat-Flash attention and none of the tiny test models; `refusal` says, in one line, why a layer
is outside them, and MLA then projects itself.

source ("doc"): torch_npu.npu_mla_prolog_v3, https://github.com/Ascend/op-plugin/blob/26.0.0/docs/zh/custom_APIs/
  torch_npu/torch_npu-npu_mla_prolog_v3.md (op-plugin 26.0.0; the op first appears in 7.3.0). Its non-quantized mode,
  cache_mode "PA_BSND", caches stored apart (ckvkr_repo_mode 0). Later documents widen the shapes (He up to 8192,
  Hcq 2048, D 192); afd keeps 26.0.0's, which they all include.
source ("formula"): where qc_qr_scale and kc_scale apply, CANN ops-transformer attention/mla_prolog_v3/docs/
  aclnnMlaPrologV3WeightNz.md: c^Q = qc_qr_scale RmsNorm(x W^DQ) (so q's nope and rope parts alike), c^KV =
  kc_scale RmsNorm(x W^DKV) (the latent only).
source ("golden"): the ROPE, which neither doc defines: op-plugin 26.0.0 test/test_custom_ops/test_mla_prolog_v3.py
  regroups each rope vector's interleaved pairs as [evens, odds], then rotates rotate_half-style with cos / sin of
  width Dr. tests/fakes/torch_npu/ops_prolog.py cites each and computes that program.

Rope order. MLA caches the rotated key in halves order (`apply_rotary` writes [rotated evens, rotated odds];
`apply_rotary_halves` keeps the halves), and its prefill writes the cache itself, so the op must write the same
order. With `rope_interleave` (DeepSeek-V3's default, LongCat-Flash) the op's regrouping is afd's `apply_rotary`:
the weights go in as they are. Without it (rope dims already in halves) the op would regroup a vector that is
not interleaved; the rope columns of weight_uq_qr (per head) and weight_dkv_kr are permuted at load so that the
op's regrouping gives back afd's halves: column 2i takes column i, column 2i + 1 takes column Dr/2 + i. Both
cases then write the cache, and hand FIA the rope query, exactly in afd's order (tests/test_npu_prolog.py).

Shapes: T tokens, He hidden, Hcq q LoRA rank, N heads on this rank, D nope width, Dr rope width, C kv LoRA rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd.backend.mla_prolog import MLAPrologWeights

HIDDEN = (7168, 7680)
"""doc, He: 7168 or 7680. The aclnn document and later torch_npu ones also list 6144 (LongCat-Flash's) among others;
afd holds to the release the fake models (tests/fakes/torch_npu/ops_prolog.py), so LongCat-Flash is refused."""
Q_LORA, KV_LORA, NOPE, ROPE = 1536, 512, 128, 64
"""doc: Hcq 1536, Hckv 512, D 128, Dr 64, each fixed."""
HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
"""doc, N: 1, 2, 4, 8, 16, 32, 64 or 128 (heads on this rank)."""
BLOCK_SIZES = range(16, 1025, 16)
"""doc, PA_BSND: BlockSize a multiple of 16 in [16, 1024]."""
FRACTAL_NZ = 29
"""aclFormat of weight_dq, weight_uq_qr and weight_dkv_kr (doc: "数据格式支持FRACTAL_NZ"); torch_npu.npu_format_cast."""


def refusal(torch_npu, layer: MLAPrologWeights) -> str | None:
    """Why npu_mla_prolog_v3's documented non-quantized mode does not take this layer, or None when it does."""
    if getattr(torch_npu, "npu_mla_prolog_v3", None) is None:
        return "this torch_npu has no npu_mla_prolog_v3 (op-plugin 7.3.0 and later)"
    if layer.q_a is None or layer.q_b is None or layer.q_norm is None:
        return "q is projected without a LoRA; the op's q path is x W_DQ, RMSNorm, W_UQ"
    if layer.bias:
        return "the down-projections have a bias; the op takes none"
    He, Hcq, C = layer.kv_a.shape[1], layer.q_a.shape[0], layer.kv_norm.shape[0]
    N, D = layer.w_uk.shape[:2]
    Dr = layer.kv_a.shape[0] - C
    if He not in HIDDEN:
        return f"hidden size {He}: the op takes 7168 or 7680"
    if (Hcq, C, D, Dr) != (Q_LORA, KV_LORA, NOPE, ROPE):
        return f"q/kv LoRA ranks {Hcq}/{C}, head dims {D}+{Dr}: the op takes 1536/512, 128+64"
    if N not in HEADS:
        return f"{N} heads on this rank: the op takes a power of two up to 128"
    weights = (layer.q_a, layer.q_b, layer.q_norm, layer.kv_a, layer.kv_norm, layer.w_uk)
    if any(w.dtype != torch.bfloat16 for w in weights):
        return f"dtype {layer.kv_a.dtype}: the op's non-quantized mode takes bfloat16 only"
    return None


def cache_refusal(kv_c: torch.Tensor, kv_r: torch.Tensor) -> str | None:
    """Why the op does not take these caches ([nb, bs, C] latents, [nb, bs, Dr] rope keys), or None."""
    if kv_c.shape[1] not in BLOCK_SIZES:
        return f"block size {kv_c.shape[1]}: the op's paged caches take a multiple of 16 in [16, 1024]"
    if kv_c.dtype != torch.bfloat16 or kv_r.dtype != torch.bfloat16:
        return f"cache dtype {kv_c.dtype}: the op's non-quantized mode takes bfloat16"
    if not (kv_c.is_contiguous() and kv_r.is_contiguous()):
        # afd's cache hands over its two planes, each contiguous (afd.model.latent_cache)
        return "latent and rope caches are strided views; the op needs two contiguous caches"
    return None


def pairs_for_halves(w: torch.Tensor, heads: int, nope: int, rope: int) -> torch.Tensor:
    """w [in, heads * (nope + rope)] with each head's rope columns in halves order -> the same with them laid out
    so that the op's [evens, odds] regrouping gives the halves back: column 2i <- i, 2i + 1 <- rope/2 + i."""
    half = rope // 2
    order = torch.arange(rope).view(2, half).t().reshape(-1)  # [0, half, 1, half + 1, ...]
    cols = w.view(w.shape[0], heads, nope + rope)
    return torch.cat([cols[..., :nope], cols[..., nope:][..., order.to(w.device)]], dim=-1).view(w.shape)


class NpuMLAProlog:
    """One MLA layer's weights in the op's layout, prepared once (afd.backend.mla_prolog.MLAProlog). They are
    copies: weight_dq, weight_uq_qr and weight_dkv_kr transposed and cast to FRACTAL_NZ, W_UK made contiguous.
    The nn.Linear weights stay for prefill, which MLA projects itself."""

    def __init__(self, torch_npu, layer: MLAPrologWeights, say: Callable[[str], None]):
        assert layer.q_a is not None and layer.q_b is not None and layer.q_norm is not None  # refusal() holds
        self._op, self._say = torch_npu.npu_mla_prolog_v3, say
        self._eps, self._q_scale, self._kv_scale = layer.eps, layer.q_scale, layer.kv_scale
        N = layer.w_uk.shape[0]
        uq_qr, dkv_kr = layer.q_b.t(), layer.kv_a.t()  # nn.Linear's [out, in] -> the doc's [in, out]
        if not layer.rope_interleave:
            uq_qr = pairs_for_halves(uq_qr, N, NOPE, ROPE)
            dkv_kr = pairs_for_halves(dkv_kr, 1, KV_LORA, ROPE)

        def nz(w: torch.Tensor) -> torch.Tensor:
            return torch_npu.npu_format_cast(w.contiguous(), FRACTAL_NZ)

        self.weight_dq, self.weight_uq_qr, self.weight_dkv_kr = nz(layer.q_a.t()), nz(uq_qr), nz(dkv_kr)
        self.weight_uk = layer.w_uk.contiguous()  # ND (doc)
        self.gamma_cq, self.gamma_ckv = layer.q_norm.contiguous(), layer.kv_norm.contiguous()

    def takes(self, kv_c: torch.Tensor, kv_r: torch.Tensor) -> bool:
        why = cache_refusal(kv_c, kv_r)
        if why is not None:
            self._say(why)
        return why is None

    def __call__(self, x, cos, sin, kv_c, kv_r, slots):
        nb, bs, C = kv_c.shape
        # rotate_half-style tables of width Dr: each pair's angle in both halves, as the golden's cos / sin
        cos, sin = torch.cat([cos, cos], dim=-1).to(torch.bfloat16), torch.cat([sin, sin], dim=-1).to(torch.bfloat16)
        q_lat, q_rot, _, _, _ = self._op(
            token_x=x.contiguous(),  # [T, He]: BS merged (doc), one decode token per sequence
            weight_dq=self.weight_dq,
            weight_uq_qr=self.weight_uq_qr,
            weight_uk=self.weight_uk,
            weight_dkv_kr=self.weight_dkv_kr,
            rmsnorm_gamma_cq=self.gamma_cq,
            rmsnorm_gamma_ckv=self.gamma_ckv,
            rope_sin=sin,
            rope_cos=cos,
            kv_cache=kv_c.view(nb, bs, 1, C),  # [BlockNum, BlockSize, Nkv = 1, Hckv]: a view of the latent plane
            kr_cache=kv_r.view(nb, bs, 1, kv_r.shape[-1]),
            cache_index=slots,  # [T] int64 flat slots, afd's slot mapping (doc: in [0, BlockNum * BlockSize))
            rmsnorm_epsilon_cq=self._eps,
            rmsnorm_epsilon_ckv=self._eps,
            cache_mode="PA_BSND",
            qc_qr_scale=self._q_scale,  # formula: c^Q's scale, so q's nope and rope parts alike
            kc_scale=self._kv_scale,  # formula: c^KV's, the latent only
        )
        return q_lat, q_rot
