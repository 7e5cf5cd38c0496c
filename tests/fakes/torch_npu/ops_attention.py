"""Fake torch_npu attention ops, for tests only: npu_fused_infer_attention_score (FIA) in the one mode afd calls,
MLA's absorbed decode over a paged latent cache, with the documented constraints and plain-torch numerics.

Modelled release: op-plugin 7.1.0, as ops.py. Where op-plugin 26.0.0 relaxes a rule, the comment says so: the
fake keeps the stricter 7.1.0 rule, which every later release also accepts.
source ("doc"): torch_npu.npu_fused_infer_attention_score,
  https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_fused_infer_attention_score.md
  (op-plugin 7.1.0); .../blob/26.0.0/docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md
source ("schema"): op_plugin_functions.yaml, https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/config/
  op_plugin_functions.yaml (7.1.0): its argument order, which differs from the doc's prototype
source ("source code"): output shapes, FusedInferAttentionScoreKernelNpuOpApi.cpp (construct_fia_output_tensor),
  https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/ops/opapi/FusedInferAttentionScoreKernelNpuOpApi.cpp

Other FIA modes (no query_rope: GQA prompt or decode; Q_S > 1; TND; NZ caches; quantization) raise
NotImplementedError: a test never passes by accident on a mode this file does not compute.

Shapes: B batch, N query heads, D = 512 latent width (key and value are the latent cache), Dr = 64 rope width,
nb cache blocks of bs slots, L a sequence's keys.
"""

from __future__ import annotations

import math

import torch

NAMESPACE = "fake_npu"

# The call log ops.py keeps on the op namespace (this file too may be loaded by path, under another name).
if not hasattr(torch.ops.fake_npu, "calls"):
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls


def _fail(msg: str) -> None:
    raise RuntimeError(msg)  # TORCH_CHECK's exception, as ops.py


FIA_SCHEMA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, "
    "Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
    "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
    'int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, '
    "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
    "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"
)

FIA_DTYPES = (torch.float16, torch.bfloat16)  # doc, query on A2/A3; query_rope / key_rope alike
FIA_MLA_D, FIA_MLA_DR = 512, 64  # doc, MLA (query_rope given): query D 512 (or 128, not modelled); rope D 64
FIA_MLA_HEADS = (32, 64, 128)  # doc 7.1.0, D 512: query N 32/64/128 (26.0.0: also 1/2/4/8/16)
FIA_MLA_BLOCK_SIZES = (16, 128)  # doc 7.1.0, D 512, ND caches: block_size 16 or 128 (26.0.0: 16k <= 1024)
# doc, D 512: BSH/BSND/BNSD/TND and NBSD/NTD outputs; an NBSD output only for 1 < Q_S <= 16, and TND (a cumulative
# actual_seq_lengths) is not modelled, so Q_S = 1 here takes these three.
FIA_DECODE_LAYOUTS = ("BSH", "BSND", "BNSD")
FIA_MAX_B, FIA_MAX_N, FIA_MAX_D = 65536, 256, 512  # doc, Q_S = 1: B <= 65536, N <= 256, D <= 512
# doc, D 512: "不支持开启SoftMaxLse、左padding、tensorlist、pse、prefix、伪量化、全量化、后量化" (no softmax_lse,
# left padding, tensor lists, pse, prefix, fake / full / post quantization).
_MLA_UNSUPPORTED = (
    "pse_shift", "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
    "actual_shared_prefix_len", "antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset",
    "value_antiquant_scale", "value_antiquant_offset", "key_rope_antiquant_scale", "dequant_scale1", "quant_scale1",
    "dequant_scale2", "quant_scale2", "quant_offset2",
)  # fmt: skip


def _q_heads(query: torch.Tensor, layout: str, num_heads: int) -> tuple[int, int, int, int]:
    """(B, Q_S, N, D) of query under input_layout."""
    if layout == "BNSD":
        B, N, S, D = query.shape
    elif layout == "BSND":
        B, S, N, D = query.shape
    else:  # BSH: H = N * D
        B, S, H = query.shape
        N, D = num_heads, H // max(num_heads, 1)
    return B, S, N, D


