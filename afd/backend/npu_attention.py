"""MLA's absorbed decode on Ascend: torch_npu.npu_fused_infer_attention_score (FIA) over the paged latent cache.

FIA's MLA mode is what the LongCat-Flash recipe on Atlas A3 runs for decode attention (query in latent space
plus a rope query, the latent cache as key and value, the rope cache as key_rope, a block table). Its documented
limits are narrow: they fit the full-size DeepSeek-V3 / LongCat-Flash attention (C 512, R 64, 64 or 128 heads
per rank) and none of the tiny test models. `refusal` says, in one line, why a call is outside them; the caller
then reads the cache itself (afd/model/paged_attention.py), which is also the CPU's and CUDA's path.

source ("doc"): torch_npu.npu_fused_infer_attention_score, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/
  context/torch_npu-npu_fused_infer_attention_score.md (op-plugin 7.1.0); 26.0.0 (docs/zh/custom_APIs/torch_npu/)
  relaxes the head count and block size rules: the 7.1.0 rules below hold in both.
source: the recipe, /work/shared/seeds/001 ("Attention性能优化：使能npu_fused_infer_attention_score融合kernel").

Shapes: B decoding sequences, N heads on this rank, C latent width (kv_lora_rank), R rope width, nb cache
blocks of bs slots.
"""

from __future__ import annotations

import torch

MLA_LATENT, MLA_ROPE = 512, 64
"""doc, MLA (query_rope given): query and key D 512 (D 128 takes no page attention), query_rope / key_rope D 64."""
MLA_HEADS = (32, 64, 128)
"""doc 7.1.0, D 512: query N 32, 64 or 128 (26.0.0 adds 1-16): attention TP that leaves fewer heads falls back."""
MLA_BLOCK_SIZES = (16, 128)
"""doc 7.1.0, D 512 with ND caches: block_size 16 or 128 (26.0.0: any multiple of 16 up to 1024). afd's default
block size, 16, fits."""
DTYPES = (torch.float16, torch.bfloat16)
"""doc: query (and query_rope, key, key_rope alike) float16 or bfloat16; an fp32 model falls back."""
MAX_BATCH = 65536
"""doc, Q_S = 1: B at most 65536."""


def refusal(
    q_lat: torch.Tensor, q_rope: torch.Tensor, kv_c: torch.Tensor, kv_r: torch.Tensor, ctx_lens: list[int] | None
) -> str | None:
    """Why FIA's documented MLA decode mode does not take these inputs, or None when it does."""
    B, N, C = q_lat.shape
    R, bs = q_rope.shape[-1], kv_c.shape[1]
    if ctx_lens is None:
        # FIA 7.1.0 takes actual_seq_lengths_kv as SymInt[] (host ints): a static graph would hold one step's
        # lengths as constants. torchair documents a variant taking device tensors for graphs (npu_fused_infer_
        # attention_score, https://www.hiascend.com/document/detail/zh/Pytorch/710/modthirdparty/torchairuseguide/
        # torchair_00086.html, 7.1.0): not wired yet.
        return "no host context lengths, as inside a compiled graph (FIA's actual_seq_lengths_kv are host ints)"
    if (C, R) != (MLA_LATENT, MLA_ROPE):
        return f"latent/rope widths {C}/{R}: FIA's MLA mode takes 512/64"
    if N not in MLA_HEADS:
        return f"{N} heads on this rank: FIA's MLA mode takes 32, 64 or 128"
    if bs not in MLA_BLOCK_SIZES:
        return f"block size {bs}: FIA's MLA page attention takes 16 or 128"
    if q_lat.dtype not in DTYPES or kv_c.dtype != q_lat.dtype:
        return f"dtype {q_lat.dtype} (cache {kv_c.dtype}): FIA takes float16 or bfloat16, query and cache alike"
    if B > MAX_BATCH:
        return f"{B} sequences: FIA decode takes at most {MAX_BATCH}"
    if not (kv_c.is_contiguous() and kv_r.is_contiguous()):
        # doc: key and key_rope "不支持非连续的Tensor". afd's MLA cache hands over its two planes, each contiguous
        # (afd.model.latent_cache); a caller with interleaved rows would pass strided views.
        return "latent and rope caches are strided views; FIA needs two contiguous caches"
    return None


def mla_decode(torch_npu, q_lat, q_rope, kv_c, kv_r, block_tables: torch.Tensor, ctx_lens: list[int], scale: float):
    """o_lat [B, N, C] = softmax((q_lat . c + q_rope . k_rot) * scale) @ c over each sequence's first ctx_lens[b]
    cached tokens, the blocks of row b of block_tables [B, nb]. Call only where refusal() is None."""
    B, N, C = q_lat.shape
    # BSND with Q_S = 1: [B, 1, N, D], a free view of [B, N, D]. The cache is (blocknum, blocksize, H), H = 1 head
    # x 512, the only paged layout a BSND query takes (doc). The latents are both key and value (absorbed MLA);
    # the doc asks only that key and value have one shape.
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q_lat.contiguous().view(B, 1, N, C),
        kv_c,
        kv_c,
        query_rope=q_rope.contiguous().view(B, 1, N, q_rope.shape[-1]),
        key_rope=kv_r,
        block_table=block_tables.to(torch.int32),  # doc: int32; afd's tables are int64 on the device
        actual_seq_lengths_kv=ctx_lens,
        num_heads=N,
        num_key_value_heads=1,  # doc, D 512: key N is 1 (one shared latent "head")
        scale=scale,
        input_layout="BSND",
        sparse_mode=0,  # doc, D 512 and Q_S 1: sparse 0 and no mask (the lengths bound each row)
        block_size=kv_c.shape[1],
    )
    return out.view(B, N, C)
