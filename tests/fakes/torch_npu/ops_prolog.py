"""Fake torch_npu.npu_mla_prolog_v3, for tests only: MLA's projections before attention in one op (q down-projection,
RMSNorm, up-projection, absorption through W_UK, rope; kv down-projection, RMSNorm, rope, written into the paged
latent and rope caches), in its non-quantized "PA_BSND" mode, with the documented constraints.

Modelled release: op-plugin 26.0.0 (the op first appears in 7.3.0, as beta; 7.1.0, which the other fakes model,
has only v1 and v2). Product: Atlas A3 only (doc).
source ("doc"): torch_npu.npu_mla_prolog_v3, https://github.com/Ascend/op-plugin/blob/26.0.0/docs/zh/custom_APIs/
  torch_npu/torch_npu-npu_mla_prolog_v3.md (op-plugin 26.0.0)
source ("schema"): op_plugin_functions.yaml @26.0.0 (npu_mla_prolog_v3)
source ("formula"): where qc_qr_scale (alpha_q) and kc_scale (alpha_kv) apply, which the torch_npu doc only names:
  aclnnMlaPrologV3WeightNz, CANN ops-transformer attention/mla_prolog_v3/docs/aclnnMlaPrologV3WeightNz.md
  (read at repo-mirror-test/ops-transformer @3918073): c^Q = alpha_q RmsNorm(x W^DQ), c^KV = alpha_kv RmsNorm(x W^DKV)
source ("golden"): the ROPE, which neither doc defines: op-plugin 26.0.0 test/test_custom_ops/test_mla_prolog_v3.py
  (its CPU baseline): each rope vector's interleaved pairs are regrouped as [evens, odds], then rotated
  rotate_half-style with cos / sin of width Dr. So q^R and k^R come out in halves order (one permutation of the
  rope dims for both: their dot product is unchanged).

FRACTAL_NZ: doc, weight_dq, weight_uq_qr and weight_dkv_kr "数据格式支持FRACTAL_NZ" (weight_uk, the gammas, rope tables
and caches ND). The fake's torch_npu.npu_mla_prolog_v3 refuses those three unless npu_format_cast(w, 29) made them
(ops_format.py records the format; the values stay ND, so the kernel reads them as they are). The format check and the
call log sit in that Python entry point, where the keyword names the caller used are visible; the registered op
(torch.ops.fake_npu.npu_mla_prolog_v3, for graphs) checks the rest.

Not modelled: quantization, the other cache modes.

Shapes: T tokens, He hidden, Hcq q LoRA rank, N heads, D nope width, Dr rope width, Hckv kv LoRA rank (C).
"""

from __future__ import annotations

import torch

NAMESPACE = "fake_npu"
if not hasattr(torch.ops.fake_npu, "calls"):  # the call log ops.py keeps on the namespace
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls

PROLOG_SCHEMA = (
    "npu_mla_prolog_v3(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, "
    "Tensor weight_dkv_kr, Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, Tensor rope_cos, "
    "Tensor(a!) kv_cache, Tensor(b!) kr_cache, *, Tensor? cache_index=None, Tensor? dequant_scale_x=None, "
    "Tensor? dequant_scale_w_dq=None, Tensor? dequant_scale_w_uq_qr=None, Tensor? dequant_scale_w_dkv_kr=None, "
    "Tensor? quant_scale_ckv=None, Tensor? quant_scale_ckr=None, Tensor? smooth_scales_cq=None, "
    "Tensor? actual_seq_len=None, Tensor? k_nope_clip_alpha=None, float rmsnorm_epsilon_cq=1e-05, "
    'float rmsnorm_epsilon_ckv=1e-05, str cache_mode="PA_BSND", bool query_norm_flag=False, '
    "int weight_quant_mode=0, int kv_cache_quant_mode=0, int query_quant_mode=0, int ckvkr_repo_mode=0, "
    "int quant_scale_repo_mode=0, int tile_size=128, float qc_qr_scale=1.0, float kc_scale=1.0) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)

# doc, shape table: He 7168 or 7680 (the aclnn doc above also lists 6144, LongCat-Flash's), Hcq 1536, Hckv 512,
# D 128, Dr 64, N a power of two up to 128, Nkv 1, BlockSize a multiple of 16 in [16, 1024].
PROLOG_HE = (7168, 7680)
PROLOG_HCQ, PROLOG_HCKV, PROLOG_D, PROLOG_DR = 1536, 512, 128, 64
PROLOG_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
_QUANT = (
    "dequant_scale_x", "dequant_scale_w_dq", "dequant_scale_w_uq_qr", "dequant_scale_w_dkv_kr", "quant_scale_ckv",
    "quant_scale_ckr", "smooth_scales_cq", "k_nope_clip_alpha",
)  # fmt: skip


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


def _checks(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, sin, cos, kv_cache, kr_cache, kw) -> int:
    """Every documented rule of the non-quantized PA_BSND mode; returns N."""
    if any(kw.get(k) for k in ("weight_quant_mode", "kv_cache_quant_mode", "query_quant_mode")) or any(
        kw.get(k) is not None for k in _QUANT
    ):
        raise NotImplementedError("fake npu_mla_prolog_v3: quantized scenarios are not modelled")
    if (
        kw.get("cache_mode", "PA_BSND") != "PA_BSND"
        or kw.get("ckvkr_repo_mode", 0)
        or kw.get("quant_scale_repo_mode", 0)
    ):
        raise NotImplementedError("fake npu_mla_prolog_v3: only cache_mode PA_BSND, caches stored apart, is modelled")
    named = dict(token_x=x, weight_dq=w_dq, weight_uq_qr=w_uq_qr, weight_uk=w_uk, weight_dkv_kr=w_dkv_kr,
                 rmsnorm_gamma_cq=g_cq, rmsnorm_gamma_ckv=g_ckv, rope_sin=sin, rope_cos=cos, kv_cache=kv_cache,
                 kr_cache=kr_cache, cache_index=kw.get("cache_index"))  # fmt: skip
    for name, t in named.items():
        if t is not None and not t.is_contiguous():  # doc, every tensor: "不支持非连续"
            _fail(f"npu_mla_prolog_v3: {name} must be contiguous")
        if t is not None and name != "cache_index" and t.dtype != torch.bfloat16:  # doc: non-quantized is bf16
            _fail(f"npu_mla_prolog_v3: {name} must be bfloat16 in the non-quantized scenario, got {t.dtype}")
    if x.dim() not in (2, 3) or x.shape[-1] not in PROLOG_HE:
        _fail(f"npu_mla_prolog_v3: token_x must be [T, He] or [B, S, He], He 7168 or 7680; got {tuple(x.shape)}")
    He, lead = x.shape[-1], tuple(x.shape[:-1])
    if w_uk.dim() != 3 or w_uk.shape[1:] != (PROLOG_D, PROLOG_HCKV) or w_uk.shape[0] not in PROLOG_HEADS:
        _fail(f"npu_mla_prolog_v3: weight_uk must be [N, 128, 512], N a power of two <= 128; got {tuple(w_uk.shape)}")
    N = w_uk.shape[0]
    want = dict(weight_dq=(He, PROLOG_HCQ), weight_uq_qr=(PROLOG_HCQ, N * (PROLOG_D + PROLOG_DR)),
                weight_dkv_kr=(He, PROLOG_HCKV + PROLOG_DR), rmsnorm_gamma_cq=(PROLOG_HCQ,),
                rmsnorm_gamma_ckv=(PROLOG_HCKV,), rope_sin=(*lead, PROLOG_DR), rope_cos=(*lead, PROLOG_DR))  # fmt: skip
    for name, shape in want.items():
        if tuple(named[name].shape) != shape:
            _fail(f"npu_mla_prolog_v3: {name} must be {list(shape)}, got {list(named[name].shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[2:] != (1, PROLOG_HCKV):  # doc: [BlockNum, BlockSize, Nkv=1, Hckv]
        _fail(f"npu_mla_prolog_v3: kv_cache must be [BlockNum, BlockSize, 1, 512], got {tuple(kv_cache.shape)}")
    if kr_cache.shape != (*kv_cache.shape[:2], 1, PROLOG_DR):
        _fail(f"npu_mla_prolog_v3: kr_cache must be [BlockNum, BlockSize, 1, 64], got {tuple(kr_cache.shape)}")
    bs = kv_cache.shape[1]
    if bs % 16 or not 16 <= bs <= 1024:
        _fail(f"npu_mla_prolog_v3: BlockSize must be a multiple of 16 in [16, 1024], got {bs}")
    idx = kw.get("cache_index")
    if idx is None:  # doc: optional, but PA_BSND writes the caches through it
        _fail("npu_mla_prolog_v3: cache_mode PA_BSND needs cache_index")
    if idx.dtype != torch.int64 or tuple(idx.shape) != lead:
        _fail(f"npu_mla_prolog_v3: cache_index must be int64 of shape {list(lead)}, got {idx.dtype} {list(idx.shape)}")
    return N


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return gamma.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """golden: interleaved pairs regrouped as [evens, odds], then x cos + rotate_half(x) sin. x [T, .., Dr]."""
    x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _kernel(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, sin, cos, kv_cache, kr_cache, **kw):
    N = _checks(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, sin, cos, kv_cache, kr_cache, kw)
    lead = x.shape[:-1]
    xt, cs, sn = (
        x.reshape(-1, x.shape[-1]).float(),
        cos.reshape(-1, 1, PROLOG_DR).float(),
        sin.reshape(-1, 1, PROLOG_DR).float(),
    )
    cq = kw.get("qc_qr_scale", 1.0) * _rms(xt @ w_dq.float(), g_cq, kw.get("rmsnorm_epsilon_cq", 1e-5))  # [T, Hcq]
    qcqr = (cq @ w_uq_qr.float()).view(-1, N, PROLOG_D + PROLOG_DR)  # per head [D | Dr], as the golden splits it
    q_n = torch.einsum("tnd,ndc->tnc", qcqr[..., :PROLOG_D], w_uk.float())  # [T, N, Hckv]
    q_r = _rope(qcqr[..., PROLOG_D:], cs, sn)  # [T, N, Dr]
    ckvkr = xt @ w_dkv_kr.float()  # [T, Hckv + Dr]
    ckv = kw.get("kc_scale", 1.0) * _rms(ckvkr[:, :PROLOG_HCKV], g_ckv, kw.get("rmsnorm_epsilon_ckv", 1e-5))
    kr = _rope(ckvkr[:, None, PROLOG_HCKV:], cs, sn)[:, 0]  # [T, Dr]
    slots = kw["cache_index"].reshape(-1)  # doc: values not validated by the op ("需用户自行保证")
    kv_cache.view(-1, PROLOG_HCKV)[slots] = ckv.to(kv_cache.dtype)
    kr_cache.view(-1, PROLOG_DR)[slots] = kr.to(kr_cache.dtype)
    empty = x.new_empty(0, dtype=torch.float32)  # doc: outputs of other scenarios have shape [0]
    q_norm = cq.to(x.dtype).view(*lead, -1) if kw.get("query_norm_flag", False) else x.new_empty(0)
    return q_n.to(x.dtype).view(*lead, N, -1), q_r.to(x.dtype).view(*lead, N, -1), empty, q_norm, empty.clone()


def _meta(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, sin, cos, kv_cache, kr_cache, **kw):
    N = _checks(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, sin, cos, kv_cache, kr_cache, kw)
    lead = tuple(x.shape[:-1])
    q_norm = x.new_empty(*lead, PROLOG_HCQ) if kw.get("query_norm_flag", False) else x.new_empty(0)
    empty = x.new_empty(0, dtype=torch.float32)
    return x.new_empty(*lead, N, PROLOG_HCKV), x.new_empty(*lead, N, PROLOG_DR), empty, q_norm, empty.clone()


def _registered() -> bool:
    try:
        torch.ops.fake_npu.npu_mla_prolog_v3  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


if not _registered():  # once per process, as ops.py
    _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    _LIB.define(PROLOG_SCHEMA)
    _LIB.impl("npu_mla_prolog_v3", _kernel, "CompositeExplicitAutograd")
    _LIB.impl("npu_mla_prolog_v3", _meta, "Meta")

INPUTS = (
    "token_x", "weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr", "rmsnorm_gamma_cq", "rmsnorm_gamma_ckv",
    "rope_sin", "rope_cos", "kv_cache", "kr_cache",
)  # fmt: skip
"""schema: the arguments before `*`, in order (the doc's prototype names them all; callers pass them by name)."""
NZ_WEIGHTS = ("weight_dq", "weight_uq_qr", "weight_dkv_kr")
FRACTAL_NZ = 29
FORMAT_ATTR = "_fake_npu_format"
"""ops_format.ATTR: where the fake npu_format_cast records a tensor's format (this module is loaded on its own too)."""


def npu_mla_prolog_v3(*args, **kwargs):
    """torch_npu.npu_mla_prolog_v3: the weights' format checked, the call logged with the keyword names it was
    given, then the op."""
    bound = dict(zip(INPUTS, args)) | {k: v for k, v in kwargs.items() if k in INPUTS}
    for name in NZ_WEIGHTS:
        fmt = getattr(bound.get(name), FORMAT_ATTR, 2)
        if fmt != FRACTAL_NZ:
            _fail(f"npu_mla_prolog_v3: {name} must be FRACTAL_NZ (npu_format_cast(w, 29)), got format {fmt}")
    out = torch.ops.fake_npu.npu_mla_prolog_v3(*args, **kwargs)
    x = bound["token_x"]
    calls.append(("npu_mla_prolog_v3", x.numel() // x.shape[-1], out[0].shape[-2], tuple(kwargs)))
    return out