def _fia_checks(query, key, value, kw) -> tuple[int, int, int, list[int]]:
    """Every documented rule of the MLA paged decode mode; returns (B, N, block_size, kv lengths per batch)."""
    q_rope, k_rope = kw.get("query_rope"), kw.get("key_rope")
    if (q_rope is None) != (k_rope is None):  # doc: "要求同时配置或同时不配置"
        _fail("npu_fused_infer_attention_score: query_rope and key_rope must be given together")
    layout = kw.get("input_layout", "BSH")
    if q_rope is None or layout not in FIA_DECODE_LAYOUTS:
        raise NotImplementedError(f"fake npu_fused_infer_attention_score: only MLA decode is modelled ({layout})")
    if query.dim() != (3 if layout == "BSH" else 4):
        _fail(f"npu_fused_infer_attention_score: input_layout {layout} needs a {3 if layout == 'BSH' else 4}-D query")
    num_heads = kw.get("num_heads", 1)
    B, S, N, D = _q_heads(query, layout, num_heads)
    if S != 1:
        raise NotImplementedError("fake npu_fused_infer_attention_score: only Q_S = 1 is modelled")
    for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", q_rope), ("key_rope", k_rope)):
        if not t.is_contiguous():  # doc, each of the five: "不支持非连续的Tensor"
            _fail(f"npu_fused_infer_attention_score: {name} must be contiguous (non-contiguous tensors unsupported)")
    if query.dtype not in FIA_DTYPES:
        _fail(f"npu_fused_infer_attention_score: query must be float16 or bfloat16, got {query.dtype}")
    if key.dtype in (torch.int8, torch.int32):
        raise NotImplementedError("fake npu_fused_infer_attention_score: int8/int4 caches are not modelled")
    if key.dtype not in FIA_DTYPES or value.dtype != key.dtype:  # doc, page attention: key/value float16/bfloat16
        _fail(f"npu_fused_infer_attention_score: key/value must be float16 or bfloat16 alike, got {key.dtype}")
    if q_rope.dtype != query.dtype or k_rope.dtype != key.dtype:  # doc: rope dtype as query's / key's
        _fail("npu_fused_infer_attention_score: query_rope / key_rope dtype must equal query's / key's")
    if num_heads != N:  # doc: num_heads must equal query's N
        _fail(f"npu_fused_infer_attention_score: num_heads {num_heads} != query's N {N}")
    if B > FIA_MAX_B or N > FIA_MAX_N or D > FIA_MAX_D:
        _fail(f"npu_fused_infer_attention_score: Q_S = 1 takes B <= 65536, N <= 256, D <= 512; got {B}, {N}, {D}")
    if D != FIA_MLA_D:  # doc: with query_rope, D 512 or 128; 128 takes no page attention (7.1.0): not afd's mode
        _fail(f"npu_fused_infer_attention_score: MLA query D must be 512 (or 128 without page attention), got {D}")
    if N not in FIA_MLA_HEADS:
        _fail(f"npu_fused_infer_attention_score: MLA with D 512 takes query N 32, 64 or 128, got {N}")
    want = (B, 1, N * FIA_MLA_DR) if layout == "BSH" else (*query.shape[:-1], FIA_MLA_DR)
    if q_rope.shape != want:
        _fail(f"npu_fused_infer_attention_score: query_rope must be query's shape with D 64, got {tuple(q_rope.shape)}")
    if kw.get("softmax_lse_flag", False):
        _fail("npu_fused_infer_attention_score: MLA with D 512 does not support softmax_lse_flag")
    for name in _MLA_UNSUPPORTED:
        if kw.get(name) is not None:
            _fail(f"npu_fused_infer_attention_score: MLA with D 512 does not support {name}")
    # doc, D 512, Q_S = 1: "只支持sparse=0且不传mask" (26.0.0 also takes 3 and 4)
    if kw.get("sparse_mode", 0) != 0 or kw.get("atten_mask") is not None:
        _fail("npu_fused_infer_attention_score: MLA decode (Q_S 1) supports only sparse_mode 0 without atten_mask")
    if kw.get("inner_precise", 0) not in (0, 1):  # doc: Q_S = 1 takes inner_precise 0 or 1
        _fail(f"npu_fused_infer_attention_score: Q_S 1 supports inner_precise 0 or 1, got {kw.get('inner_precise')}")
    if kw.get("antiquant_mode", 0) not in (0, 1):  # doc: Q_S = 1, other values fail
        _fail("npu_fused_infer_attention_score: antiquant_mode must be 0 or 1")
    return (B, N, *_paged_checks(key, value, k_rope, kw, B, layout))


def _paged_checks(key, value, k_rope, kw, B: int, layout: str) -> tuple[int, list[int]]:
    table, bs = kw.get("block_table"), kw.get("block_size", 0)
    if table is None:  # doc, D 512: "必须开启PageAttention"
        _fail("npu_fused_infer_attention_score: MLA with D 512 requires page attention (a block_table)")
    if bs not in FIA_MLA_BLOCK_SIZES:
        _fail(f"npu_fused_infer_attention_score: MLA page attention takes block_size 16 or 128, got {bs}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != B:  # doc: int32; 2-D, first dim B
        _fail(f"npu_fused_infer_attention_score: block_table must be int32 [B={B}, n], got {table.dtype} "
              f"{tuple(table.shape)}")  # fmt: skip
    # doc: for BSH/BSND queries the cache is (blocknum, blocksize, H) only; BNSD also takes (blocknum, KV_N, bs, D)
    # (not modelled). doc, D 512: key N 1 and D 512, key_rope D 64 and otherwise key's shape.
    if key.dim() != 3 or key.shape[1] != bs:
        _fail(f"npu_fused_infer_attention_score: key must be (blocknum, block_size={bs}, H), got {tuple(key.shape)}")
    if value.shape != key.shape:  # doc: "key和value的shape需保证一致"
        _fail("npu_fused_infer_attention_score: key and value must have the same shape")
    if key.shape[-1] != FIA_MLA_D or kw.get("num_key_value_heads", 0) != 1:
        _fail("npu_fused_infer_attention_score: MLA with D 512 takes a key of N 1 and D 512 (num_key_value_heads=1)")
    if k_rope.shape != (*key.shape[:-1], FIA_MLA_DR):
        _fail(f"npu_fused_infer_attention_score: key_rope must be key's shape with D 64, got {tuple(k_rope.shape)}")
    if key.numel() >= 2**31:  # doc: "shape所有维度相乘不能超过int32的表示范围"
        _fail("npu_fused_infer_attention_score: key/value element count exceeds int32")
    lens = kw.get("actual_seq_lengths_kv")
    if lens is None:  # doc: "page attention场景下，必须传入actual_seq_lengths_kv"
        _fail("npu_fused_infer_attention_score: page attention requires actual_seq_lengths_kv")
    if len(lens) == 1:  # doc: length 1 -> every batch; >= B -> the first B; other lengths unsupported
        lens = list(lens) * B
    elif len(lens) >= B:
        lens = list(lens[:B])
    else:
        _fail(f"npu_fused_infer_attention_score: actual_seq_lengths_kv needs 1 or >= {B} values, got {len(lens)}")
    need = [math.ceil(n / bs) for n in lens]
    if any(n < 0 or n > table.shape[1] * bs for n in lens):  # doc: "值不大于KV_S"; second dim >= maxBlockNumPerSeq
        _fail(f"npu_fused_infer_attention_score: block_table's {table.shape[1]} columns hold < {max(lens)} keys")
    if key.shape[0] < sum(need):  # doc: blocknum not below the sum of every batch's blocks
        _fail(f"npu_fused_infer_attention_score: {key.shape[0]} blocks, fewer than the batches' {sum(need)}")
    return bs, lens


def _fia_kernel(query, key, value, **kw):
    B, N, bs, lens = _fia_checks(query, key, value, kw)
    layout, scale = kw.get("input_layout", "BSH"), kw.get("scale", 1.0)
    # Q_S = 1: BSH [B, 1, N*D], BSND [B, 1, N, D] and BNSD [B, N, 1, D] all hold [B, N, D] in this order
    q, qr = query.reshape(B, N, FIA_MLA_D), kw["query_rope"].reshape(B, N, FIA_MLA_DR)
    table, out = kw["block_table"], torch.zeros(B, N, FIA_MLA_D, dtype=torch.float32, device=query.device)
    for b, n in enumerate(lens):
        if n == 0:  # not documented per batch (only an empty key: zeros); afd never attends over no key
            continue
        blocks = table[b, : math.ceil(n / bs)].long()  # read on the device: no host sync
        k = key.index_select(0, blocks).reshape(-1, FIA_MLA_D)[:n].float()  # [L, D]
        kr = kw["key_rope"].index_select(0, blocks).reshape(-1, FIA_MLA_DR)[:n].float()  # [L, Dr]
        v = value.index_select(0, blocks).reshape(-1, FIA_MLA_D)[:n].float()
        # the doc's formula, softmax(q k^T * scale) v, with the rope part of the score added (MLA): fp32 throughout
        s = (q[b].float() @ k.T + qr[b].float() @ kr.T) * scale  # [N, L]
        out[b] = torch.softmax(s, dim=-1) @ v
    calls.append(("npu_fused_infer_attention_score", layout, B, N, bs))
    return out.to(query.dtype).reshape(query.shape), torch.zeros(1, dtype=torch.float32, device=query.device)


def _fia_meta(query, key, value, **kw):
    _fia_checks(query, key, value, kw)
    # source code: the output is query's shape for BSH/BSND and for BNSD with a block_table; the lse a [1] zero
    # without softmax_lse_flag
    return query.new_empty(query.shape), query.new_empty((1,), dtype=torch.float32)


def _registered() -> bool:
    try:
        torch.ops.fake_npu.npu_fused_infer_attention_score  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


if not _registered():  # once per process, as ops.py
    _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    _LIB.define(FIA_SCHEMA)
    _LIB.impl("npu_fused_infer_attention_score", _fia_kernel, "CompositeExplicitAutograd")
    _LIB.impl("npu_fused_infer_attention_score", _fia_meta, "Meta")

# torch_npu.<op> is the op packet (ops.py says why)
npu_fused_infer_attention_score = torch.ops.fake_npu.npu_fused_infer_attention_score
